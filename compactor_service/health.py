"""``sglang-evict compactor-health``: exit 0 when the compactor reports SERVING, else 1
with the reason (no such socket, connection refused, no answer, NOT_SERVING).

Kept free of torch and the kernels (it imports gRPC only), so an exec probe that runs
it every few seconds costs milliseconds, not a torch import. ``DEFAULT_SOCKET`` is the
one default socket path of the compactor and of the scheduler's
``--kv-compactor-socket`` (see ``runtime_dir``).
"""

from __future__ import annotations

import argparse
import os
import stat
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from compactor_service.runtime_dir import DEFAULT_SOCKET
from compactor_service.tls import channel_credentials, open_channel, parse_tcp_address

SERVICE_NAME = "sglang_evict.compactor.v1.Compactor"
__all__ = [
    "DEFAULT_SOCKET",
    "SERVICE_NAME",
    "OneLineParser",
    "check_health",
    "probe",
    "socket_target",
]


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage block), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def socket_target(socket_path: str) -> str:
    return f"unix:{os.path.abspath(socket_path)}"


def _socket_problem(socket_path: str) -> str | None:
    try:
        info = os.stat(socket_path)
    except FileNotFoundError:
        return f"no such socket {socket_path} (is a compactor running with --socket {socket_path}?)"
    except OSError as error:
        return f"cannot reach {socket_path} ({error.strerror})"
    if not stat.S_ISSOCK(info.st_mode):
        return f"{socket_path} is not a socket"
    return None


def probe(
    target: str,
    timeout_s: float = 2.0,
    service: str = SERVICE_NAME,
    credentials: grpc.ChannelCredentials | None = None,
) -> tuple[bool, str]:
    """(serving, why): whether the compactor at ``target`` (``unix:PATH`` or
    ``HOST:PORT``) reports SERVING for ``service``, and otherwise why not."""
    if target.startswith("unix:"):
        problem = _socket_problem(target[len("unix:") :])
        if problem:
            return False, problem
    with open_channel(target, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as error:
            details = error.details() or ""
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return False, f"no answer within {timeout_s:g} s"
            if "Connection refused" in details:
                return False, "connection refused (nothing listens there: a stale socket?)"
            return False, f"{error.code().name}: {details[:200]}"
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return True, "SERVING"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return False, f"{name} (draining, or not started)"


def check_health(
    target: str,
    timeout_s: float = 2.0,
    service: str = SERVICE_NAME,
    credentials: grpc.ChannelCredentials | None = None,
) -> bool:
    """True when the compactor at ``target`` reports SERVING for ``service``."""
    return probe(target, timeout_s, service, credentials)[0]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--socket", default=DEFAULT_SOCKET, help="the compactor's Unix socket")
    parser.add_argument("--tcp", default=None, help="HOST:PORT instead of the socket")
    parser.add_argument("--tls-ca", default=None, help="--tcp over TLS: CA of the server")
    parser.add_argument("--tls-cert", default=None, help="client certificate (mutual TLS)")
    parser.add_argument("--tls-key", default=None, help="client key (mutual TLS)")
    parser.add_argument("--timeout-s", default="2", help="seconds to wait for the answer")
    return parser


def _target_and_credentials(args: argparse.Namespace):
    try:
        timeout_s = float(args.timeout_s)
    except ValueError:
        raise ValueError(f"--timeout-s takes seconds, e.g. 2, got {args.timeout_s!r:.40}") from None
    if not timeout_s > 0:
        raise ValueError(f"--timeout-s must be > 0, got {args.timeout_s!r:.40}")
    if args.tcp is None:
        if args.tls_ca or args.tls_cert or args.tls_key:
            raise ValueError("--tls-ca/--tls-cert/--tls-key apply to --tcp; add --tcp HOST:PORT")
        return socket_target(args.socket), None, timeout_s
    address = parse_tcp_address(args.tcp)
    credentials = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    return address.target, credentials, timeout_s


def run(args: argparse.Namespace) -> int:
    try:
        target, credentials, timeout_s = _target_and_credentials(args)
    except ValueError as error:
        print(f"compactor-health: error: {error}", file=sys.stderr)
        return 2
    serving, why = probe(target, timeout_s=timeout_s, credentials=credentials)
    print(f"compactor at {target}: {'SERVING' if serving else f'NOT SERVING: {why}'}")
    return 0 if serving else 1


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="sglang-evict compactor-health", description=__doc__)
    return run(add_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
