"""Stack dumps while a scheduler starts (``SGLANG_EVICT_STALL_DUMP_S``): the diagnosis
for a start-up that stops making progress where no debugger reaches (a lent GPU's
timed call, a CI run).

With the variable set to N > 0 seconds, a scheduler process writes every thread's
Python stack to its stderr (the engine's log) every N seconds, from the moment its KV
pools exist (``ModelRunner.alloc_memory_pool``, AFTER: the attention backends and the
decode and prefill CUDA-graph captures come next) until its event loop starts
(``Scheduler.run_event_loop``, BEFORE). A stall shows as the same innermost frames in
consecutive dumps (which capture size, which kernel compiling, which lock); a start that
keeps moving shows different ones. ``faulthandler`` writes the dumps from its own C
thread, without the GIL, so a thread stuck in C (a compiler, a CUDA call) is dumped
too. Unset or 0: nothing armed, nothing changes.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys

logger = logging.getLogger(__name__)

STALL_DUMP_ENV = "SGLANG_EVICT_STALL_DUMP_S"
HOOK_RUN_EVENT_LOOP = "sglang.srt.managers.scheduler.Scheduler.run_event_loop"


def dump_interval_s(environ=os.environ) -> float | None:
    """The interval ``SGLANG_EVICT_STALL_DUMP_S`` asks for (None: unset or 0). Raises
    ``ValueError`` naming the variable on anything but a finite number >= 0."""
    text = environ.get(STALL_DUMP_ENV, "").strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 <= seconds < float("inf"):  # refuses nan too
        raise ValueError(
            f"{STALL_DUMP_ENV}={text!r}: expected seconds between stack dumps (e.g. 30), "
            f"or 0 / unset for none"
        )
    return seconds or None


def arm() -> bool:
    """Start the repeated dumps if the variable asks for them; True when armed."""
    seconds = dump_interval_s()
    if seconds is None:
        return False
    faulthandler.dump_traceback_later(seconds, repeat=True, file=sys.stderr)
    logger.warning(
        "sglang-evict: %s=%g: every thread's stack goes to stderr every %g s until the "
        "scheduler's event loop starts",
        STALL_DUMP_ENV,
        seconds,
        seconds,
    )
    return True


def disarm() -> None:
    faulthandler.cancel_dump_traceback_later()


def _after_alloc_memory_pool(result, model_runner, *args, **kwargs):
    arm()
    return result


def _before_run_event_loop(scheduler, *args, **kwargs):
    if dump_interval_s() is not None:
        disarm()
        logger.info("sglang-evict: start-up stack dumps stopped (the event loop starts)")
