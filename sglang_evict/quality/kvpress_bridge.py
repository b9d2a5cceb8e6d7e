"""The kvpress environment both evaluations run their peer in, and the peer's run.

kvpress 0.5.5 requires ``transformers<5.3``; SGLang 0.5.17 pins 5.12.1. The peer
therefore runs in a virtual environment of its own that reuses this interpreter's
packages (``--system-site-packages``: the same torch, no second download) and adds
only ``transformers<5.3`` and kvpress on top:

    python -m venv --system-site-packages <venv>
    <venv>/bin/pip install "transformers<5.3" kvpress==0.5.5

Each evaluation writes its own job (``reference.kvpress``, ``real.kvpress``: the exact
inputs its own runs got); ``run_peer`` runs ``<venv>/bin/python -m <its peer module>``
on it and reads the results' JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

KVPRESS_VERSION = "0.5.5"
KVPRESS_TRANSFORMERS = "transformers<5.3"
DEFAULT_VENV = Path.home() / ".cache" / "sglang-evict" / f"kvpress-{KVPRESS_VERSION}-venv"
VENV_ENV = "SGLANG_EVICT_KVPRESS_VENV"  # overrides DEFAULT_VENV
PROJECT_ROOT = Path(__file__).resolve().parents[2]


class KVPressUnavailable(RuntimeError):
    """The peer environment is missing or broken; the message says how to fix it."""


def default_venv() -> Path:
    return Path(os.environ.get(VENV_ENV) or DEFAULT_VENV)


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def probe(venv: Path) -> dict | None:
    """Versions inside ``venv`` if kvpress imports there, else None."""
    python = venv_python(venv)
    if not python.is_file():
        return None
    code = (
        "import json, kvpress, torch, transformers; "
        "from importlib.metadata import version; "
        "print(json.dumps({'kvpress': version('kvpress'), "
        "'transformers': transformers.__version__, 'torch': torch.__version__}))"
    )
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def ensure_venv(venv: Path, *, create: bool = True) -> dict:
    """The peer environment's versions, creating it first when asked to."""
    versions = probe(venv)
    if versions is not None:
        return versions
    if not create:
        raise KVPressUnavailable(
            f"no kvpress environment at {venv}; create it with `python -m venv "
            f'--system-site-packages {venv} && {venv}/bin/pip install "{KVPRESS_TRANSFORMERS}" '
            f"kvpress=={KVPRESS_VERSION}` or pass --kvpress-setup"
        )
    venv.parent.mkdir(parents=True, exist_ok=True)
    steps = [
        [sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
        [
            str(venv_python(venv)),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            KVPRESS_TRANSFORMERS,
            f"kvpress=={KVPRESS_VERSION}",
        ],
    ]
    for command in steps:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
            raise KVPressUnavailable(
                f"creating the kvpress environment failed at `{' '.join(command)}`:\n"
                + "\n".join(tail)
            )
    versions = probe(venv)
    if versions is None:
        raise KVPressUnavailable(f"kvpress was installed in {venv} but does not import there")
    return versions


def run_peer(
    venv: Path,
    job_path: Path,
    out_path: Path,
    *,
    module: str,
    progress: bool = True,
) -> dict:
    """Run the peer ``module`` on a job; its stderr (the progress bar) passes through."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p
    )
    command = [
        str(venv_python(venv)),
        "-m",
        module,
        "--job",
        str(job_path),
        "--out",
        str(out_path),
    ]
    if not progress:
        command.append("--no-progress")
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise KVPressUnavailable(
            f"the kvpress peer exited with {done.returncode}; run `{' '.join(command)}` to see why"
        )
    return json.loads(out_path.read_text(encoding="utf-8"))
