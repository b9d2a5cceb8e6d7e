"""Copies through a shared file's mapping under a SIGBUS guard (``csrc/
guarded_copy_cpu.cpp``): what the compactor uses for a CPU pool's and arena's files once
the module is built, instead of one ``pread``/``pwrite`` a run.

A mapping read or written past the end of a file its client truncated raises SIGBUS;
the module's handler turns that into a ``False`` return on the faulting thread (the
caller drops the pool), and passes any other SIGBUS on. Its reference is the descriptor
path (``compactor_service.shared_pool.PoolFile`` without the module), held to the same
bytes by ``tests/test_guarded_copy.py``.

The module is built from source on first use (a C++ compiler and ninja; seconds, once
per machine, in ``TORCH_EXTENSIONS_DIR``). ``start_loading`` builds it on a background
thread, and ``loaded`` never waits: a compactor serves with the descriptor path until it
is there. ``SGLANG_EVICT_GUARDED_COPY=0`` keeps the descriptor path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

from sglang_evict_kernels._build import load_module

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "guarded_copy_cpu.cpp"
ENV_SWITCH = "SGLANG_EVICT_GUARDED_COPY"

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict = {"module": None, "why": "not loaded yet", "thread": None}


def _off() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off")


# ATen's parallel_for runs on OpenMP threads only in code built with OpenMP.
CFLAGS = ["-O2", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


def _build():
    key = SOURCE.read_bytes() + torch.__version__.encode() + " ".join(CFLAGS + LDFLAGS).encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    return load_module(
        f"sglang_evict_guarded_copy_{digest}",
        [str(SOURCE)],
        extra_cflags=CFLAGS,
        extra_ldflags=LDFLAGS,
    )


def load():
    """The module, built if need be (blocks); None when turned off or unbuildable
    (``why_not`` says why)."""
    with _lock:
        if _state["module"] is not None or _state["why"] != "not loaded yet":
            return _state["module"]
        if _off():
            _state["why"] = f"turned off by {ENV_SWITCH}=0"
            return None
        try:
            _state["module"] = _build()
            _state["why"] = ""
        except Exception as error:  # a missing compiler or ninja, a failed build
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            _state["why"] = f"building it failed ({first[:300]})"
            logger.warning("guarded copies unavailable: %s; using pread/pwrite", _state["why"])
        return _state["module"]


def start_loading() -> None:
    """Build (or load) the module on a background thread, once."""
    with _lock:
        if _state["thread"] is not None or _off():
            return
        _state["thread"] = threading.Thread(target=load, daemon=True, name="guarded-copy-build")
        _state["thread"].start()


def loaded():
    """The module if it is loaded already, else None (never waits)."""
    return _state["module"]


def why_not() -> str:
    return _state["why"]
