"""`sglang-evict eval --render-only` says what it did: it redraws, it writes no
results.json and ran no eval, so it reports no eval wall time."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sglang_evict.cli.main import main

RESULTS = Path(__file__).resolve().parents[1] / "benches" / "quality" / "results" / "results.json"


def test_render_only_redraws_and_claims_nothing_else(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    shutil.copy(RESULTS, tmp_path / "results.json")
    before = (tmp_path / "results.json").read_bytes()
    assert main(["eval", "--render-only", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == (
        f"redrew {tmp_path / 'results.png'} and {tmp_path / 'results.md'} "
        f"from {tmp_path / 'results.json'}"
    )
    assert "wall time" not in out and "wrote" not in out
    assert (tmp_path / "results.json").read_bytes() == before
    assert (tmp_path / "results.png").stat().st_size > 0
    assert "| sglang-evict | streaming |" in (tmp_path / "results.md").read_text()
