"""The import rule, enforced by parsing every module's imports.

sglang_evict_kernels  imports neither sglang_evict nor compactor_service (nor sglang)
compactor_service     imports sglang_evict_kernels only (never sglang, sglang_evict)
sglang_evict          may import both; only sglang_evict.srt imports sglang
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "sglang_evict_kernels": ROOT / "kernels" / "sglang_evict_kernels",
    "compactor_service": ROOT / "compactor_service",
    "sglang_evict": ROOT / "sglang_evict",
}
FORBIDDEN = {
    "sglang_evict_kernels": {"sglang_evict", "compactor_service", "sglang"},
    "compactor_service": {"sglang_evict", "sglang"},
    "sglang_evict": set(),
}
# The one package allowed to touch SGLang internals.
SGLANG_PACKAGE = "sglang_evict/srt/"


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def modules():
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            yield package, path


@pytest.mark.parametrize(("package", "path"), list(modules()), ids=lambda v: str(v))
def test_module_respects_the_import_rule(package, path):
    imports = imported_top_levels(path)
    bad = imports & FORBIDDEN[package]
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}, forbidden for {package}"
    relative = path.relative_to(ROOT).as_posix()
    if package == "sglang_evict" and not relative.startswith(SGLANG_PACKAGE):
        assert "sglang" not in imports, f"{relative} imports sglang outside {SGLANG_PACKAGE}"


def test_the_rule_checker_sees_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import sglang.srt.mem_cache\nfrom sglang_evict.config import X\n")
    assert imported_top_levels(probe) == {"sglang", "sglang_evict"}


def test_kernels_folder_is_not_an_import_package():
    """PyPI's `kernels` (an SGLang dependency) owns `import kernels`."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
