"""The compactor's gRPC transport: a thin servicer over ``CompactorEngine`` and the
server that hosts it (listeners, TLS, health, reaper, drain).

* Requests arrive as bytes and are parsed here, so that even an unparsable message gets
  a status of ours (``INVALID_ARGUMENT``) rather than gRPC's generic ``INTERNAL``.
* Before the parse, the bytes are walked (``wire_bounds``): the method's own message
  limit, and the number of plans, buffer handles and fields a parse would build
  (``RESOURCE_EXHAUSTED``, whatever pool the request names; bytes that are no wire
  format: ``INVALID_ARGUMENT``). The walk reads O(bounds) fields, so the parse that
  follows is bounded too, and one client's flood no longer holds the GIL for seconds
  while other clients' passes wait.
* Domain errors map to status codes in one place (``_STATUS``); every refusal's message
  and log line is bounded and redacted.
* Before any work proportional to the request: pool lookup (``NOT_FOUND`` /
  ``FAILED_PRECONDITION``), per-call bounds and the per-pool in-flight bound
  (``RESOURCE_EXHAUSTED``, see ``limits``); while decoding and validating, the caller's
  deadline is checked between plans (``DEADLINE_EXCEEDED``, nothing moved).
* Refusal and internal-error log lines are rate-limited per client and cause
  (``logs.LogRateLimiter``, keyed by the peer's address without its port, the method
  and the status), with a line counting what was suppressed. The key uses nothing the
  request says (pool or client id): a flooder could mint a fresh id per call and a
  fresh key with it. On the Unix socket every client has the same peer (all run as the
  compactor's user: the socket is 0600), so they share one key per cause.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from compactor_service.compactor import (
    CAUSE_LEASE_STORE_DOWN,
    CAUSE_METADATA_KEY,
    LeaseRefused,
    PassAbandoned,
)
from compactor_service.engine import BadClientId, CompactorEngine, StaleEpoch, UnknownPool
from compactor_service.health import SERVICE_NAME
from compactor_service.limits import CLIP_CHARS, InFlight, LimitExceeded, clip, clip_detail
from compactor_service.logs import LogRateLimiter, Suppressed
from compactor_service.plan import PlanError
from compactor_service.redis_leases import LeaseStoreUnavailable
from compactor_service.secrets import redact_text
from compactor_service.shared_pool import (
    PoolDeviceUnavailable,
    PoolFileMissing,
    PoolFileRefused,
    PoolFileTruncated,
    PoolMappingError,
)
from compactor_service.v1 import compactor_pb2 as pb
from compactor_service.wire import (
    arena_layout_from_proto,
    claim_from_proto,
    layout_from_proto,
    plan_from_proto,
)
from compactor_service.wire_bounds import (
    MalformedWire,
    RequestBounds,
    check_request,
    request_bounds,
)

logger = logging.getLogger("sglang_evict.compactor")


class MalformedRequest(ValueError):
    """The request bytes are not the method's message."""


# Most specific first: LeaseRefused is a PlanError, the Pool* errors PoolMappingErrors.
_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (UnknownPool, grpc.StatusCode.NOT_FOUND),
    (StaleEpoch, grpc.StatusCode.FAILED_PRECONDITION),
    (LimitExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (LeaseRefused, grpc.StatusCode.ABORTED),  # fencing: a newer holder, no lease, a pin
    (PassAbandoned, grpc.StatusCode.DEADLINE_EXCEEDED),
    (LeaseStoreUnavailable, grpc.StatusCode.UNAVAILABLE),
    (PoolFileTruncated, grpc.StatusCode.DATA_LOSS),  # the copy may have started
    (PoolFileMissing, grpc.StatusCode.NOT_FOUND),
    (PoolFileRefused, grpc.StatusCode.PERMISSION_DENIED),
    (PoolDeviceUnavailable, grpc.StatusCode.FAILED_PRECONDITION),
    (PoolMappingError, grpc.StatusCode.INVALID_ARGUMENT),
    (PlanError, grpc.StatusCode.INVALID_ARGUMENT),
    (BadClientId, grpc.StatusCode.INVALID_ARGUMENT),
    (MalformedRequest, grpc.StatusCode.INVALID_ARGUMENT),
)


def status_for(error: BaseException) -> grpc.StatusCode:
    for kind, code in _STATUS:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def peer_host(peer: str) -> str:
    """The caller's address without its port (``ipv4:127.0.0.1:5301`` ->
    ``ipv4:127.0.0.1``), cut to ``CLIP_CHARS``: a client gets a new port per
    connection, and a key per port would let it reset its log budget by reconnecting."""
    kind, _, address = peer.partition(":")
    if kind == "ipv4":
        address = address.rpartition(":")[0] or address
    elif kind == "ipv6" and address.startswith("["):
        address = address.partition("]")[0] + "]"
    return f"{kind}:{address}"[:CLIP_CHARS]


def _still_wanted(context) -> bool:
    """The client is still waiting: the call is active and its deadline not passed."""
    remaining_s = context.time_remaining()
    return context.is_active() and (remaining_s is None or remaining_s > 0)


class CompactorServicer:
    """``sglang_evict.compactor.v1.Compactor`` over a ``CompactorEngine``."""

    def __init__(self, engine: CompactorEngine, refusal_log: LogRateLimiter | None = None) -> None:
        self.engine = engine
        self.inflight = InFlight(
            engine.limits.max_inflight_per_pool, "pool", "--max-inflight-per-pool"
        )
        self.bounds = request_bounds(engine.limits)
        self.refusal_log = refusal_log or LogRateLimiter()

    def _abort(self, context, error: BaseException, what: str):
        code = status_for(error)
        if isinstance(error, LeaseStoreUnavailable):
            # UNAVAILABLE is also what a client sees when the compactor itself is down;
            # this says it was the lease store, before anything moved.
            context.set_trailing_metadata(((CAUSE_METADATA_KEY, CAUSE_LEASE_STORE_DOWN),))
        detail = clip_detail(redact_text(str(error)))
        peer = peer_host(context.peer())
        log_it, due = self.refusal_log.admit((peer, what, code.name))
        self._log_suppressed(due)
        if code == grpc.StatusCode.INTERNAL:
            if log_it:
                logger.error(
                    "%s failed", what, exc_info=error, extra={"status": code.name, "peer": peer}
                )
            detail = f"internal error ({type(error).__name__}); see the compactor's log"
        elif log_it:
            logger.warning(
                "%s refused", what, extra={"status": code.name, "error": detail, "peer": peer}
            )
        context.abort(code, detail)

    def log_suppressed(self, final: bool = False) -> None:
        """Log the counts of refusals whose windows ended (``final``: every count, at
        shutdown); the server's reaper calls this every sweep."""
        self._log_suppressed(self.refusal_log.drain() if final else self.refusal_log.expired())

    def _log_suppressed(self, due: list[Suppressed]) -> None:
        for summary in due:
            seconds = f"{summary.seconds:.0f} s"
            if summary.key is None:
                logger.warning(
                    "%d more refusals of %d kinds suppressed in the last %s",
                    summary.count,
                    summary.kinds,
                    seconds,
                    extra={"suppressed": summary.count},
                )
                continue
            peer, what, status = summary.key
            internal = status == grpc.StatusCode.INTERNAL.name
            logger.log(
                logging.ERROR if internal else logging.WARNING,
                "%s %s: %d more %s of this kind suppressed in the last %s",
                what,
                "failed" if internal else "refused",
                summary.count,
                "failures" if internal else "refusals",
                seconds,
                extra={"status": status, "peer": peer, "suppressed": summary.count},
            )

    def handlers(self) -> grpc.GenericRpcHandler:
        """The service's method handlers; each parses its own request bytes."""
        methods = {
            "RegisterPool": (pb.RegisterPoolRequest, pb.RegisterPoolResponse, self.RegisterPool),
            "UnregisterPool": (
                pb.UnregisterPoolRequest,
                pb.UnregisterPoolResponse,
                self.UnregisterPool,
            ),
            "Heartbeat": (pb.HeartbeatRequest, pb.HeartbeatResponse, self.Heartbeat),
            "RegisterArena": (
                pb.RegisterArenaRequest,
                pb.RegisterArenaResponse,
                self.RegisterArena,
            ),
            "Compact": (pb.CompactRequest, pb.CompactResponse, self.Compact),
            "Stats": (pb.StatsRequest, pb.StatsResponse, self.Stats),
        }
        return grpc.method_handlers_generic_handler(
            pb.DESCRIPTOR.services_by_name["Compactor"].full_name,
            {
                name: grpc.unary_unary_rpc_method_handler(
                    self._guarded(name, request_type, self.bounds[name], behavior),
                    request_deserializer=None,
                    response_serializer=response_type.SerializeToString,
                )
                for name, (request_type, response_type, behavior) in methods.items()
            },
        )

    def _guarded(self, name: str, request_type, bounds: RequestBounds, behavior: Callable):
        def handle(data: bytes, context):
            try:
                try:
                    check_request(data, bounds)  # O(bounds), before the parse allocates
                    request = request_type.FromString(data)
                except MalformedWire as error:
                    raise MalformedRequest(
                        f"{name}: the request is not a valid {request_type.DESCRIPTOR.name}: "
                        f"{error}"
                    ) from None
                except DecodeError:
                    raise MalformedRequest(
                        f"{name}: the request is not a valid {request_type.DESCRIPTOR.name}"
                    ) from None
                return behavior(request, context)
            except Exception as error:  # mapped to a status; nothing moved
                self._abort(context, error, name)

        return handle

    def RegisterPool(self, request, context):
        layout = layout_from_proto(request.layout)
        pool_id, epoch = self.engine.register_pool(layout, request.client_id, request.fence_file)
        limits = self.engine.limits
        logger.info(
            "pool registered",
            extra={
                "pool_id": pool_id,
                "epoch": epoch,
                "client_id": clip(request.client_id),
                "layers": layout.num_layers,
                "slots": layout.num_slots,
                "device": layout.device,
            },
        )
        return pb.RegisterPoolResponse(
            pool_id=pool_id,
            epoch=epoch,
            limits=pb.PoolLimits(
                max_plans_per_call=limits.max_plans_per_call,
                max_moves_per_call=limits.max_moves_per_call,
                max_message_bytes=limits.max_message_bytes,
                lease_ms=int(limits.pool_lease_s * 1000),
            ),
        )

    def RegisterArena(self, request, context):
        layout = arena_layout_from_proto(request.layout)
        arena_bytes = self.engine.register_arena(request.pool_id, request.epoch, layout)
        logger.info(
            "tier arena registered",
            extra={
                "pool_id": clip(request.pool_id),
                "bits": layout.bits,
                "slots": layout.num_slots,
                "bytes": arena_bytes,
            },
        )
        return pb.RegisterArenaResponse(arena_bytes=arena_bytes)

    def UnregisterPool(self, request, context):
        self.engine.unregister_pool(request.pool_id, request.epoch)
        logger.info("pool unregistered", extra={"pool_id": request.pool_id})
        return pb.UnregisterPoolResponse()

    def Heartbeat(self, request, context):
        lease_s = self.engine.heartbeat(request.pool_id, request.epoch)
        return pb.HeartbeatResponse(lease_ms=int(lease_s * 1000))

    def Compact(self, request, context):
        def still_wanted() -> bool:
            return _still_wanted(context)

        if not still_wanted():
            raise PassAbandoned("deadline passed before the pass started: nothing moved")
        pool = self.engine.pool(request.pool_id, request.epoch)
        self.engine.check_call_size(len(request.plans), 0)
        self.engine.check_call_size(0, sum(len(p.src_slots_le64) // 8 for p in request.plans))
        self.inflight.enter(pool.pool_id)
        try:
            plans = []
            for index, message in enumerate(request.plans):
                if not still_wanted():
                    raise PassAbandoned(
                        f"the caller stopped waiting while plan {index} was decoded: nothing moved"
                    )
                plans.append(plan_from_proto(message, max_values=pool.layout.num_slots))
            result = self.engine.compact(
                request.pool_id,
                request.epoch,
                plans,
                claim_from_proto(request),
                still_wanted=still_wanted,
                call_seq=request.call_seq,
            )
        finally:
            self.inflight.leave(pool.pool_id)
        logger.debug(
            "pass done",
            extra={
                "pool_id": pool.pool_id,
                "plans": len(plans),
                "slots_moved": result.slots_moved,
                "duration_s": result.duration_s,
            },
        )
        return pb.CompactResponse(
            groups_demoted=result.groups_demoted,
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
            pools_expired=s.pools_expired,
            groups_demoted=s.groups_demoted,
        )


def bind_unix_socket(server: grpc.Server, socket_path: Path) -> None:
    """Bind ``socket_path`` with mode 0600. Its directory must already be private
    (``runtime_dir.ensure_private_dir``); a stale socket of a previous run is replaced,
    any other file there is refused."""
    try:
        info = os.lstat(socket_path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(info.st_mode):
            raise OSError(f"{socket_path} exists and is not a socket; remove it or choose --socket")
        socket_path.unlink()
    old_umask = os.umask(0o177)
    try:
        if server.add_insecure_port(f"unix:{socket_path}") == 0:
            raise OSError(f"cannot listen on unix:{socket_path}")
    finally:
        os.umask(old_umask)


class CompactorServer:
    """A running compactor: gRPC server, health service, reaper of expired pools."""

    def __init__(
        self,
        engine: CompactorEngine,
        *,
        socket_path: str | None,
        tcp_address: str | None = None,
        tcp_credentials: grpc.ServerCredentials | None = None,
        max_workers: int = 8,
        reap_interval_s: float = 5.0,
    ) -> None:
        if socket_path is None and tcp_address is None:
            raise ValueError("the compactor needs a Unix socket path or a TCP address")
        self.engine = engine
        self.socket_path = Path(socket_path) if socket_path else None
        self.tcp_address = tcp_address
        self.tcp_credentials = tcp_credentials
        from opentelemetry.instrumentation.grpc import server_interceptor

        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers),
            interceptors=[server_interceptor()],
            options=[
                ("grpc.max_receive_message_length", engine.limits.max_message_bytes),
                ("grpc.max_send_message_length", 1 << 20),
            ],
            maximum_concurrent_rpcs=8 * max_workers,
        )
        self.servicer = CompactorServicer(engine)
        self.server.add_generic_rpc_handlers((self.servicer.handlers(),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.reap_interval_s = reap_interval_s
        self._stopped = threading.Event()

    def start(self) -> None:
        if self.socket_path is not None:
            bind_unix_socket(self.server, self.socket_path)
        if self.tcp_address is not None:
            if self.tcp_credentials is None:
                bound = self.server.add_insecure_port(self.tcp_address)
            else:
                bound = self.server.add_secure_port(self.tcp_address, self.tcp_credentials)
            if bound == 0:
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
                "tls": self.tcp_credentials is not None,
                "pool_dir": str(self.engine.pool_dir.path) if self.engine.pool_dir else None,
                "kernel": self.engine.kernel,
                "leases": type(self.engine.leases).__name__ if self.engine.leases else None,
                "epoch_base": self.engine.epoch_base,
                "pid": os.getpid(),
            },
        )

    def _reap(self) -> None:
        while not self._stopped.wait(self.reap_interval_s):
            for pool_id in self.engine.drop_expired_pools():
                logger.info("pool lease expired; unregistered", extra={"pool_id": pool_id})
            self.servicer.log_suppressed()

    def stop(self, drain_s: float = 10.0) -> None:
        """Drain: NOT_SERVING, finish in-flight passes (at most ``drain_s``), stop."""
        self.health.enter_graceful_shutdown()
        start = time.perf_counter()
        self.server.stop(grace=drain_s).wait()
        self._stopped.set()
        self.servicer.log_suppressed(final=True)
        if self.socket_path is not None:
            self.socket_path.unlink(missing_ok=True)
        logger.info("compactor stopped", extra={"drain_s": time.perf_counter() - start})

    def wait(self) -> None:
        self.server.wait_for_termination()
