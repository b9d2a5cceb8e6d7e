"""Building the C++ modules with PyTorch's extension builder, safe against a stale
build lock.

The builder serialises builds of one module with a lock file in its build folder and
waits, without end, for that file to go. A process killed while it built (a SIGKILLed
compactor during its first start on a machine) leaves the file behind, and every later
load of that module would wait forever. So before a load: a lock is waited for while it
is younger than ``STALE_LOCK_S`` (a build on 2 busy cores takes well under that), and
an older one is removed as the leftover of a dead build. The builder takes that lock
even to load a module built already, so ``load_built`` loads a built module's library
directly, without the builder (and its lock): a process killed while loading leaves
nothing behind.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path

logger = logging.getLogger(__name__)
STALE_LOCK_S = 300.0
POLL_S = 0.5


def clear_stale_lock(name: str, stale_s: float = STALE_LOCK_S, clock_s=time.time) -> None:
    """Wait while module ``name``'s build lock is fresh; remove it once it is stale."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    except Exception:  # a builder without that helper: let it do as it does
        return
    while True:
        try:
            age_s = clock_s() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age_s >= stale_s:
            lock.unlink(missing_ok=True)
            logger.warning(
                "removed %s's build lock, %.0f s old: left by a build that died", name, age_s
            )
            return
        time.sleep(POLL_S)


def load_built(name: str):
    """Module ``name`` from its build folder's library when it was built already (its
    name carries its sources' hash, so a built one is current); None otherwise, or when
    the library does not load (then the builder builds it again)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        path = Path(_get_build_directory(name, verbose=False)) / f"{name}.so"
        if not path.is_file():
            return None
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception:  # a partial library (a build killed while linking), a builder change
        return None
    return module


def load_module(name: str, sources: list[str], **options):
    """Module ``name``: its built library (``load_built``), else built from ``sources``
    by PyTorch's builder (``options``: its flags) once a dead build's lock is gone."""
    built = load_built(name)
    if built is not None:
        return built
    from torch.utils import cpp_extension

    clear_stale_lock(name)
    return cpp_extension.load(name=name, sources=sources, verbose=False, **options)
