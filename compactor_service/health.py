"""``sglang-evict compactor-health``: exit 0 when the compactor reports SERVING.

Kept free of torch and the kernels (it imports gRPC only), so an exec probe that runs
it every few seconds costs milliseconds, not a torch import.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE_NAME = "sglang_evict.compactor.v1.Compactor"
DEFAULT_SOCKET = "/tmp/sglang-evict/compactor.sock"


def socket_target(socket_path: str) -> str:
    return f"unix:{os.path.abspath(socket_path)}"


def check_health(target: str, timeout_s: float = 2.0, service: str = SERVICE_NAME) -> bool:
    """True when the compactor at ``target`` (``unix:PATH`` or ``HOST:PORT``) reports
    SERVING for ``service``."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--socket", default=DEFAULT_SOCKET, help="the compactor's Unix socket")
    parser.add_argument("--tcp", default=None, help="HOST:PORT instead of the socket")
    parser.add_argument("--timeout-s", type=float, default=2.0)
    return parser


def run(args: argparse.Namespace) -> int:
    target = args.tcp or socket_target(args.socket)
    serving = check_health(target, timeout_s=args.timeout_s)
    print(f"compactor at {target}: {'SERVING' if serving else 'NOT SERVING'}")
    return 0 if serving else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-evict compactor-health", description=__doc__)
    return run(add_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
