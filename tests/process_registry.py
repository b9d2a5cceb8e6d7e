"""Every process the tests start (compactors with their supervised children,
redis-servers), so that none outlives the test that started it.

Each is started in a session of its own (``start_new_session``: its process group is
its pid, and a supervisor's forked children share it) and registered here when it
starts. ``conftest._no_process_left_behind`` (autouse) kills, with their groups, the
processes a test started and left running, whatever made it end early (a failed
assertion, an import error in its body, a start that timed out); processes of
module- and session-scoped fixtures, started before the test, are their fixtures' to
stop. At the latest they go when the test process exits."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess

_started: list[subprocess.Popen] = []
_session: list[subprocess.Popen] = []


def register(process: subprocess.Popen) -> subprocess.Popen:
    _started.append(process)
    return process


def outlive_tests(process: subprocess.Popen) -> subprocess.Popen:
    """Take ``process`` off the per-test list: a session fixture's process, which a test
    may start first (``request.getfixturevalue``) but must not kill at its end. It goes
    when the test process exits, if its fixture did not stop it first."""
    if process in _started:
        _started.remove(process)
    _session.append(process)
    return process


def mark() -> int:
    """A position: ``kill_since(mark)`` kills what was registered after it."""
    return len(_started)


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL ``process``'s whole group (it leads one: ``start_new_session``)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def kill_since(position: int) -> list[int]:
    """Kill the groups of the processes registered after ``position``; returns the pids
    that were still running."""
    left = [p.pid for p in _started[position:] if p.poll() is None]
    for process in _started[position:]:
        kill_group(process)
    del _started[position:]
    return left


def _kill_all() -> None:
    kill_since(0)
    for process in _session:
        kill_group(process)


atexit.register(_kill_all)
