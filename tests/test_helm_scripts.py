"""The supervisor and liveness scripts the Helm chart ships, run for real with bash, with
stand-in processes for the compactor and the server (no Helm needed)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helm_render import (
    CHART,
    SOCKET,
)

# --- the scripts, run for real ---------------------------------------------------------

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

FAKE_COMPACTOR = """
import os, socket, sys, time
path, pid_file, lifetime_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
with open(pid_file, "w") as f:
    f.write(str(os.getpid()))
if lifetime_s < 0:  # die before opening the socket
    sys.exit(3)
server = socket.socket(socket.AF_UNIX)
server.bind(path)
server.listen()
time.sleep(lifetime_s)
"""


def _run_supervisor(tmp_path, compactor_lifetime_s, server_cmd, *, wait_s=10, signal_after_s=None):
    sock = tmp_path / "compactor.sock"
    pid_file = tmp_path / "compactor.pid"
    env = {
        **os.environ,
        "SGLANG_EVICT_COMPACTOR_SOCKET": str(sock),
        "SGLANG_EVICT_SOCKET_WAIT_S": str(wait_s),
        "SGLANG_EVICT_STOP_TIMEOUT_S": "5",
    }
    command = [
        "bash",
        str(CHART / "files" / "supervisor.sh"),
        sys.executable,
        "-c",
        FAKE_COMPACTOR,
        str(sock),
        str(pid_file),
        str(compactor_lifetime_s),
        "--",
        *server_cmd,
    ]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    if signal_after_s is not None:
        deadline = time.monotonic() + 10
        while not (tmp_path / "server.started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(signal_after_s)
        process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    compactor_pid = int(pid_file.read_text()) if pid_file.exists() else None
    return process.returncode, stderr, compactor_pid


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _server(tmp_path, script: str) -> list[str]:
    return ["bash", "-c", f"touch {tmp_path}/server.started; {script}"]


@needs_bash
def test_supervisor_exits_nonzero_and_stops_the_compactor_when_the_server_exits(tmp_path):
    code, stderr, compactor_pid = _run_supervisor(
        tmp_path, 60, _server(tmp_path, "sleep 0.3; exit 0")
    )
    assert code != 0, stderr
    assert "server exited" in stderr
    assert (tmp_path / "server.started").exists()
    assert _gone(compactor_pid)


@needs_bash
def test_supervisor_exits_nonzero_and_stops_the_server_when_the_compactor_dies(tmp_path):
    code, stderr, _ = _run_supervisor(
        tmp_path, 0.5, _server(tmp_path, f"echo $$ > {tmp_path}/server.pid; exec sleep 60")
    )
    assert code != 0, stderr
    assert "compactor exited" in stderr
    assert _gone(int((tmp_path / "server.pid").read_text()))


@needs_bash
def test_supervisor_never_starts_the_server_when_the_compactor_dies_before_its_socket(tmp_path):
    code, stderr, _ = _run_supervisor(tmp_path, -1, _server(tmp_path, "sleep 60"))
    assert code != 0
    assert "before opening" in stderr
    assert not (tmp_path / "server.started").exists()


@needs_bash
def test_supervisor_gives_up_when_the_socket_never_appears(tmp_path):
    silent_compactor = ["bash", "-c", f"echo $$ > {tmp_path}/compactor.pid; exec sleep 60"]
    result = subprocess.run(
        [
            "bash",
            str(CHART / "files" / "supervisor.sh"),
            *silent_compactor,
            "--",
            *_server(tmp_path, "sleep 60"),
        ],
        env={
            **os.environ,
            "SGLANG_EVICT_COMPACTOR_SOCKET": str(tmp_path / "never.sock"),
            "SGLANG_EVICT_SOCKET_WAIT_S": "1",
        },
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0
    assert "did not open" in result.stderr
    assert not (tmp_path / "server.started").exists()
    assert _gone(int((tmp_path / "compactor.pid").read_text()))


@needs_bash
def test_supervisor_stops_both_and_exits_zero_on_sigterm(tmp_path):
    code, stderr, compactor_pid = _run_supervisor(
        tmp_path, 60, _server(tmp_path, "exec sleep 60"), signal_after_s=0.2
    )
    assert code == 0, stderr
    assert "termination requested" in stderr
    assert _gone(compactor_pid)


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # http.server calls it by this name
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    _Health.status = 200


def _run_liveness(tmp_path, port: int, compactor_healthy: bool):
    """liveness.sh with a stand-in `sglang-evict` whose compactor-health answers as told."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "sglang-evict"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'[ "$1 $2 $3" = "compactor-health --socket {SOCKET}" ] || exit 64\n'
        f"exit {0 if compactor_healthy else 1}\n"
    )
    fake.chmod(0o755)
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SGLANG_EVICT_HTTP_PORT": str(port),
        "SGLANG_EVICT_HEALTH_PATH": "/health",
        "SGLANG_EVICT_COMPACTOR_SOCKET": SOCKET,
    }
    return subprocess.run(
        ["bash", str(CHART / "files" / "liveness.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


@needs_bash
@pytest.mark.parametrize(
    ("http_status", "compactor_healthy", "blamed"),
    [(200, True, None), (503, True, "SGLang"), (200, False, "compactor")],
    ids=["both-healthy", "sglang-unhealthy", "compactor-unhealthy"],
)
def test_liveness_script_checks_both_processes(
    tmp_path, health_server, http_status, compactor_healthy, blamed
):
    _Health.status = http_status
    result = _run_liveness(tmp_path, health_server.server_address[1], compactor_healthy)
    if blamed is None:
        assert result.returncode == 0, result.stderr
    else:
        assert result.returncode != 0
        assert f"liveness: {blamed}" in result.stderr


@needs_bash
def test_liveness_script_fails_when_sglang_is_not_listening(tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = _run_liveness(tmp_path, port, compactor_healthy=True)
    assert result.returncode != 0 and "liveness: SGLang" in result.stderr
