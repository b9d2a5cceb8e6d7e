"""How SGLang starts its processes: forked instead of spawned, where asked and safe.

SGLang spawns its scheduler and detokenizer, and each imports SGLang again (about 13 s
of a core apiece on CPU, most of an engine's start). With ``FORK_ENV`` "1" (the tests
set it: tests/conftest.py) the plugin's ``register``, which SGLang calls as it loads
plugins and before it starts its processes, makes SGLang fork them instead. SGLang
itself is unchanged: the same processes, started another way.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

FORK_ENV = "SGLANG_EVICT_ENGINE_FORK"


def fork_sglangs_processes() -> bool:
    """SGLang's scheduler and detokenizer forked from this process (which has imported
    SGLang) instead of spawned (each importing it again: about 13 s of a core apiece on
    CPU): SGLang sets ``spawn`` as it starts, and this makes that call set ``fork``.
    Only while this process runs no thread of its own besides jemalloc's background
    one (an OpenMP pool, started by ``import torch`` unless ``OMP_NUM_THREADS=1``, does
    not survive a fork); False, and SGLang spawns, otherwise."""
    import multiprocessing

    set_start_method = multiprocessing.set_start_method
    if getattr(set_start_method, "forks", False):
        return True  # asked already (or a forked child of a process that asked)
    tasks = Path("/proc/self/task")
    if tasks.is_dir():
        names = [(task / "comm").read_text().strip() for task in tasks.iterdir()]
        if len([n for n in names if n != "jemalloc_bg_thd"]) > 1:
            return False

    def fork_instead(method=None, force=False):
        set_start_method("fork", force=True)

    fork_instead.forks = True
    multiprocessing.set_start_method = fork_instead
    return True


def fork_if_asked(environ=os.environ) -> None:
    """``fork_sglangs_processes`` where ``FORK_ENV`` is "1" (the plugin's ``register``
    calls it as SGLang loads plugins, before SGLang starts its processes: in an engine
    host and in ``sglang-evict serve``'s server alike); one line on stderr where it cannot."""
    if environ.get(FORK_ENV) == "1" and not fork_sglangs_processes():
        print(f"sglang-evict: {FORK_ENV}=1 ignored: this process runs threads", file=sys.stderr)
