"""The README and ``docs/`` say only what exists: every relative link (and its anchor)
leads somewhere, every repository path they name is in the repository, and every
command-line flag they name is one a command of this project, SGLang's server or a
script of this repository accepts (or one of the few external tools' flags they quote,
listed below by tool)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP_LEVEL = (
    "sglang_evict/",
    "compactor_service/",
    "kernels/",
    "tests/",
    "benches/",
    "scripts/",
    "helm/",
    "protos/",
    "examples/",
    "docs/",
    ".ci/",
)
# Flags of other programs the pages quote, by program.
EXTERNAL_FLAGS = {
    "pip": {
        "--no-deps",
        "--dry-run",
        "--no-index",
        "--target",
        "--upgrade",
        # pip download, fetching wheels for the GPU machine (development.md)
        "--only-binary",
        "--python-version",
        "--implementation",
        "--platform",
    },
    "python -m venv": {"--system-site-packages"},
    "helm": {"--create-namespace"},
    "pytest": {"--strict-markers", "--dist", "--durations"},
}
README_MAX_LINES = 200


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, fence = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (match := re.match(r"^#{1,6} (.*)", line)):
            found.add(slug(match.group(1)))
    return found


def prose(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; detail goes to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_exists(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(page)):
        if re.match(r"^[a-z]+://", target):
            continue
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.name}: {broken}"


def named_paths(text: str) -> set[str]:
    paths = set()
    for quoted in re.findall(r"`([^`\n]+)`", text):
        for word in re.split(r"[\s=(),]+", quoted):
            word = word.split("::", 1)[0].rstrip(".:;")
            if word.startswith(TOP_LEVEL) and not any(c in word for c in "<>$"):
                paths.add(word)
    return paths


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_repository_path_named_exists(page):
    missing = [p for p in sorted(named_paths(prose(page))) if not list(ROOT.glob(p.rstrip("/")))]
    assert not missing, f"{page.name} names paths that are not in the repository: {missing}"


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    flags = set()
    for action in parser._actions:
        flags.update(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= parser_flags(sub)
    return flags


def accepted_flags() -> set[str]:
    from compactor_service.server import build_arg_parser
    from sglang_evict.cli.main import build_parser

    flags = parser_flags(build_parser()) | parser_flags(build_arg_parser())
    try:
        from sglang.srt.server_args import ServerArgs

        sglang_parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(sglang_parser)
        flags |= parser_flags(sglang_parser)
    except ImportError:  # the lean test install has no SGLang; its flags are not checked
        pass
    try:  # SGLang's router (the router extra): `sglang-evict router` passes its flags on
        from sglang_router.router_args import RouterArgs

        router_parser = argparse.ArgumentParser()
        RouterArgs.add_cli_args(router_parser)
        flags |= parser_flags(router_parser)
    except ImportError:
        pass
    scripts = [
        *ROOT.glob("benches/**/*.py"),
        *ROOT.glob("scripts/*"),
        ROOT / ".ci" / "run",
        *ROOT.glob("compactor_service/*.py"),
    ]
    for script in scripts:
        if script.is_file():
            flags |= set(re.findall(r"[\"'](--[a-z][a-z0-9-]*)", script.read_text("utf-8")))
    for tool_flags in EXTERNAL_FLAGS.values():
        flags |= tool_flags
    return flags


def named_flags(text: str) -> set[str]:
    # A family written with a wildcard (`--kv-*`, `--kv-…`) is not a flag.
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?![\w*…-])", text))


def test_every_flag_named_is_accepted():
    accepted = accepted_flags()
    unknown = {
        page.name: sorted(named_flags(prose(page)) - accepted)
        for page in PAGES
        if named_flags(prose(page)) - accepted
    }
    assert not unknown, f"flags no command accepts: {unknown}"


def test_the_checks_catch_what_they_look_for(tmp_path):
    assert slug("Memory-bound serving: admission and pressure passes") == (
        "memory-bound-serving-admission-and-pressure-passes"
    )
    assert slug("SGLang 0.5.17 and 0.5.23") == "sglang-0517-and-0523"
    assert named_paths("see `sglang_evict/nowhere.py` and `tests/test_docs.py::x`") == {
        "sglang_evict/nowhere.py",
        "tests/test_docs.py",
    }
    assert "--kv-no-such-flag" not in accepted_flags()
    assert named_flags("use `--kv-budget 64` (not ---x, a-b--c, --kv-*)") == {"--kv-budget"}
