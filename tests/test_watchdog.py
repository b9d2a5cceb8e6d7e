"""The start-up watchdog (``SGLANG_EVICT_STALL_DUMP_S``): every thread's stack at each
interval while armed, nothing after it is disarmed, a bad value refused naming the
variable, and its hooks on the installed release's ``ModelRunner.alloc_memory_pool``
and ``Scheduler.run_event_loop``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from sglang_evict.srt.watchdog import STALL_DUMP_ENV, dump_interval_s

DUMP_HEADER = "most recent call first"


def run(script: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


def test_armed_it_dumps_every_thread_at_each_interval_and_stops_when_disarmed():
    done = run(
        """
        import sys, threading, time
        from sglang_evict.srt import watchdog
        threading.Thread(target=time.sleep, args=(5,), daemon=True, name="capture").start()
        assert watchdog.arm()
        time.sleep(1.3)
        watchdog.disarm()
        print("DISARMED", file=sys.stderr, flush=True)
        time.sleep(1.0)
        """,
        **{STALL_DUMP_ENV: "0.4"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    armed, _, after = done.stderr.partition("DISARMED")
    # At least two dumps, each of both threads (the main one and the sleeping one).
    assert armed.count("Thread 0x") >= 2 * 2 and armed.lower().count(DUMP_HEADER) >= 4
    assert "threading.py" in armed  # the other thread's frames, not just the main one's
    assert DUMP_HEADER not in after.lower()


def test_unset_or_zero_arms_nothing_and_a_bad_value_is_refused_naming_the_variable():
    assert dump_interval_s({}) is None and dump_interval_s({STALL_DUMP_ENV: "0"}) is None
    assert dump_interval_s({STALL_DUMP_ENV: " 30 "}) == 30.0
    for bad in ("soon", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match=f"{STALL_DUMP_ENV}=.*expected seconds"):
            dump_interval_s({STALL_DUMP_ENV: bad})


def test_its_hooks_sit_on_the_installed_releases_start_up():
    done = run(
        """
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.model_executor.model_runner import ModelRunner
        print(hasattr(Scheduler.run_event_loop, "__wrapped__"))
        print(hasattr(ModelRunner.alloc_memory_pool, "__wrapped__"))
        """,
        SGLANG_PLUGINS="sglang_evict",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"]
