"""``scripts/tier_kernel_sass.py``: the tier's attention bodies compiled for an H100/H200
(sm_90) on this machine, with the ptxas Triton's wheel carries; no GPU runs anything.

What the compiled code says is a fact of the compiler, not a timing: the group loop is
found, the words body issues fewer instructions per byte read than the grouped one (the
reason it exists) without spilling, and the per-line profile points at the kernel's own
source."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tier_kernel_sass.py"


def load():
    spec = importlib.util.spec_from_file_location("tier_kernel_sass", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sass = load()
pytestmark = pytest.mark.skipif(
    not sass.ptxas_available(), reason="Triton without its NVIDIA backend (ptxas)"
)


@pytest.fixture(scope="module")
def rows():
    """The script as a user runs it (it compiles without the interpreter CI sets)."""
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            *("--shape", "llama8b", "--bits", "3", "--warps", "2"),
            *("--lines", "grouped", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    found = [json.loads(line) for line in result.stdout.splitlines()]
    return {row["body"]: row for row in found}


def test_every_body_compiles_for_sm90_and_its_group_loop_is_found(rows):
    assert set(rows) == {name for name, *_ in sass.BODIES}
    for name, row in rows.items():
        assert 0 < row["registers"] <= 255, name
        assert row["loop"] > 100, f"{name}: no group loop in its SASS"
        reads = row["issued"].get("LDG", 0) + row["issued"].get("LDGSTS", 0)  # LDGSTS: async
        assert reads > 0, f"{name}: the loop reads no global memory"
        assert row["per_group"] == 2 * row["loop"]
    for name in ("words", "words tf32"):
        assert rows[name]["issued"].get("HMMA", 0) > 0, name  # tl.dot on tensor cores


def test_the_words_body_issues_fewer_instructions_per_byte_than_the_grouped_one(rows):
    assert rows["words tf32"]["per_byte"] < rows["grouped"]["per_byte"]
    assert rows["words"]["per_byte"] < 0.5 * rows["grouped"]["per_byte"]
    assert rows["words"]["stack_bytes"] == 0  # its default (half-precision products) spills nothing


def test_the_line_profile_attributes_the_loop_to_the_kernels_source(rows):
    lines = rows["grouped"]["lines"]
    total = sum(count for count, _, _ in lines)
    assert total == rows["grouped"]["loop"]
    # the kernel's own lines and the Triton library's it inlines (tl.sum, tl.max)
    files = {where.split(":")[0] for _, where, _ in lines}
    assert "tier_jit.py" in files and files <= {"tier_jit.py", "standard.py", "?"}, files
    ours = [where for _, where, _ in lines if where.startswith("tier_jit.py:")]
    assert sass.source_line(ours[0])  # the kernel's busiest line, read back from its source
    assert rows["words"]["lines"] == []  # only the body asked for


def test_group_bytes_count_codes_scales_and_outliers():
    # 3 bits, head dim 128: 2 x 32 x 48 code bytes, 2 x 256 key scale bytes, 2 x 32 x 4 x 2
    # value scale bytes, 3 outlier rows of 2 x 128 bfloat16 values and an index
    assert sass.group_bytes(3, 128) == 3072 + 512 + 512 + 3 * (512 + 2)
