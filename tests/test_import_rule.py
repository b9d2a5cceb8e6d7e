"""The import rule, enforced by parsing every module's imports.

sglang_evict_kernels  imports neither sglang_evict nor compactor_service (nor sglang)
compactor_service     imports sglang_evict_kernels only (never sglang, sglang_evict)
sglang_evict          may import both; only sglang_evict.srt imports sglang
no module imports itself through others (no import circles), lazy imports included
"""

from __future__ import annotations

import ast
import pickle
import re
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


# --- the layout: every package says what is inside; the layers' own rules ------------


def package_folders():
    for folder in PACKAGES.values():
        for init in sorted(folder.rglob("__init__.py")):
            yield init.parent


@pytest.mark.parametrize("folder", list(package_folders()), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_package_init_names_what_is_inside(folder):
    """A reader opening a package's ``__init__`` finds each of its modules and
    subpackages named there (a table, as ``srt`` and ``passes`` have)."""
    doc = ast.get_docstring(parse(folder / "__init__.py")) or ""
    inside = {p.stem for p in folder.glob("*.py")} | {
        p.name for p in folder.iterdir() if (p / "__init__.py").exists()
    }
    inside -= {"__init__", "__main__"}
    missing = sorted(name for name in inside if not re.search(rf"\b{re.escape(name)}\b", doc))
    assert not missing, f"{folder.relative_to(ROOT)}/__init__.py does not name {missing}"


def test_the_top_of_sglang_evict_holds_no_part_of_the_pass():
    """The pass's parts live in ``sglang_evict.passes``: a module at the top named for a
    part of the pass (``pass_*``, the mechanism, the planner) is a layout regression."""
    top = {p.stem for p in PACKAGES["sglang_evict"].glob("*.py")}
    strays = sorted(
        name
        for name in top
        if name.startswith(("pass_", "batch_"))
        or name in {"evictor", "planner", "selection", "tensor_pool"}
    )
    assert not strays, f"parts of the pass at the top of sglang_evict/: {strays}"


PASS_POLICY = ("batch", "selection", "planner", "grouping")
PASS_MECHANISM = (
    "manager",
    "device_work",
    "host_work",
    "moves",
    "graphs",
    "lease",
    "failures",
    "tensor_pool",
)


def test_the_passs_policy_imports_none_of_its_mechanism():
    names = module_names()
    graph = {name: project_imports(name, path, set(names)) for name, path in names.items()}
    policy = [
        name
        for name in graph
        if any(
            name == f"sglang_evict.passes.{p}" or name.startswith(f"sglang_evict.passes.{p}.")
            for p in PASS_POLICY
        )
    ]
    mechanism = {f"sglang_evict.passes.{m}" for m in PASS_MECHANISM}
    bad = {name: sorted(graph[name] & mechanism) for name in policy if graph[name] & mechanism}
    assert policy and not bad, f"policy modules importing the mechanism: {bad}"


def test_the_two_quality_evaluations_import_nothing_of_each_other():
    names = module_names()
    graph = {name: project_imports(name, path, set(names)) for name, path in names.items()}
    for one, other in (("reference", "real"), ("real", "reference")):
        prefix, forbidden = f"sglang_evict.quality.{one}", f"sglang_evict.quality.{other}"
        for name in graph:
            if name == prefix or name.startswith(prefix + "."):
                bad = sorted(
                    t for t in graph[name] if t == forbidden or t.startswith(forbidden + ".")
                )
                assert not bad, f"{name} imports {bad} of the other evaluation"


def test_the_product_never_imports_the_evaluation():
    """``sglang_evict.quality`` may import the product; nothing else in ``sglang_evict``
    (nor the kernels or the sidecar) imports it, lazily or not: the CLI finds the
    evaluation's commands through an entry point (``sglang_evict.commands``)."""
    names = module_names()
    graph = {name: project_imports(name, path, set(names)) for name, path in names.items()}
    evaluation = "sglang_evict.quality"
    bad = {
        name: sorted(t for t in targets if t == evaluation or t.startswith(evaluation + "."))
        for name, targets in graph.items()
        if not (name == evaluation or name.startswith(evaluation + "."))
    }
    bad = {name: targets for name, targets in bad.items() if targets}
    assert not bad, f"product modules importing the evaluation: {bad}"


def test_the_evaluation_checker_sees_a_lazy_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from sglang_evict.quality.real.needle import chat_ids\n")
    known = {"sglang_evict.quality.real.needle"}
    assert project_imports("sglang_evict.cli.demo", probe, known) == known


def test_the_top_of_sglang_evict_holds_at_most_sixteen_modules():
    """The entry points and the layers; a job with parts is a package of its own."""
    top = sorted(p.stem for p in PACKAGES["sglang_evict"].glob("*.py") if p.stem != "__init__")
    assert len(top) <= 16, f"{len(top)} modules at the top of sglang_evict/: {top}"
