"""``srt.process_start``: SGLang's own ``set_start_method("spawn")`` sets ``fork`` where
asked in a process running one thread, and is left alone in one running another."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

FORK_CHECK = """
import multiprocessing, sys, threading, time
from sglang_evict.srt.process_start import fork_sglangs_processes
if sys.argv[1] == "thread":
    threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
forked = fork_sglangs_processes()
multiprocessing.set_start_method("spawn", force=True)  # what SGLang calls as it starts
print(forked, multiprocessing.get_start_method())
"""


@pytest.mark.parametrize("threads, expected", [("none", "True fork"), ("thread", "False spawn")])
def test_sglangs_processes_fork_only_while_the_process_runs_no_thread(threads, expected):
    """``FORK_ENV``: SGLang's own ``set_start_method("spawn")`` sets ``fork`` in a host
    running one thread, and is left alone in one running another (a thread, like an
    OpenMP pool, does not survive a fork)."""
    done = subprocess.run(
        [sys.executable, "-c", FORK_CHECK, threads],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == expected.split()
