"""A test that ends early leaves no process behind: the compactor (with a supervised
child) and the redis-server it started are killed, with their process groups, by the
autouse finaliser (``tests/process_registry.py``). Run as a child pytest session over a
test that fails right after starting them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAILING_TEST = textwrap.dedent(
    """
    import os
    from pathlib import Path

    from tests.compactor_process import CompactorProcess
    from tests.redis_server import RedisServer


    def test_starts_processes_then_fails_at_an_import(tmp_path):
        redis = RedisServer(tmp_path).start()
        compactor = CompactorProcess(
            tmp_path / "compactor", "--supervise", pool_dir=str(tmp_path / "pool")
        ).start()
        Path(os.environ["PIDS_FILE"]).write_text(f"{redis.process.pid} {compactor.process.pid}")
        import a_module_that_does_not_exist  # noqa: F401
    """
)


def group_alive(pgid: int) -> bool:
    """Whether a live process (not a zombie waiting for its reaper) is in group
    ``pgid``, waiting up to 5 s for the group to go."""
    deadline = time.monotonic() + 5
    while True:
        alive = False
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            state, pgrp = fields[0], int(fields[2])
            alive = alive or (pgrp == pgid and state != "Z")
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def test_processes_of_a_failed_test_are_killed_with_their_groups(tmp_path):
    test_file = tmp_path / "test_leaves_processes.py"
    test_file.write_text(FAILING_TEST)
    pids_file = tmp_path / "pids"
    (tmp_path / "pool").mkdir(mode=0o700)
    result = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider",
            "-p", "tests.conftest", "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"),
            str(test_file),
        ],
        cwd=ROOT,
        env={**os.environ, "PIDS_FILE": str(pids_file)},
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    output = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 1, output
    assert "ModuleNotFoundError" in result.stdout, output
    redis_pid, compactor_pid = map(int, pids_file.read_text().split())
    assert "killed processes this test left running" in result.stdout, output
    assert not group_alive(redis_pid), output
    assert not group_alive(compactor_pid), output  # the supervisor and its forked server
