"""``sglang-evict eval-real``: the needle prompts, the settings' checks, bad input in one
line with exit 2, and the report drawn from a results file. (The engine-side run is in
``test_engine_real_model.py``.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_evict.quality.real.evaluation import RealEvalSettings
from sglang_evict.quality.real.needle import (
    Needle,
    build_samples,
    chat_ids,
    found,
    needle_for,
    sentences,
)


@pytest.fixture(scope="module")
def real_tokenizer(real_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(real_model))


def test_needles_are_generated_not_chosen():
    needles = {needle_for(seed) for seed in range(200)}
    assert len(needles) > 190  # distinct needles
    assert all(len(n.code) == 7 and n.code.isdigit() for n in needles)


@pytest.mark.parametrize(
    ("answer", "hit"),
    [
        ("The secret code is 4512337.", True),
        ("It is 4,512,337", True),
        ("4 512 337", True),
        ("The code is 4512338.", False),
        ("I do not know.", False),
    ],
)
def test_found_reads_the_digits(answer, hit):
    assert found(Needle("Oslo", "4512337"), answer) is hit


def test_samples_hide_the_needle_at_its_depth_in_real_text(real_text, real_tokenizer):
    text = real_text.read_text()
    samples = build_samples(
        text, real_tokenizer, context_sizes=(500, 1000), depths=(0.1, 0.9), per_depth=2
    )
    assert len(samples) == 2 * 2 * 2
    assert len({s.needle for s in samples}) == len(samples)
    for sample in samples:
        decoded = real_tokenizer.decode(sample.prompt_ids)
        assert sample.needle.sentence in decoded
        assert decoded.rstrip().endswith("assistant")  # ready for the answer
        body = decoded.split(sample.needle.sentence)
        before, after = len(body[0]), len(body[1])
        depth = before / (before + after)
        assert abs(depth - sample.depth) < 0.2, (sample.key, depth)
        assert 0.8 * sample.context_tokens < len(sample.prompt_ids) < sample.context_tokens + 120


def test_a_haystack_longer_than_the_text_is_refused(real_tokenizer):
    with pytest.raises(ValueError, match="fewer than 5000 tokens"):
        build_samples(
            "A short text. It has three sentences. That is all.",
            real_tokenizer,
            context_sizes=(5000,),
            depths=(0.5,),
        )


def test_chat_ids_are_the_templates_ids(real_tokenizer):
    ids = chat_ids(real_tokenizer, [{"role": "user", "content": "Hello"}])
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert "Hello" in real_tokenizer.decode(ids)


def test_sentences_normalise_white_space():
    assert sentences("One line\nwraps here. Two!  Three?\n\nFour.") == [
        "One line wraps here.",
        "Two!",
        "Three?",
        "Four.",
    ]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"fractions": (1.0,)}, "evicts nothing"),
        ({"fractions": (0.0,)}, "not a fraction"),
        ({"ppl_budgets": (4096,), "ppl_length": 2048}, "not below the 2048-token"),
        ({"scorers": ("magic",)}, "unknown scorer"),
        ({"tasks": ("summaries",)}, "unknown task"),
        ({"depths": (1.5,)}, "outside"),
    ],
)
def test_settings_refuse_what_cannot_be_measured(fields, message):
    with pytest.raises(ValueError, match=message):
        RealEvalSettings(**fields)


def cli(*args, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sglang_evict.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.mark.parametrize(
    ("case", "args", "needle"),
    [
        ("budget above the context", ("--budgets", "3/2"), "evicts nothing"),
        ("not a llama folder", ("--model", "{bert}"), "is not an architecture the evaluation runs"),
        ("no model folder", ("--model", "{missing}"), "no config.json"),
        ("haystack too short", ("--text", "{short}", "--tasks", "needle"), "fewer than"),
        ("missing text", ("--text", "{missing}/t.txt"), "no such file"),
        ("bad contexts", ("--contexts", "1k"), "not a comma-separated list"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, real_model, case, args, needle):
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(
        json.dumps({"model_type": "bert", "architectures": ["BertModel"]})
    )
    short = tmp_path / "short.txt"
    short.write_text("Too short. Only a few sentences here. Nothing more.\n")
    values = {"bert": str(bert), "missing": str(tmp_path / "missing"), "short": str(short)}
    args = [a.format(**values) for a in args]
    if case == "haystack too short":
        args += ["--model", str(real_model), "--scorers", "streaming"]
    done = cli("eval-real", "--out", str(tmp_path / "out"), *args)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], done.stderr[-2000:]


def test_the_report_draws_tables_and_a_plot_from_results(tmp_path):
    from sglang_evict.quality.real import report as real_report

    answers = {}
    for method, fraction, hits in (("plain", 1.0, [1, 1, 1, 0]), ("rkv", 0.25, [1, 0, 1, 0])):
        for i, hit in enumerate(hits):
            answers[f"{method}|{fraction:g}|{i}"] = {
                "method": method,
                "budget_fraction": fraction,
                "context_tokens": 1000 if i < 2 else 2000,
                "found": bool(hit),
                "peak_kv_tokens": 300,
            }
    results = {
        "format": "sglang-evict/real-model-quality",
        "weights": "test weights",
        "settings": {"scorers": ["rkv"], "fractions": [0.25]},
        "needle_answers": answers,
        "perplexity": {
            "full|None": {"method": "full", "budget_tokens": None, "perplexity": 20.0,
                          "mean_peak_kv_tokens": 2048},
            "rkv|256": {"method": "rkv", "budget_tokens": 256, "perplexity": 22.0,
                        "mean_peak_kv_tokens": 320},
        },
        "kvpress": {"entries": [{"task": "needle", "method": "kvpress:SnapKVPress",
                                 "budget": 0.25, "rows": [{"context_tokens": 1000,
                                                           "found": True}]}]},
        "wall_s": 12.0,
    }  # fmt: skip
    (tmp_path / "results.json").write_text(json.dumps(results))
    _, png, table = real_report.render(tmp_path)
    assert "| sglang | plain | full | 0.75 (4) | 1.00 | 0.50 |" in table
    assert "| sglang-evict | rkv | 0.25 | 0.50 (4) | 0.50 | 0.50 |" in table
    assert "| kvpress | kvpress:SnapKVPress | 0.25 | 1.00 (1) | 1.00 | — |" in table
    assert "| sglang-evict | rkv | 256 | 22.00 | 1.100 | 320 |" in table
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"
