"""The compactor's gRPC server: a thin servicer over ``CompactorEngine``.

    python -m compactor_service --socket /run/sglang-evict/compactor.sock
    sglang-evict compactor --socket ... [--tcp 127.0.0.1:50151] [--redis-url ...]

* Listens on a Unix socket by default (file mode 0600; its directory is created 0700
  if missing), on TCP only when asked.
* Serves ``grpc.health.v1.Health``: SERVING once listening, NOT_SERVING while draining.
* SIGTERM/SIGINT: health goes NOT_SERVING, in-flight passes finish (up to
  ``--drain-s``), then the process exits 0 and removes its socket.
* Deadlines: a pass whose caller stopped waiting (deadline passed, call cancelled)
  by the time its kernel would start moves nothing (DEADLINE_EXCEEDED).
* Logs are JSON lines (``--log-format text`` for humans).
* Pools whose client process has exited are unregistered (their mappings closed)
  within ``--reap-interval-s``.

Domain errors map to status codes in one place (``_STATUS``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from compactor_service import tracing
from compactor_service.compactor import LeaseRefused, PassAbandoned
from compactor_service.engine import CompactorEngine, StaleEpoch, UnknownPool
from compactor_service.health import DEFAULT_SOCKET, SERVICE_NAME
from compactor_service.plan import PlanError
from compactor_service.redis_leases import LeaseStoreUnavailable
from compactor_service.shared_pool import PoolMappingError
from compactor_service.v1 import compactor_pb2 as pb
from compactor_service.v1 import compactor_pb2_grpc as pb_grpc
from compactor_service.wire import claim_from_proto, layout_from_proto, plan_from_proto

logger = logging.getLogger("sglang_evict.compactor")

# Most specific first: LeaseRefused is a PlanError.
_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (UnknownPool, grpc.StatusCode.NOT_FOUND),
    (StaleEpoch, grpc.StatusCode.FAILED_PRECONDITION),
    (LeaseRefused, grpc.StatusCode.ABORTED),  # fencing: a newer holder or no lease
    (PlanError, grpc.StatusCode.INVALID_ARGUMENT),
    (PoolMappingError, grpc.StatusCode.INVALID_ARGUMENT),
    (PassAbandoned, grpc.StatusCode.DEADLINE_EXCEEDED),
    (LeaseStoreUnavailable, grpc.StatusCode.UNAVAILABLE),
)


def status_for(error: BaseException) -> grpc.StatusCode:
    for kind, code in _STATUS:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def _still_wanted(context) -> bool:
    """The client is still waiting: the call is active and its deadline not passed."""
    remaining_s = context.time_remaining()
    return context.is_active() and (remaining_s is None or remaining_s > 0)


class CompactorServicer(pb_grpc.CompactorServicer):
    def __init__(self, engine: CompactorEngine) -> None:
        self.engine = engine

    def _abort(self, context, error: BaseException, what: str):
        code = status_for(error)
        logger.warning("%s refused", what, extra={"status": code.name, "error": str(error)})
        context.abort(code, str(error))

    def RegisterPool(self, request, context):
        try:
            layout = layout_from_proto(request.layout)
            pool_id, epoch = self.engine.register_pool(layout, request.client_id)
        except (PoolMappingError, ValueError) as error:
            self._abort(context, error, "RegisterPool")
        logger.info(
            "pool registered",
            extra={
                "pool_id": pool_id,
                "epoch": epoch,
                "client_id": request.client_id,
                "layers": layout.num_layers,
                "slots": layout.num_slots,
                "device": layout.device,
            },
        )
        return pb.RegisterPoolResponse(pool_id=pool_id, epoch=epoch)

    def UnregisterPool(self, request, context):
        try:
            self.engine.unregister_pool(request.pool_id, request.epoch)
        except (UnknownPool, StaleEpoch) as error:
            self._abort(context, error, "UnregisterPool")
        logger.info("pool unregistered", extra={"pool_id": request.pool_id})
        return pb.UnregisterPoolResponse()

    def Compact(self, request, context):
        remaining_s = context.time_remaining()
        if remaining_s is not None and remaining_s <= 0:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed: nothing moved")
        try:
            plans = [plan_from_proto(p) for p in request.plans]
            result = self.engine.compact(
                request.pool_id,
                request.epoch,
                plans,
                claim_from_proto(request),
                still_wanted=lambda: _still_wanted(context),
            )
        except Exception as error:  # mapped to a status; nothing moved
            self._abort(context, error, "Compact")
        logger.debug(
            "pass done",
            extra={
                "pool_id": request.pool_id,
                "plans": len(plans),
                "slots_moved": result.slots_moved,
                "duration_s": result.duration_s,
            },
        )
        return pb.CompactResponse(
            slots_moved=result.slots_moved,
            bytes_moved=result.bytes_moved,
            duration_s=result.duration_s,
            kernel=result.kernel,
            epoch=request.epoch,
        )

    def Stats(self, request, context):
        s = self.engine.stats
        return pb.StatsResponse(
            pools=len(self.engine.pools),
            passes=s.passes,
            passes_rejected=s.passes_rejected,
            slots_moved=s.slots_moved,
            bytes_moved=s.bytes_moved,
            kernel_seconds=s.kernel_seconds,
            epoch_base=self.engine.epoch_base,
        )


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, message and any ``extra`` fields."""

    _standard = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in self._standard})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(log_format: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger("sglang_evict")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def bind_unix_socket(server: grpc.Server, socket_path: Path) -> None:
    """Bind ``socket_path`` with mode 0600 (directory created 0700 if missing)."""
    directory = socket_path.parent
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True)
    if socket_path.exists() or socket_path.is_symlink():
        socket_path.unlink()  # a stale socket of a previous run
    old_umask = os.umask(0o177)
    try:
        if server.add_insecure_port(f"unix:{socket_path}") == 0:
            raise OSError(f"cannot listen on unix:{socket_path}")
    finally:
        os.umask(old_umask)


class CompactorServer:
    """A running compactor: gRPC server, health service, reaper of dead clients' pools."""

    def __init__(
        self,
        engine: CompactorEngine,
        *,
        socket_path: str | None = DEFAULT_SOCKET,
        tcp_address: str | None = None,
        max_workers: int = 4,
        reap_interval_s: float = 5.0,
    ) -> None:
        if socket_path is None and tcp_address is None:
            raise ValueError("the compactor needs a Unix socket path or a TCP address")
        self.engine = engine
        self.socket_path = Path(socket_path) if socket_path else None
        self.tcp_address = tcp_address
        interceptors = []
        from opentelemetry.instrumentation.grpc import server_interceptor

        interceptors.append(server_interceptor())
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers), interceptors=interceptors
        )
        pb_grpc.add_CompactorServicer_to_server(CompactorServicer(engine), self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.reap_interval_s = reap_interval_s
        self._stopped = threading.Event()

    def start(self) -> None:
        if self.socket_path is not None:
            bind_unix_socket(self.server, self.socket_path)
            os.chmod(self.socket_path, 0o600)
        if self.tcp_address is not None:
            if self.server.add_insecure_port(self.tcp_address) == 0:
                raise OSError(f"cannot listen on {self.tcp_address}")
        self.server.start()
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        threading.Thread(target=self._reap, daemon=True, name="pool-reaper").start()
        logger.info(
            "compactor serving",
            extra={
                "socket": str(self.socket_path) if self.socket_path else None,
                "tcp": self.tcp_address,
                "kernel": self.engine.kernel,
                "leases": type(self.engine.leases).__name__ if self.engine.leases else None,
                "epoch_base": self.engine.epoch_base,
                "pid": os.getpid(),
            },
        )

    def _reap(self) -> None:
        while not self._stopped.wait(self.reap_interval_s):
            for pool_id in self.engine.drop_pools_of_dead_clients():
                logger.info("pool of an exited client unregistered", extra={"pool_id": pool_id})

    def stop(self, drain_s: float = 10.0) -> None:
        """Drain: NOT_SERVING, finish in-flight passes (at most ``drain_s``), stop."""
        self.health.enter_graceful_shutdown()
        start = time.perf_counter()
        self.server.stop(grace=drain_s).wait()
        self._stopped.set()
        if self.socket_path is not None:
            self.socket_path.unlink(missing_ok=True)
        logger.info("compactor stopped", extra={"drain_s": time.perf_counter() - start})

    def wait(self) -> None:
        self.server.wait_for_termination()


def build_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="python -m compactor_service", description="the sglang-evict compactor sidecar"
    )
    parser.add_argument(
        "--socket",
        default=DEFAULT_SOCKET,
        help=f"Unix socket path (mode 0600); default {DEFAULT_SOCKET}",
    )
    parser.add_argument("--tcp", default=None, help="also listen on HOST:PORT (off by default)")
    parser.add_argument("--no-socket", action="store_true", help="TCP only (needs --tcp)")
    parser.add_argument(
        "--kernel",
        default="auto",
        choices=["auto", "triton", "torch-reference"],
        help="repack kernel (auto: Triton on CUDA, the torch reference on CPU)",
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        help="check pass leases and shared-page pins in this Redis (redis://host:port/db)",
    )
    parser.add_argument("--lease-namespace", default="default")
    parser.add_argument("--drain-s", type=float, default=10.0)
    parser.add_argument("--reap-interval-s", type=float, default=5.0)
    parser.add_argument(
        "--supervise",
        action="store_true",
        help="restart the server process whenever it dies (a forked child; restarts in ms)",
    )
    parser.add_argument(
        "--fault-injection",
        default=None,
        metavar="SEED:PROBABILITY",
        help="testing only: SIGKILL the server at a random point of a pass with this "
        "probability per pass",
    )
    parser.add_argument("--log-format", default="json", choices=["json", "text"])
    parser.add_argument("--log-level", default="info")
    return parser


def run(args: argparse.Namespace) -> int:
    """Start the server from parsed arguments and block until SIGTERM/SIGINT."""
    configure_logging(args.log_format, args.log_level)
    if args.no_socket and not args.tcp:
        print("error: --no-socket needs --tcp HOST:PORT", file=sys.stderr)
        return 2
    fault = None
    if args.fault_injection:
        try:
            seed_text, probability_text = args.fault_injection.split(":")
            fault = (int(seed_text), float(probability_text))
        except ValueError:
            print("error: --fault-injection takes SEED:PROBABILITY, e.g. 7:0.5", file=sys.stderr)
            return 2
    if args.supervise:
        return _supervise(args, fault)
    return _serve(args, fault)


def _serve(args: argparse.Namespace, fault: tuple[int, float] | None, generation: int = 0) -> int:
    provider_configured = tracing.configure_from_env()
    leases = None
    if args.redis_url:
        from compactor_service.redis_leases import RedisLeaseStore

        leases = RedisLeaseStore(args.redis_url, namespace=args.lease_namespace)
    fault_hook = None
    if fault is not None:
        from compactor_service.engine import random_kill_hook

        fault_hook = random_kill_hook(fault[0] + generation, fault[1])
    server = CompactorServer(
        CompactorEngine(kernel=args.kernel, leases=leases, fault_hook=fault_hook),
        socket_path=None if args.no_socket else args.socket,
        tcp_address=args.tcp,
        reap_interval_s=args.reap_interval_s,
    )
    stop_requested = threading.Event()

    def request_stop(signum, _frame):
        logger.info("shutdown requested", extra={"signal": signal.Signals(signum).name})
        stop_requested.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        server.start()
    except OSError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    stop_requested.wait()
    server.stop(drain_s=args.drain_s)
    if provider_configured:
        from opentelemetry import trace

        trace.get_tracer_provider().shutdown()
    return 0


def _supervise(args: argparse.Namespace, fault: tuple[int, float] | None) -> int:
    """Run the server in a forked child and restart it whenever it dies (a restarted
    compactor has a new epoch; clients re-register). The parent has imported
    everything, so a restart takes milliseconds; it never touches CUDA or gRPC objects,
    so forking is safe. SIGTERM/SIGINT are forwarded and end the loop."""
    stopping = threading.Event()
    child = [0]

    def forward(signum, _frame):
        stopping.set()
        if child[0]:
            os.kill(child[0], signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    generation = 0
    while True:
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            code = 1
            try:
                code = _serve(args, fault, generation)
            finally:
                os._exit(code)
        child[0] = pid
        _, status = os.waitpid(pid, 0)
        child[0] = 0
        if stopping.is_set():
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 0
        logger.error(
            "compactor process died; restarting",
            extra={
                "pid": pid,
                "exit": os.waitstatus_to_exitcode(status),
                "restarts": generation + 1,
            },
        )
        generation += 1


def main(argv: list[str] | None = None) -> int:
    return run(build_arg_parser().parse_args(argv))
