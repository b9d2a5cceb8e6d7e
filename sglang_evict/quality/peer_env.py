"""The virtual environments peers run in, beside this interpreter's packages.

A peer whose pins clash with SGLang's (kvpress: ``transformers<5.3``) or that adds
packages the project does not otherwise need (transformers' quantized cache: its quanto
and HQQ backends) runs in a virtual environment of its own that reuses this
interpreter's packages (``--system-site-packages``: the same torch, no second download)
and adds only its own:

    python -m venv --system-site-packages <venv>
    <venv>/bin/pip install <the peer's packages>

``run_peer`` runs ``<venv>/bin/python -m <peer module> --job job.json --out out.json``
(this project on its ``PYTHONPATH``) and reads the results' JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = Path.home() / ".cache" / "sglang-evict"


class PeerUnavailable(RuntimeError):
    """A peer's environment is missing or broken; the message says how to fix it."""


@dataclass(frozen=True)
class PeerEnv:
    """One peer's environment: what it installs, what must import, the versions shown."""

    name: str  # in messages and the default venv's directory name
    packages: tuple[str, ...]  # pip requirements on top of this interpreter's packages
    imports: tuple[str, ...]  # modules that must import for the environment to count
    distributions: tuple[str, ...]  # whose versions the results record
    venv_env: str  # the environment variable that overrides the default venv
    create_hint: str = ""  # how the command creates it ("run without --x"), for errors

    def default_venv(self) -> Path:
        return Path(os.environ.get(self.venv_env) or CACHE_DIR / f"{self.name}-venv")

    def install_command(self, venv: Path) -> str:
        packages = " ".join(f'"{p}"' for p in self.packages)
        return f"python -m venv --system-site-packages {venv} && {venv}/bin/pip install {packages}"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def probe(env: PeerEnv, venv: Path) -> dict | None:
    """Versions inside ``venv`` if ``env``'s modules import there, else None."""
    python = venv_python(venv)
    if not python.is_file():
        return None
    code = (
        f"import json; import {', '.join(env.imports)}; "
        "from importlib.metadata import version; "
        f"print(json.dumps({{d: version(d) for d in {list(env.distributions)!r}}}))"
    )
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def ensure(env: PeerEnv, venv: Path, *, create: bool = True) -> dict:
    """``env``'s versions in ``venv``, creating the environment first when asked to."""
    versions = probe(env, venv)
    if versions is not None:
        return versions
    if not create:
        hint = f" or {env.create_hint}" if env.create_hint else ""
        raise PeerUnavailable(
            f"no {env.name} environment at {venv}; create it with "
            f"`{env.install_command(venv)}`{hint}"
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
            *env.packages,
        ],
    ]
    for command in steps:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
            raise PeerUnavailable(
                f"creating the {env.name} environment failed at `{' '.join(command)}`:\n"
                + "\n".join(tail)
            )
    versions = probe(env, venv)
    if versions is None:
        raise PeerUnavailable(f"{env.name} was installed in {venv} but does not import there")
    return versions


def run_peer(
    venv: Path,
    job_path: Path,
    out_path: Path,
    *,
    module: str,
    progress: bool = True,
    name: str = "peer",
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
        raise PeerUnavailable(
            f"the {name} peer exited with {done.returncode}; run `{' '.join(command)}` to see why"
        )
    return json.loads(out_path.read_text(encoding="utf-8"))
