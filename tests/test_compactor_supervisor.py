"""``--supervise`` as a real process: a server that cannot start listening is retried
with backoff and then given up on (exit 3, one line naming the cause); a server that
served and died is restarted promptly; SIGTERM ends the supervisor during a pause."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compactor_service.server import EXIT_CANNOT_START, MAX_FAILED_STARTS
from tests import process_registry
from tests.compactor_process import ROOT, CompactorProcess

ENV = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'kernels'}"}


def start_compactor(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, Path]:
    """``python -m compactor_service --supervise`` with its stderr in a file."""
    log = tmp_path / "stderr.log"
    command = [
        *(sys.executable, "-m", "compactor_service", "--supervise"),
        *("--pool-dir", str(tmp_path / "pool"), *flags),
    ]
    with open(log, "wb") as stderr:
        process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=ENV,
            cwd=ROOT,
            start_new_session=True,
        )
    return process_registry.register(process), log


def split_log(text: str) -> tuple[list[dict], list[str]]:
    """The JSON log entries and the other lines of a compactor's stderr."""
    entries, others = [], []
    for line in text.splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            others.append(line)
    return entries, others


@pytest.fixture
def held_port():
    """A loopback TCP port another socket listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_socket_path_that_is_a_regular_file_is_given_up_on_with_one_line(tmp_path):
    (tmp_path / "sock").mkdir(mode=0o700)
    path = tmp_path / "sock" / "compactor.sock"
    path.write_text("not a socket")
    started = time.monotonic()
    process, log = start_compactor(tmp_path, "--socket", str(path))
    assert process.wait(timeout=30) == EXIT_CANNOT_START
    elapsed = time.monotonic() - started
    entries, others = split_log(log.read_text())
    restarts = [e for e in entries if "restarting" in e["msg"]]
    # Before: a restart every few milliseconds, forever (289 in 15 s).
    assert len(restarts) == MAX_FAILED_STARTS - 1 <= 10, restarts
    assert [e["delay_s"] for e in restarts[:4]] == [0.1, 0.2, 0.4, 0.8]
    assert all(e["exit"] == EXIT_CANNOT_START for e in restarts)
    assert all("is not a socket" in e["error"] for e in restarts)
    assert len(others) == 1 and "Traceback" not in log.read_text(), others
    assert f"{path} exists and is not a socket" in others[0]
    assert "--socket" in others[0] and "gives up" in others[0]
    assert elapsed < 30
    assert path.read_text() == "not a socket"  # never removed nor replaced


def test_a_tcp_port_another_process_holds_is_given_up_on_with_one_line(tmp_path, held_port):
    address = f"127.0.0.1:{held_port}"
    process, log = start_compactor(tmp_path, "--no-socket", "--tcp", address)
    assert process.wait(timeout=30) == EXIT_CANNOT_START
    entries, others = split_log(log.read_text())
    restarts = [e for e in entries if "restarting" in e["msg"]]
    assert len(restarts) <= 10, restarts
    assert all(e["exit"] == EXIT_CANNOT_START for e in restarts)
    # One line: gRPC's own multi-line bind report never comes (the address is probed).
    assert len(others) == 1 and "Traceback" not in log.read_text(), others
    assert f"--tcp {address}: the address is in use" in others[0]
    assert "choose another --tcp port" in others[0]


def test_an_unsupervised_server_that_cannot_listen_exits_3_with_one_line(tmp_path, held_port):
    result = subprocess.run(
        [
            *(sys.executable, "-m", "compactor_service", "--no-socket"),
            *("--tcp", f"127.0.0.1:{held_port}", "--pool-dir", str(tmp_path / "pool")),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=ENV,
    )
    assert result.returncode == EXIT_CANNOT_START
    assert result.stderr.strip().splitlines() == [
        f"compactor: error: --tcp 127.0.0.1:{held_port}: the address is in use (another "
        f"process listens on port {held_port}); stop that process or choose another --tcp port"
    ]


def test_sigterm_during_the_pause_between_restarts_ends_the_supervisor_at_once(tmp_path):
    (tmp_path / "sock").mkdir(mode=0o700)
    path = tmp_path / "sock" / "compactor.sock"
    path.write_text("not a socket")
    process, log = start_compactor(tmp_path, "--socket", str(path))
    deadline = time.monotonic() + 30
    while not any(e.get("delay_s") == 1.6 for e in split_log(log.read_text())[0]):
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)  # in the 1.6 s pause before the next start
    assert process.wait(timeout=60) == 0
    entries = split_log(log.read_text())[0]
    # No further start after the signal: the 1.6 s pause's entry is the last restart.
    assert [e.get("delay_s") for e in entries if "delay_s" in e][-1] == 1.6


def test_the_pause_between_restarts_returns_as_soon_as_the_supervisor_is_stopping():
    """The pause itself, without a clock in the assertion: an hour's pause, stopped from
    another thread, returns long before a minute's join gives up (the subprocess test
    above shows SIGTERM reaches it; a timing there failed on a loaded machine)."""
    import threading

    from compactor_service.server import _sleep_unless

    stopping = threading.Event()
    pause = threading.Thread(target=_sleep_unless, args=(stopping, 3600.0))
    pause.start()
    stopping.set()
    pause.join(timeout=60)
    assert not pause.is_alive()


def test_a_supervised_server_that_is_sigkilled_is_restarted_promptly(tmp_path):
    compactor = CompactorProcess(tmp_path, "--supervise", pool_dir=str(tmp_path / "pool"))
    compactor.start()

    def serving_pids() -> list[int]:
        return [e["pid"] for e in compactor.log_entries() if e["msg"] == "compactor serving"]

    (first,) = serving_pids()
    os.kill(first, signal.SIGKILL)
    killed = time.monotonic()
    while len(serving_pids()) < 2:
        assert time.monotonic() - killed < 10, compactor.log.read_text()
        time.sleep(0.02)
    compactor.wait_healthy(timeout_s=10)
    assert time.monotonic() - killed < 5
    assert serving_pids()[1] != first
    (restart,) = [e for e in compactor.log_entries() if "restarting" in e["msg"]]
    assert restart["msg"] == "compactor process died; restarting"
    assert restart["exit"] == -signal.SIGKILL and restart["delay_s"] <= 0.1
    assert restart["served_s"] is not None
    assert compactor.stop() == 0
