"""Bad flags of ``compactor`` and ``compactor-health``: one line naming the flag and the
fix, exit status 2, no traceback; ``compactor-health`` says why a compactor is not
serving."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from compactor_service.health import SERVICE_NAME, probe, socket_target
from tests.compactor_process import ROOT

ENV = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'kernels'}"}


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT, env=ENV
    )


def assert_one_line_refusal(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


COMPACTOR_VALUE_ERRORS = [
    (("--tcp", "not-an-address"), ("--tcp takes HOST:PORT", "127.0.0.1:50151")),
    (("--tcp", "127.0.0.1:99999"), ("--tcp: port 99999", "1-65535")),
    (("--tcp", ":50151"), ("--tcp takes HOST:PORT",)),
    (("--tcp", "[::1:50151"), ("--tcp takes HOST:PORT",)),
    (("--no-socket",), ("--no-socket needs --tcp",)),
    (("--tls-cert", "c.pem"), ("apply to --tcp",)),
    (("--drain-s", "soon"), ("--drain-s takes a number",)),
    (("--drain-s", "-1"), ("--drain-s must be >= 0",)),
    (("--reap-interval-s", "0"), ("--reap-interval-s must be >=",)),
    (("--pool-lease-s", "x"), ("--pool-lease-s takes a number",)),
    (("--max-pools", "0"), ("--max-pools must be >= 1",)),
    (("--max-plans-per-call", "1.5"), ("--max-plans-per-call takes a number",)),
    (("--max-message-mb", "-3"), ("--max-message-mb must be [1, 2047]",)),
    (("--max-message-mb", "4096"), ("--max-message-mb must be [1, 2047]",)),
    (("--workers", "many"), ("--workers takes a number",)),
    (("--kernel", "cuda"), ("--kernel 'cuda' is not one of", "torch-reference")),
    (("--log-format", "xml"), ("--log-format 'xml' is not one of", "json")),
    (("--log-level", "loud"), ("--log-level 'loud' is not one of", "debug")),
    (("--fault-injection", "often"), ("--fault-injection takes SEED:PROBABILITY",)),
    (("--redis-url", "http://redis:6379"), ("--redis-url", "is not a Redis URL")),
    (("--redis-url-file", "/nonexistent/url"), ("--redis-url-file", "cannot read it")),
    (
        ("--redis-url", "redis://r:1/0", "--redis-url-file", "/f"),
        ("give --redis-url or --redis-url-file",),
    ),
]


SGLANG_EVICT = ("-c", "import sys; from sglang_evict.cli.main import main; sys.exit(main())")


@pytest.mark.parametrize(("flags", "fragments"), COMPACTOR_VALUE_ERRORS)
def test_a_bad_compactor_flag_is_one_line_exit_2(flags, fragments, tmp_path):
    private = ("--socket", str(tmp_path / "s" / "c.sock"), "--pool-dir", str(tmp_path / "p"))
    result = run("-m", "compactor_service", *private, *flags)
    assert_one_line_refusal(result, *fragments)


@pytest.mark.parametrize(("flags", "fragments"), COMPACTOR_VALUE_ERRORS[:1])
def test_sglang_evict_compactor_refuses_the_same_way(flags, fragments, tmp_path):
    """The same checks behind ``sglang-evict compactor`` (one case: the wiring)."""
    private = ("--socket", str(tmp_path / "s" / "c.sock"), "--pool-dir", str(tmp_path / "p"))
    result = run(*SGLANG_EVICT, "compactor", *private, *flags)
    assert_one_line_refusal(result, *fragments)


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [(("--bogus",), ("unrecognized arguments: --bogus",)), (("--tcp",), ("--tcp",))],
)
def test_a_malformed_command_line_of_the_compactor_is_one_line(flags, fragments):
    assert_one_line_refusal(run("-m", "compactor_service", *flags), *fragments)


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        (("--timeout-s", "abc"), ("--timeout-s takes seconds",)),
        (("--timeout-s", "0"), ("--timeout-s must be > 0",)),
        (("--tcp", "nowhere"), ("--tcp takes HOST:PORT",)),
        (("--tls-ca", "ca.pem"), ("apply to --tcp",)),
        (("--tcp", "127.0.0.1:1", "--tls-cert", "c.pem"), ("--tls-cert/--tls-key need --tls-ca",)),
        (("--bogus",), ("unrecognized arguments: --bogus",)),
    ],
)
def test_a_bad_health_flag_is_one_line_exit_2(flags, fragments):
    assert_one_line_refusal(run("-m", "compactor_service.health", *flags), *fragments)


def test_health_says_there_is_no_such_socket(tmp_path):
    missing = tmp_path / "absent.sock"
    result = run("-m", "compactor_service.health", "--socket", str(missing))
    assert result.returncode == 1
    assert f"NOT SERVING: no such socket {missing}" in result.stdout


def test_health_says_the_connection_was_refused_on_a_stale_socket(tmp_path):
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(stale))  # bound, never listening: what a dead process leaves
        serving, why = probe(socket_target(str(stale)), timeout_s=5)
    assert not serving and why.startswith("connection refused")


def test_health_says_not_serving_while_the_compactor_drains(tmp_path):
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    path = tmp_path / "draining.sock"
    server.add_insecure_port(f"unix:{path}")
    server.start()
    try:
        servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        result = run("-m", "compactor_service.health", "--socket", str(path))
    finally:
        server.stop(0)
    assert result.returncode == 1 and "NOT SERVING: NOT_SERVING (draining" in result.stdout
