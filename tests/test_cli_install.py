"""Installing: one torch, the one the installed SGLang release requires (0.5.17:
extra ``sglang``, ``dev``, constraints.txt; 0.5.23: ``sglang0523``, ``dev0523``,
constraints-sglang-0.5.23.txt).

The pins are read from pyproject.toml and the constraints file and compared with SGLang's
installed metadata. pip's resolver is then run for real, offline, on a local index of
tiny stand-in wheels that carry the project's actual torch/SGLang requirement strings:
the documented install (`-c constraints.txt`) must fetch exactly one torch.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def requirement(requirements: list[str], name: str) -> str:
    (found,) = [r for r in requirements if re.match(rf"{name}\s*[=<>!~ ;]", r + " ")]
    return found


def sglang_torch_pin() -> str:
    """``torch==X`` as SGLang's installed metadata requires it."""
    return requirement(importlib.metadata.requires("sglang"), "torch").split(";")[0].strip()


# release -> (its extra, its dev extra, its constraints file)
RELEASES = {
    "0.5.17": ("sglang", "dev", "constraints.txt"),
    "0.5.23": ("sglang0523", "dev0523", "constraints-sglang-0.5.23.txt"),
}
INSTALLED = importlib.metadata.version("sglang")


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_each_release_has_an_extra_a_dev_extra_and_a_constraints_file(release):
    extra, dev, constraints = RELEASES[release]
    extras = pyproject()["project"]["optional-dependencies"]
    assert requirement(extras[extra], "sglang") == f"sglang=={release}"
    assert extras[dev] == [f"sglang-evict[{extra},test]"]
    assert constraint_lines(constraints) == [requirement(extras[extra], "torch")]


def test_the_installed_releases_extra_pins_the_torch_its_metadata_requires():
    extra, _, _ = RELEASES[INSTALLED]
    extras = pyproject()["project"]["optional-dependencies"]
    assert requirement(extras[extra], "torch") == sglang_torch_pin()


def constraint_lines(name: str) -> list[str]:
    return [
        line.strip()
        for line in (ROOT / name).read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


def test_base_dependency_leaves_torch_open_for_later_sglang_releases():
    spec = requirement(pyproject()["project"]["dependencies"], "torch")
    assert "==" not in spec and "<" not in spec, spec


def test_constraints_file_pins_the_same_torch():
    _, _, constraints = RELEASES[INSTALLED]
    assert constraint_lines(constraints) == [sglang_torch_pin()]


def _write_wheel(folder: Path, name: str, version: str, requires=(), extras=None) -> None:
    """A minimal valid wheel: one empty module and METADATA with ``requires``."""
    dist_info = f"{name.replace('-', '_')}-{version}.dist-info"
    metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    metadata += [f"Requires-Dist: {r}" for r in requires]
    for extra, extra_requires in (extras or {}).items():
        metadata.append(f"Provides-Extra: {extra}")
        metadata += [f'Requires-Dist: {r}; extra == "{extra}"' for r in extra_requires]
    files = {
        f"{name.replace('-', '_')}_stub/__init__.py": "",
        f"{dist_info}/METADATA": "\n".join(metadata) + "\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name_in_wheel, text in files.items():
            wheel.writestr(name_in_wheel, text)
            digest = hashlib.sha256(text.encode()).digest()
            encoded = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
            record.append(f"{name_in_wheel},sha256={encoded},{len(text)}")
        record.append(f"{dist_info}/RECORD,,")
        wheel.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")


def test_documented_dev_install_fetches_one_torch(tmp_path):
    """pip --dry-run over stand-ins: sglang-evict with the project's own torch/SGLang
    requirements (its dev extra naming its SGLang extra, as pyproject.toml does), the
    installed SGLang release with its real torch pin, and two torch releases (the pinned
    one and a newer one that `torch>=2.4` alone would pick)."""
    project = pyproject()["project"]
    extra, dev, constraints = RELEASES[INSTALLED]
    pinned = sglang_torch_pin().split("==")[1]
    for version in (pinned, "99.0.0"):
        _write_wheel(tmp_path, "torch", version)
    _write_wheel(tmp_path, "sglang", INSTALLED, [sglang_torch_pin()])
    extras = project["optional-dependencies"]
    _write_wheel(
        tmp_path,
        "sglang-evict",
        project["version"],
        [requirement(project["dependencies"], "torch")],
        {
            extra: [requirement(extras[extra], "sglang"), requirement(extras[extra], "torch")],
            dev: extras[dev],
        },
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # this machine's index settings play no part
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--no-index",
            "--find-links",
            str(tmp_path),
            "-c",
            str(ROOT / constraints),
            f"sglang-evict[{dev}]",
            "-v",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    fetched = re.findall(r"Processing \S*torch-(\S+?)-py3-none-any\.whl", result.stdout)
    assert fetched == [pinned], result.stdout[-3000:]
    assert f"torch-{pinned}" in result.stdout.split("Would install")[-1]
