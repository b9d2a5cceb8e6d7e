"""The default scorer follows the committed quality measurements on the real model
(``benches/quality/real``: SmolLM2-135M-Instruct, 4-bit weights dequantised): the best
scorer a server runs without calibration, by the rule ``real_report.best_scorer``
states once. (The recall-chain model's results stay a fast regression canary.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_evict.cli.main import build_parser
from sglang_evict.config import DEFAULT_SCORER, EvictionConfig
from sglang_evict.quality.real import report as real_report
from sglang_evict.quality.reference import report
from sglang_evict.scorers import needs_calibration
from sglang_evict.srt.server_args import server_scorers

RESULTS = Path(__file__).resolve().parents[1] / "benches" / "quality" / "real" / "results.json"


def calibration_free_server_scorers() -> list[str]:
    return [name for name in server_scorers() if not needs_calibration(name)]


def test_default_scorer_is_the_best_measured_scorer_the_server_runs_without_calibration():
    results = json.loads(RESULTS.read_text())
    best = real_report.best_scorer(results, calibration_free_server_scorers())
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


def _needle(method: str, fraction: float, hits: list[bool]) -> dict:
    return {
        f"{method}|{fraction}|{i}": {
            "method": method,
            "budget_fraction": fraction,
            "context_tokens": 1000,
            "found": hit,
            "peak_kv_tokens": None,
        }
        for i, hit in enumerate(hits)
    }


def test_real_best_scorer_ranks_needle_accuracy_then_perplexity_then_name():
    answers = {
        **_needle("plain", 1.0, [True, True]),
        **_needle("a", 0.25, [True, False]),
        **_needle("a", 0.5, [True, True]),  # a: mean 0.75
        **_needle("b", 0.25, [True, True]),
        **_needle("b", 0.5, [False, True]),  # b: mean 0.75, ties a
        **_needle("c", 0.5, [True, False]),  # c: 0.5
        **_needle("d", 0.5, [True, True]),  # not a candidate
    }
    perplexity = {
        "full|None": {"method": "full", "budget_tokens": None, "perplexity": 10.0},
        "a|256": {"method": "a", "budget_tokens": 256, "perplexity": 12.0},
        "b|256": {"method": "b", "budget_tokens": 256, "perplexity": 11.0},
    }
    results = {
        "settings": {"scorers": ["a", "b", "c", "d"], "fractions": [0.25, 0.5]},
        "needle_answers": answers,
        "perplexity": perplexity,
    }
    assert real_report.best_scorer(results, ["a", "b", "c"]) == "b"  # lower perplexity
    assert real_report.best_scorer(results, ["a", "c"]) == "a"
    with pytest.raises(ValueError, match=r"no needle entries for scorer\(s\) \['e'\]"):
        real_report.best_scorer(results, ["a", "e"])
