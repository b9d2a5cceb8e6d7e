"""The import rule, enforced by parsing every module's imports.

sglang_evict_kernels  imports neither sglang_evict nor compactor_service (nor sglang)
compactor_service     imports sglang_evict_kernels only (never sglang, sglang_evict)
sglang_evict          may import both; only sglang_evict.srt imports sglang
no module imports itself through others (no import circles), lazy imports included
"""

from __future__ import annotations

import ast
import pickle
import subprocess
import sys
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


# CPython 3.11 keeps the AST constructor's recursion depth per interpreter, not per
# thread: an ast.parse here racing one in another thread of the test process (a Triton
# JIT in a server thread an earlier test left running) fails with "AST constructor
# recursion depth mismatch". Modules are parsed in a fresh interpreter of their own and
# their trees come back pickled (unpickling builds the nodes without that constructor).
PARSER = """
import ast, pickle, sys
paths = [line for line in sys.stdin.read().splitlines() if line]
trees = {path: ast.parse(open(path).read(), filename=path) for path in paths}
sys.stdout.buffer.write(pickle.dumps(trees))
"""
_trees: dict[str, ast.Module] = {}


def parse(path: Path) -> ast.Module:
    """``path``'s syntax tree; the first call parses every project module at once."""
    key = str(path)
    if key not in _trees:
        wanted = {key} | {str(p) for folder in PACKAGES.values() for p in folder.rglob("*.py")}
        wanted -= set(_trees)
        parsed = subprocess.run(
            [sys.executable, "-c", PARSER],
            input="\n".join(sorted(wanted)).encode(),
            capture_output=True,
            check=True,
            timeout=300,
        )
        _trees.update(pickle.loads(parsed.stdout))
    return _trees[key]


def imported_top_levels(path: Path) -> set[str]:
    tree = parse(path)
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


# --- no import circles between the project's modules --------------------------------


def module_names() -> dict[str, Path]:
    names = {}
    for folder in PACKAGES.values():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names[".".join(parts)] = path
    return names


def project_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports, at module level or inside functions (a lazy
    import is still a circle), outside ``if TYPE_CHECKING:`` blocks."""
    tree = parse(path)
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{module}.{alias.name}" in known:
                    found.add(f"{module}.{alias.name}")
                elif module in known:
                    found.add(module)
    found.discard(name)
    return found


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_import_circles():
    names = module_names()
    graph = {name: project_imports(name, path, set(names)) for name, path in names.items()}
    circles = import_circles(graph)
    assert not circles, "modules that import each other (directly or in a ring): " + "; ".join(
        " <-> ".join(circle) for circle in circles
    )


def test_the_circle_finder_sees_lazy_and_relative_imports(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import x\n")
    (package / "b.py").write_text("def f():\n    from pkg import c\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import x\n"
        "import pkg.a\n"
    )
    (package / "d.py").write_text("from pkg.a import y\n")
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d"}
    graph = {
        name: project_imports(
            name,
            package / ("__init__.py" if name == "pkg" else f"{name.split('.')[1]}.py"),
            known,
        )
        for name in known
    }
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a"}  # the TYPE_CHECKING import does not count
    assert import_circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert import_circles({"x": {"y"}, "y": set()}) == []
