"""The default scorer follows the committed quality measurements: the best scorer a
server runs without calibration, by the rule ``report.best_scorer`` states once."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_evict.cli import build_parser
from sglang_evict.config import DEFAULT_SCORER, EvictionConfig
from sglang_evict.quality import report
from sglang_evict.scorers import needs_calibration
from sglang_evict.srt.server_args import server_scorers

RESULTS = Path(__file__).resolve().parents[1] / "benches" / "quality" / "results" / "results.json"


def calibration_free_server_scorers() -> list[str]:
    return [name for name in server_scorers() if not needs_calibration(name)]


def test_default_scorer_is_the_best_measured_scorer_the_server_runs_without_calibration():
    results = report.load_results(RESULTS)
    best = report.best_scorer(results, calibration_free_server_scorers())
    assert DEFAULT_SCORER == best
    assert EvictionConfig(kv_budget_tokens=1024).scorer == best
    for command in ("serve", "simulate"):
        args, _ = build_parser().parse_known_args([command, "--kv-budget", "1024"])
        assert args.kv_scorer == best, command


def test_the_candidates_are_what_the_server_runs_with_no_stats_file():
    candidates = calibration_free_server_scorers()
    assert "triattention" not in candidates  # needs `sglang-evict calibrate`
    # window and rkv read queries the server captures inside the attention.
    assert set(candidates) == {"streaming", "knorm", "random", "window", "rkv"}


def _entry(method: str, budget: float, accuracy: float, page_size: int = 16) -> dict:
    return {
        "engine": "sglang-evict",
        "method": method,
        "budget_fraction": budget,
        "page_size": page_size,
        "step_accuracy": accuracy,
        "relative_step_accuracy": accuracy,
    }


def test_best_scorer_ranks_at_the_largest_evicting_budget_and_ignores_other_scorers():
    entries = [
        _entry("full", 1.0, 1.0),
        _entry("a", 0.25, 0.9),  # best at the smaller budget only
        _entry("a", 0.5, 0.5),
        _entry("b", 0.25, 0.1),
        _entry("b", 0.5, 0.6, page_size=1),
        _entry("b", 0.5, 0.4, page_size=16),  # mean over page sizes: 0.5 ...
        _entry("c", 0.5, 0.55),  # ... so c leads b and a at 0.5
        _entry("d", 0.5, 0.99),  # not a candidate
    ]
    results = {"entries": entries}
    assert report.best_scorer(results, ["a", "b", "c"]) == "c"
    assert report.best_scorer(results, ["a", "b"]) == "a"  # tie at 0.5: first by name
    with pytest.raises(ValueError, match=r"no evicting entries for scorer\(s\) \['e'\]"):
        report.best_scorer(results, ["a", "e"])
