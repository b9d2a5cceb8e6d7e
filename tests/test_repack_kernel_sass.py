"""``scripts/repack_kernel_sass.py``: the repack kernel compiled for an H100/H200 (sm_90)
on this machine; no GPU runs anything.

Facts of the compiler, not timings: every row size moves as 16-byte vector loads and
stores (one per 16 bytes a thread moves), nothing spills, and the straight-line program
issues few enough instructions per moved byte that the static prediction clears the
repack's goals (0.92 of a copy at 2 KiB rows, 0.75 at 128-byte rows)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "repack_kernel_sass.py"


def load():
    spec = importlib.util.spec_from_file_location("repack_kernel_sass", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sass = load()
pytestmark = pytest.mark.skipif(
    not sass.ptxas_available(), reason="Triton without its NVIDIA backend (ptxas)"
)


@pytest.fixture(scope="module")
def rows():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--rows", "128", "288", "2048", "18432", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return {row["row_bytes"]: row for row in map(json.loads, result.stdout.splitlines())}


def test_rows_move_as_16_byte_vectors_without_spilling(rows):
    for row_bytes, row in rows.items():
        assert row["stack_bytes"] == 0, row_bytes
        threads = 32 * row["warps"]
        moved = row["MOVES"] * row_bytes
        if row["ROW_WORDS"] % row["CHUNK"] == 0:  # no masked tile column: exact
            assert row["vector_accesses"] == 2 * moved // 16 // threads, row_bytes
        else:  # the tile's masked columns are vectors too
            assert row["vector_accesses"] >= 2 * moved // 16 // threads, row_bytes
        assert row["issued"].get("LDG", 0) >= row["vector_accesses"] // 2, row_bytes


def test_the_static_prediction_clears_the_goals(rows):
    assert rows[2048]["predicted"] >= 0.92
    assert rows[128]["predicted"] >= 0.75
    for row in rows.values():
        assert row["per_byte"] < 0.2, row  # the old kernel issued 4.05 at 128-byte rows


def test_resident_programs_follow_the_registers():
    assert sass.resident_programs(32, 0, 4) == 16  # 64 warps an SM, 4 a program
    assert sass.resident_programs(128, 0, 4) == 4  # 65,536 registers / (128 x 128)
    assert sass.resident_programs(40, 100 * 1024, 4) == 2  # 228 KiB of shared memory


def test_bad_row_sizes_are_refused():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--rows", "100"], capture_output=True, text=True
    )
    assert result.returncode != 0 and "multiples of 8" in result.stderr
