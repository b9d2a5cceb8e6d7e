"""The kvpress environment both evaluations run their peer in, and the peer's run.

kvpress 0.5.5 requires ``transformers<5.3``; SGLang 0.5.17 pins 5.12.1. The peer
therefore runs in a virtual environment of its own (``quality.peer_env``) that reuses
this interpreter's packages and adds only ``transformers<5.3`` and kvpress on top:

    python -m venv --system-site-packages <venv>
    <venv>/bin/pip install "transformers<5.3" kvpress==0.5.5

Each evaluation writes its own job (``reference.kvpress``, ``real.kvpress``: the exact
inputs its own runs got); ``run_peer`` runs ``<venv>/bin/python -m <its peer module>``
on it and reads the results' JSON.
"""

from __future__ import annotations

from pathlib import Path

from sglang_evict.quality import peer_env
from sglang_evict.quality.peer_env import PeerUnavailable as KVPressUnavailable

KVPRESS_VERSION = "0.5.5"
KVPRESS_TRANSFORMERS = "transformers<5.3"
KVPRESS = peer_env.PeerEnv(
    name=f"kvpress-{KVPRESS_VERSION}",
    packages=(KVPRESS_TRANSFORMERS, f"kvpress=={KVPRESS_VERSION}"),
    imports=("kvpress", "torch", "transformers"),
    distributions=("kvpress", "transformers", "torch"),
    venv_env="SGLANG_EVICT_KVPRESS_VENV",
    create_hint="run without --kvpress-no-setup",
)
DEFAULT_VENV = peer_env.CACHE_DIR / f"{KVPRESS.name}-venv"
VENV_ENV = KVPRESS.venv_env  # overrides DEFAULT_VENV

__all__ = ["KVPressUnavailable", "default_venv", "ensure_venv", "probe", "run_peer"]


def default_venv() -> Path:
    return KVPRESS.default_venv()


def probe(venv: Path) -> dict | None:
    """Versions inside ``venv`` if kvpress imports there, else None."""
    return peer_env.probe(KVPRESS, venv)


def ensure_venv(venv: Path, *, create: bool = True) -> dict:
    """The kvpress environment's versions, creating it first when asked to."""
    return peer_env.ensure(KVPRESS, venv, create=create)


def run_peer(venv: Path, job_path: Path, out_path: Path, *, module: str, progress=True) -> dict:
    """Run the kvpress peer ``module`` on a job."""
    return peer_env.run_peer(
        venv, job_path, out_path, module=module, progress=progress, name="kvpress"
    )
