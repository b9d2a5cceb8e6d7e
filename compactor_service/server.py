"""The compactor process: flags, start-up checks, serving, supervision.

    python -m compactor_service [--socket PATH] [--pool-dir DIR]
    sglang-evict compactor --socket ... [--tcp HOST:PORT --tls-cert C --tls-key K
                                         [--tls-client-ca CA]] [--redis-url-file F]

* Listens on a Unix socket by default (mode 0600) in a private directory: the socket's
  directory is created 0700 if missing and refused if others can write it or it is not
  ours (``runtime_dir``). Default socket and pool directory: see ``runtime_dir``.
* TCP only with ``--tcp``: plaintext on loopback only; any other address needs
  ``--tls-cert``/``--tls-key``, and ``--tls-client-ca`` makes it mutual TLS (``tls``).
* The Redis URL of the lease store comes from ``--redis-url-file`` or
  ``$SGLANG_EVICT_REDIS_URL`` (``--redis-url`` still works, with a warning: a command
  line is readable by every user in /proc); it is shown redacted everywhere.
* Serves ``grpc.health.v1.Health``: SERVING once listening, NOT_SERVING while draining.
* SIGTERM/SIGINT: health goes NOT_SERVING, in-flight passes finish (up to
  ``--drain-s``), then the process exits 0 and removes its socket.
* Logs are JSON lines (``--log-format text`` for humans), bounded and redacted.
* Every bad flag: one line naming the flag and the fix on stderr, exit status 2.
* A server that cannot start listening (``--socket`` names a file that is not a socket,
  the ``--tcp`` address is in use): one line naming the cause, exit status 3
  (``EXIT_CANNOT_START``); ``--supervise`` retries it with backoff, then gives up with
  the same status (``_supervise``).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from compactor_service import limits as limit_defaults
from compactor_service import tracing
from compactor_service.health import OneLineParser
from compactor_service.limits import ServerLimits
from compactor_service.logs import LOG_FORMATS, LOG_LEVELS, configure_logging
from compactor_service.runtime_dir import DEFAULT_POOL_DIR, DEFAULT_SOCKET, ensure_private_dir
from compactor_service.secrets import REDIS_URL_ENV, redact_text, redact_url, resolve_redis_url
from compactor_service.tls import ServerTls, load_server_tls, parse_tcp_address

logger = logging.getLogger("sglang_evict.compactor")
KERNEL_CHOICES = ("auto", "triton", "torch-reference")
# What --fault-injection does at the struck point of a pass (tests): SIGKILL or SIGSTOP.
FAULT_ACTIONS = ("kill", "stop")

# Exit status of a server that could not start listening (its socket path is taken by a
# file that is not a socket, its TCP address is in use, ...), and of a supervisor that
# gave up restarting one: distinct from 1 (a crash) and 2 (a refused flag), so a
# service manager can tell "will not start here" from "died".
EXIT_CANNOT_START = 3

# How often the serving process's main thread wakes to run a signal handler whose
# signal the kernel delivered to another thread (see ``_serve``): the longest a SIGTERM
# waits before the drain starts.
SIGNAL_POLL_S = 0.2

# How ``--supervise`` paces restarts (see ``_supervise``): the delay before a restart
# starts at RESTART_DELAY_S and doubles with each quick death, up to RESTART_DELAY_MAX_S;
# a server that served for HEALTHY_AFTER_S is restarted at once and the delay starts over;
# after MAX_FAILED_STARTS servers in a row that died before listening, the supervisor
# gives up (about 7 s of retries: long enough for a port held by a previous process that
# is shutting down, short enough that a misconfiguration surfaces quickly).
RESTART_DELAY_S = 0.1
RESTART_DELAY_MAX_S = 2.0
HEALTHY_AFTER_S = 30.0
MAX_FAILED_STARTS = 8


def build_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The compactor's flags. Values are taken as text and checked by ``ServerOptions``
    (one line per error, naming the flag)."""
    parser = parser or OneLineParser(
        prog="python -m compactor_service", description="the sglang-evict compactor sidecar"
    )
    add = parser.add_argument
    add("--socket", default=DEFAULT_SOCKET, help=f"Unix socket (default {DEFAULT_SOCKET})")
    add("--no-socket", action="store_true", help="TCP only (needs --tcp)")
    add("--tcp", default=None, metavar="HOST:PORT", help="also listen on TCP (off by default)")
    add("--tls-cert", default=None, help="PEM certificate of the TCP listener")
    add("--tls-key", default=None, help="PEM private key of the TCP listener")
    add("--tls-client-ca", default=None, help="require client certificates from this CA (mTLS)")
    add(
        "--pool-dir",
        default=DEFAULT_POOL_DIR,
        help=f"the only directory CPU pool files are mapped from (default {DEFAULT_POOL_DIR})",
    )
    add("--kernel", default="auto", help=f"repack kernel: {', '.join(KERNEL_CHOICES)}")
    add(
        "--redis-url-file",
        default=None,
        help=f"file holding the Redis URL of the lease store (else ${REDIS_URL_ENV})",
    )
    add("--redis-url", default=None, help="the Redis URL itself (visible in /proc; prefer a file)")
    add("--lease-namespace", default="default")
    add("--drain-s", default="10", help="seconds in-flight passes get on SIGTERM")
    add("--reap-interval-s", default="5", help="seconds between expired-pool sweeps")
    add(
        "--pool-lease-s",
        default=str(limit_defaults.DEFAULT_POOL_LEASE_S),
        help="a pool without any call for this long is unregistered",
    )
    add("--max-pools", default=str(limit_defaults.DEFAULT_MAX_POOLS))
    add("--max-pools-per-client", default=str(limit_defaults.DEFAULT_MAX_POOLS_PER_CLIENT))
    add("--max-plans-per-call", default=str(limit_defaults.DEFAULT_MAX_PLANS_PER_CALL))
    add("--max-moves-per-call", default=str(limit_defaults.DEFAULT_MAX_MOVES_PER_CALL))
    add("--max-message-mb", default=str(limit_defaults.DEFAULT_MAX_MESSAGE_BYTES >> 20))
    add("--max-inflight-per-pool", default=str(limit_defaults.DEFAULT_MAX_INFLIGHT_PER_POOL))
    add("--workers", default="8", help="server threads")
    add(
        "--supervise",
        action="store_true",
        help="restart the server process when it dies (a forked child; backoff from 0.1 s "
        "to 2 s; gives up with exit status 3 on a server that cannot start listening)",
    )
    add(
        "--fault-injection",
        default=None,
        metavar="SEED:PROBABILITY[:kill|stop]",
        help="testing only: SIGKILL (or SIGSTOP) the server at a random point of a pass "
        "with this probability per pass",
    )
    add("--log-format", default="json", help="json or text")
    add("--log-level", default="info", help=", ".join(LOG_LEVELS))
    return parser


def _number(text: str, flag: str, kind: type, minimum: float, maximum: float = float("inf")):
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise ValueError(f"{flag} takes a number, got {text!r:.40}") from None
    if not minimum <= value <= maximum:
        allowed = f"[{minimum}, {maximum}]" if maximum < float("inf") else f">= {minimum}"
        raise ValueError(f"{flag} must be {allowed}, got {text!r:.40}")
    return value


def _choice(text: str, flag: str, known) -> str:
    if text not in known:
        raise ValueError(f"{flag} {text!r:.40} is not one of {', '.join(known)}")
    return text


@dataclass(frozen=True)
class ServerOptions:
    """The compactor's flags, checked: every error names its flag and the fix."""

    socket_path: str | None
    tcp_address: str | None
    tcp_tls: ServerTls | None
    pool_dir: Path
    kernel: str
    redis_url: str | None
    lease_namespace: str
    drain_s: float
    reap_interval_s: float
    workers: int
    limits: ServerLimits
    fault: tuple[int, float, str] | None
    log_format: str
    log_level: str
    redis_url_on_command_line: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerOptions:
        log_format = _choice(args.log_format, "--log-format", tuple(LOG_FORMATS))
        log_level = _choice(args.log_level.lower(), "--log-level", LOG_LEVELS)
        if args.no_socket and not args.tcp:
            raise ValueError("--no-socket needs --tcp HOST:PORT")
        tcp = parse_tcp_address(args.tcp) if args.tcp else None
        if tcp is None and (args.tls_cert or args.tls_key or args.tls_client_ca):
            raise ValueError("--tls-cert/--tls-key/--tls-client-ca apply to --tcp; add --tcp")
        tls = load_server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
        if tcp is not None and not tcp.is_loopback and tls is None:
            raise ValueError(
                f"--tcp {tcp.target} listens beyond loopback without TLS: give --tls-cert and "
                f"--tls-key (and --tls-client-ca to require client certificates), or listen "
                f"on 127.0.0.1"
            )
        fault = None
        if args.fault_injection:
            seed, _, rest = args.fault_injection.partition(":")
            probability, _, action = rest.partition(":")
            try:
                fault = (int(seed), float(probability), action or "kill")
            except ValueError:
                fault = None
            if fault is None or fault[2] not in FAULT_ACTIONS:
                raise ValueError(
                    "--fault-injection takes SEED:PROBABILITY[:kill|stop], e.g. 7:0.5"
                ) from None
        limits = ServerLimits(
            # gRPC takes the size as a C int: at most 2 GiB - 1.
            max_message_bytes=_number(args.max_message_mb, "--max-message-mb", int, 1, 2047) << 20,
            max_plans_per_call=_number(args.max_plans_per_call, "--max-plans-per-call", int, 1),
            max_moves_per_call=_number(args.max_moves_per_call, "--max-moves-per-call", int, 1),
            max_inflight_per_pool=_number(
                args.max_inflight_per_pool, "--max-inflight-per-pool", int, 1
            ),
            max_pools_per_client=_number(
                args.max_pools_per_client, "--max-pools-per-client", int, 1
            ),
            max_pools=_number(args.max_pools, "--max-pools", int, 1),
            pool_lease_s=_number(args.pool_lease_s, "--pool-lease-s", float, 0.1),
        )
        socket_path = None
        if not args.no_socket:
            socket = Path(args.socket)
            socket_path = str(ensure_private_dir(socket.parent, "--socket") / socket.name)
        return cls(
            socket_path=socket_path,
            tcp_address=tcp.target if tcp else None,
            tcp_tls=tls,
            pool_dir=ensure_private_dir(args.pool_dir, "--pool-dir"),
            kernel=_choice(args.kernel, "--kernel", KERNEL_CHOICES),
            redis_url=resolve_redis_url(args.redis_url, args.redis_url_file),
            lease_namespace=args.lease_namespace,
            drain_s=_number(args.drain_s, "--drain-s", float, 0),
            reap_interval_s=_number(args.reap_interval_s, "--reap-interval-s", float, 0.01),
            workers=_number(args.workers, "--workers", int, 1),
            limits=limits,
            fault=fault,
            log_format=log_format,
            log_level=log_level,
            redis_url_on_command_line=bool(args.redis_url),
        )


def _refuse(error: BaseException) -> int:
    print(f"compactor: error: {redact_text(str(error))}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Start the server from parsed arguments and block until SIGTERM/SIGINT."""
    try:
        options = ServerOptions.from_args(args)
    except ValueError as error:
        return _refuse(error)
    configure_logging(options.log_format, options.log_level)
    if options.redis_url_on_command_line:
        logger.warning(
            "--redis-url puts the URL (and any password) on the command line, readable by "
            f"every user in /proc; use --redis-url-file or ${REDIS_URL_ENV}"
        )
    if args.supervise:
        return _supervise(options)
    return _serve(options)


def _serve(
    options: ServerOptions, generation: int = 0, report: Callable[[str], None] | None = None
) -> int:
    """Serve until SIGTERM/SIGINT. ``report`` (a supervised child's line to its
    supervisor) receives ``serving`` once listening, or the one-line error of a start
    that failed, which is then not printed: the supervisor logs it with the restart."""
    from compactor_service.engine import CompactorEngine
    from compactor_service.servicer import CompactorServer
    from compactor_service.shared_pool import PoolDirectory

    provider_configured = tracing.configure_from_env()
    leases = None
    if options.redis_url:
        from compactor_service.redis_leases import RedisLeaseStore

        leases = RedisLeaseStore(options.redis_url, namespace=options.lease_namespace)
    fault_hook = None
    if options.fault is not None:
        from compactor_service.engine import random_kill_hook, random_stop_hook

        seed, probability, action = options.fault
        make_hook = random_stop_hook if action == "stop" else random_kill_hook
        fault_hook = make_hook(seed + generation, probability)
    engine = CompactorEngine(
        kernel=options.kernel,
        leases=leases,
        fault_hook=fault_hook,
        pool_dir=PoolDirectory(options.pool_dir),
        limits=options.limits,
    )
    server = CompactorServer(
        engine,
        socket_path=options.socket_path,
        tcp_address=options.tcp_address,
        tcp_credentials=options.tcp_tls.credentials() if options.tcp_tls else None,
        max_workers=options.workers,
        reap_interval_s=options.reap_interval_s,
    )
    stop_requested = threading.Event()
    signals_received: list[int] = []

    def request_stop(signum, _frame):
        # No logging here: the handler can interrupt the main thread inside a log call
        # (the record would be interleaved with, or lost in, the one being written).
        signals_received.append(signum)
        stop_requested.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        if options.tcp_address is not None:
            _refuse_tcp_address_in_use(options.tcp_address)
        server.start()
    except (OSError, RuntimeError) as error:
        message = f"compactor: error: {redact_text(str(error))}"
        if report is None:
            print(message, file=sys.stderr)
        else:
            report(f"error {message}")
        return EXIT_CANNOT_START
    if report is not None:
        report("serving")
    if options.redis_url:
        logger.info("lease store", extra={"redis": redact_url(options.redis_url)})
    # A timed wait, not a plain one: the kernel may deliver SIGTERM to one of gRPC's
    # threads, and Python runs the handler only when the main thread next executes
    # bytecode; an untimed wait would then sleep through it (seen: a compactor that
    # ignored SIGTERM for 30 s until killed, never draining).
    while not stop_requested.wait(SIGNAL_POLL_S):
        pass
    logger.info("shutdown requested", extra={"signal": signal.Signals(signals_received[0]).name})
    server.stop(drain_s=options.drain_s)
    if provider_configured:
        from opentelemetry import trace

        trace.get_tracer_provider().shutdown()
    return 0


def _refuse_tcp_address_in_use(target: str) -> None:
    """``OSError`` naming ``--tcp`` when another socket listens on the address. gRPC
    would refuse it too, but with a multi-line report of its own on stderr and a message
    that does not say why; and gRPC binds with SO_REUSEPORT, so it would share the port
    with another process that did too (a second compactor) rather than refuse. The probe
    binds like gRPC otherwise (SO_REUSEADDR: connections of a previous run in TIME_WAIT
    do not count); an address that does not resolve is left to gRPC to report."""
    host, _, port = target.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    try:
        addresses = socket.getaddrinfo(
            host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (OSError, ValueError):
        return
    in_use = False
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as error:
                in_use = in_use or error.errno == errno.EADDRINUSE
                continue
        return  # gRPC listens where one of its addresses binds
    if in_use:
        raise OSError(
            f"--tcp {target}: the address is in use (another process listens on port "
            f"{port}); stop that process or choose another --tcp port"
        )


def _sleep_unless(stopping: threading.Event, seconds: float) -> None:
    """Sleep ``seconds``, returning early once ``stopping`` is set. Polled in short naps
    rather than ``stopping.wait``: the signal handler that sets it runs on this same
    thread, and could interrupt ``wait`` while it holds the event's lock."""
    deadline = time.monotonic() + seconds
    while not stopping.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.05))


def _wait_for_child(pid: int, fd: int) -> tuple[int, float | None, str | None]:
    """Wait for a supervised child to exit, reading its reports on ``fd`` meanwhile:
    its wait status, when it said it was serving (``time.monotonic()``, None if it never
    did) and the last error it sent. The pipe's end of file usually says the child
    exited; waitpid is polled too, in case a process the child started holds the pipe."""
    served_at, error, pending = None, None, b""

    def take(chunk: bytes) -> None:
        nonlocal served_at, error, pending
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            text = line.decode("utf-8", "replace")
            if text == "serving":
                served_at = time.monotonic()
            elif text.startswith("error "):
                error = text.removeprefix("error ")

    while True:
        chunk = os.read(fd, 4096) if select.select([fd], [], [], 0.5)[0] else None
        if chunk:
            take(chunk)
        elif chunk == b"":
            return os.waitpid(pid, 0)[1], served_at, error
        else:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                while select.select([fd], [], [], 0)[0] and (chunk := os.read(fd, 4096)):
                    take(chunk)
                return status, served_at, error


def _reporter(fd: int) -> Callable[[str], None]:
    """A supervised child's ``report``: one line to its supervisor per call."""

    def report(line: str) -> None:
        os.write(fd, line.replace("\n", " ").encode() + b"\n")

    return report


def _describe_exit(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def _supervise(options: ServerOptions) -> int:
    """Run the server in a forked child and restart it when it dies (a restarted
    compactor has a new epoch; clients re-register). The parent has imported
    everything, so a restart takes milliseconds; it never touches CUDA or gRPC objects,
    so forking is safe. SIGTERM/SIGINT are forwarded and end the loop, also during a
    pause between restarts (exit 0).

    Each child reports through a pipe when it is serving, or the one-line error that
    kept it from listening. Restarts are paced (constants above):

    * a child that died before serving is a failed start: the next one starts after a
      delay of RESTART_DELAY_S, doubling per quick death up to RESTART_DELAY_MAX_S; after
      MAX_FAILED_STARTS in a row the supervisor exits EXIT_CANNOT_START with one line on
      stderr: the child's own error (e.g. the socket path is not a socket, the TCP address
      is in use) and what to do. Such causes do not go away by restarting;
    * a child that served and died is restarted after the same growing delay, at once if
      it had served for HEALTHY_AFTER_S (the delay starts over), and is never given up
      on: it could listen, and clients complete passes in-process meanwhile. Under
      ``--fault-injection`` (testing) such deaths are the point, and restart at once.

    Every restart is logged (exit status, restarts so far, delay, the child's error)."""
    # Import what a server process needs now, once: every forked child inherits it.
    import opentelemetry.instrumentation.grpc  # noqa: F401

    import compactor_service.engine
    import compactor_service.servicer
    import compactor_service.shared_pool  # noqa: F401

    stopping = threading.Event()
    child = [0]
    forwarded = {signal.SIGTERM, signal.SIGINT}

    def forward(signum, _frame):
        stopping.set()
        if child[0]:
            os.kill(child[0], signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    generation = failed_starts = quick_deaths = 0
    while not stopping.is_set():
        report_read, report_write = os.pipe()
        # Blocked across the fork: a signal arriving in between is delivered once the
        # child's pid is known (parent) or the default action is back (child).
        signal.pthread_sigmask(signal.SIG_BLOCK, forwarded)
        try:
            pid = os.fork()
        except OSError:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)
            os.close(report_read)
            os.close(report_write)
            raise
        if pid == 0:
            os.close(report_read)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)
            report = _reporter(report_write)
            code = 1
            try:
                code = _serve(options, generation, report)
            except BaseException as error:
                logger.exception("compactor process failed")
                text = redact_text(str(error))
                report(f"error compactor: error: {type(error).__name__}: {text}")
            finally:
                os._exit(code)
        child[0] = pid
        signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)
        os.close(report_write)
        try:
            status, served_at, error = _wait_for_child(pid, report_read)
        finally:
            os.close(report_read)
        child[0] = 0
        exit_code = os.waitstatus_to_exitcode(status)
        if stopping.is_set():
            return exit_code if os.WIFEXITED(status) else 0
        if exit_code == 2:  # a start-up refusal: restarting would refuse again
            return 2
        generation += 1
        served_s = None if served_at is None else time.monotonic() - served_at
        failed_starts = failed_starts + 1 if served_at is None else 0
        if failed_starts >= MAX_FAILED_STARTS:
            cause = error or (
                f"compactor: error: the server {_describe_exit(status)} before listening; "
                f"see the log lines above"
            )
            print(
                f"{cause.rstrip('.')} (the server failed to start {failed_starts} times in a "
                f"row: the supervisor gives up, exit status {EXIT_CANNOT_START})",
                file=sys.stderr,
            )
            return EXIT_CANNOT_START
        if served_s is not None and served_s >= HEALTHY_AFTER_S:
            quick_deaths = 0
            delay = 0.0
        elif served_s is not None and options.fault is not None:
            delay = 0.0
        else:
            delay = min(RESTART_DELAY_S * 2**quick_deaths, RESTART_DELAY_MAX_S)
            quick_deaths += 1
        logger.error(
            "compactor process could not start; restarting"
            if served_at is None
            else "compactor process died; restarting",
            extra={
                "pid": pid,
                "exit": exit_code,
                "restarts": generation,
                "delay_s": delay,
                "served_s": None if served_s is None else round(served_s, 3),
                "error": error.removeprefix("compactor: error: ") if error else None,
            },
        )
        _sleep_unless(stopping, delay)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_arg_parser().parse_args(argv))
