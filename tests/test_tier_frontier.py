"""``sglang-evict eval-tier``'s pure parts: how a candidate spends a fraction of the KV
bytes, the needle kinds, the report and the rule that picks the tier's defaults; and one
needle answer through the paged reference path on the tiny model, holding the bytes it
was given."""

from __future__ import annotations

import json
import types

import pytest

from sglang_evict.quality.real import frontier_report
from sglang_evict.quality.real.frontier import Candidate, Shape, config_for, needle_answer, spend
from sglang_evict.quality.real.frontier_run import FrontierSettings
from sglang_evict.quality.real.needle import KINDS, Needle, found, needle_for

SMOLLM2 = Shape(num_layers=30, num_kv_heads=3, head_dim=64)


@pytest.mark.parametrize("text", ["evict", "evict:rkv", "3:32", "2:64:3", "4:128:0"])
def test_candidates_parse(text):
    candidate = Candidate.parse(text)
    assert (candidate.bits is None) == text.startswith("evict")


@pytest.mark.parametrize("text", ["3-32", "3", "a:b", "3:32:1:32:1"])
def test_a_malformed_candidate_is_refused_naming_the_flag(text):
    with pytest.raises(ValueError, match="--candidates"):
        Candidate.parse(text)


def test_a_candidate_the_format_cannot_hold_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--candidates 3:24"):
        FrontierSettings(candidates=("3:24",))


@pytest.mark.parametrize("fraction", [0.125, 0.25, 0.5])
@pytest.mark.parametrize("length", [700, 1057, 2049])
@pytest.mark.parametrize(
    "text", ["evict", "2:32", "2:128:3", "3:32", "3:64", "3:128:3", "4:32", "4:128"]
)
def test_a_spend_never_holds_more_than_its_bytes(text, length, fraction):
    candidate = Candidate.parse(text)
    try:
        spent = spend(candidate, fraction=fraction, length=length, shape=SMOLLM2, min_budget=37)
    except ValueError as error:  # too few bytes for the protected tokens and one group
        assert "cannot hold" in str(error)
        return
    assert spent.budget_tokens >= 37
    assert spent.fraction <= fraction + 1e-9
    if candidate.bits is None:
        assert spent.tier_tokens == 0
        return
    g = candidate.group_tokens
    assert spent.tier_tokens % g == 0 and spent.tier_tokens >= g
    # Worth spending: within one group's bytes of the fraction, or every token held.
    ratio = frontier_ratio(candidate)
    cold = length - spent.budget_tokens
    assert (
        spent.tier_tokens >= cold - cold % g
        or spent.fraction > fraction - g * ratio / length - (g / length)
    )


def frontier_ratio(candidate):
    from sglang_evict.quality.real.frontier import tier_ratio

    return tier_ratio(candidate, SMOLLM2)


def test_three_bits_in_groups_of_32_cost_a_quarter_of_bfloat16_on_smollm2():
    # keys 24 + 8 bytes of scales, values 24 + 8, over 2 x 64 x 2 bytes: exactly 1/4
    assert frontier_ratio(Candidate.parse("3:32")) == pytest.approx(0.25)
    assert frontier_ratio(Candidate.parse("2:128")) < frontier_ratio(Candidate.parse("2:32"))
    # outlier tokens cost more, but not in the first two layers
    assert frontier_ratio(Candidate.parse("3:32:3")) > 0.25


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_needle_kind_is_found_in_its_own_sentence_and_not_in_a_near_miss(kind):
    needles = {needle_for(seed, kind) for seed in range(100)}
    assert len(needles) > 20
    for needle in needles:
        assert needle.code in needle.sentence
        assert found(needle, f"The answer: {needle.code}.")
    near = {"code7": "1234568", "code5": "12346", "word": "marigolds", "time": "17:45"}
    assert not found(Needle("Oslo", {"code7": "1234567", "code5": "12345", "word": "marigold",
                                     "time": "7:45"}[kind], kind), near[kind])  # fmt: skip


def test_an_unknown_needle_kind_is_refused():
    with pytest.raises(ValueError, match="needle kind"):
        Needle("Oslo", "x", "colour")


def fake_results(rows: dict[str, tuple[dict[str, list[bool]], float]]) -> dict:
    """A results file: candidate -> ({kind: found list}, perplexity)."""
    needle, ppl = {}, {}
    for candidate, (by_kind, perplexity) in rows.items():
        fraction = None if candidate == "full" else 0.25
        for kind, founds in by_kind.items():
            for i, hit in enumerate(founds):
                needle[f"{kind}-{i}|{candidate}"] = {
                    "sample": f"{kind}-{i}",
                    "candidate": candidate,
                    "fraction": fraction,
                    "kind": kind,
                    "found": hit,
                    "held_fraction": 1.0 if fraction is None else 0.24,
                }
        ppl[candidate] = {
            "candidate": candidate,
            "fraction": fraction,
            "spent_fraction": fraction,
            "perplexity": perplexity,
        }
    return {"needle": needle, "perplexity": ppl, "model": "m", "weights": "w"}


def test_the_rule_picks_the_cheapest_of_the_near_best_eligible():
    yes, no = [True] * 10, [False] * 10
    results = fake_results(
        {
            "full": ({"code7": yes, "word": yes}, 10.0),
            "evict streaming": ({"code7": no, "word": no}, 10.5),
            # eligible, the most accurate
            "tier 4b G32": ({"code7": yes, "word": yes}, 10.0),
            # eligible, within 0.05 of the best: fewer bits wins
            "tier 3b G64": ({"code7": [True] * 9 + [False], "word": yes}, 10.1),
            # within 0.05 and as few bits, a smaller group: loses to G64
            "tier 3b G32": ({"code7": yes, "word": yes}, 10.1),
            # one kind 0.2 below the full cache: not eligible
            "tier 2b G128": ({"code7": yes, "word": [True] * 8 + [False] * 2}, 10.0),
            # perplexity 3 % above: not eligible
            "tier 2b G64": ({"code7": yes, "word": yes}, 10.3),
        }
    )
    rule = frontier_report.apply_rule(results)
    eligible = {v["candidate"] for v in rule["verdicts"] if v["eligible"]}
    assert eligible == {"tier 4b G32", "tier 3b G64", "tier 3b G32"}
    assert rule["met"] and rule["choice"] == "tier 3b G64"


def test_without_an_eligible_candidate_the_rule_says_so(tmp_path):
    results = fake_results(
        {
            "full": ({"code7": [True] * 4}, 10.0),
            "tier 2b G32": ({"code7": [False] * 4}, 12.0),
        }
    )
    rule = frontier_report.apply_rule(results)
    assert not rule["met"] and rule["choice"] == "tier 2b G32"
    (tmp_path / "results.json").write_text(json.dumps(results))
    md, png = frontier_report.render(tmp_path)
    text = md.read_text()
    assert "none eligible" in text and "| tier 2b G32 | 0.25 | 0.240 | 0.00 |" in text
    assert png is None or png.stat().st_size > 1000


def test_a_needle_answer_holds_the_bytes_it_was_given():
    """The tiny model (2 layers, head dim 64) through the paged reference path: after
    the prompt's pass the request holds the spend's bytes (the answer's token beside)."""
    from sglang_evict.models.reference_model import PagedLlama, build_tiny_llama

    model = PagedLlama(build_tiny_llama(seed=3, hidden_size=256, num_heads=4, num_kv_heads=2))
    shape = Shape.of(model)
    prompt = [(5 * i + 1) % 250 for i in range(400)]
    for text in ("evict", "3:32", "2:64"):
        candidate = Candidate.parse(text)
        spent = spend(candidate, fraction=0.25, length=len(prompt) + 1, shape=shape, min_budget=37)
        config = config_for(candidate, spent, window_tokens=32)
        _, held, passes = needle_answer(model, prompt, config, max_new_tokens=4, shape=shape)
        assert passes >= 1
        # + the answer's first token, and the cold tokens short of a whole group
        assert held.full_tokens <= spent.budget_tokens + candidate.group_tokens
        assert held.tier_tokens <= spent.tier_tokens
        assert held.fraction == pytest.approx(spent.fraction, abs=2 / len(prompt))


def test_the_tables_compare_the_same_prompts_only():
    results = fake_results(
        {
            "full": ({"code7": [True, True, False]}, 10.0),
            "tier 3b G32": ({"code7": [True, False]}, 10.0),  # a partial run: 2 of 3
        }
    )
    table = {r["candidate"]: r for r in frontier_report.needle_table(results)}
    assert table["full"]["prompts"] == table["tier 3b G32"]["prompts"] == 2
    assert table["full"]["accuracy"] == 1.0 and table["tier 3b G32"]["accuracy"] == 0.5


# --- the tier's scorer and transformers' quantized cache (the peer) -----------------------


def test_a_tier_candidate_names_the_scorer_that_evicts_beyond_it():
    candidate = Candidate.parse("2:32:3/rkv")
    assert (candidate.bits, candidate.group_tokens, candidate.outlier_tokens) == (2, 32, 3)
    assert candidate.scorer == "rkv" and candidate.name == "tier 2b G32 o3 rkv"
    assert Candidate.parse("3:64").name == "tier 3b G64"  # streaming: the default
    assert frontier_report._bits_group_outliers("tier 2b G32 o3 rkv") == (2, 32, 3)
    assert frontier_report._bits_group_outliers("tier 3b G64 rkv") == (3, 64, 0)
    wide = Candidate.parse("3:64:0:64/rkv")
    assert wide.value_group_channels == 64 and wide.name == "tier 3b G64 V64 rkv"
    assert frontier_ratio(wide) < frontier_ratio(Candidate.parse("3:64"))


@pytest.mark.parametrize("text", ["3:64/nosuch", "evict:nosuch"])
def test_an_unknown_scorer_is_refused_naming_the_flag(text):
    with pytest.raises(ValueError, match=r"--candidates .*nosuch"):
        FrontierSettings(candidates=(text,))
    with pytest.raises(ValueError, match="--candidates"):
        Candidate.parse("3:64/")


def test_the_peer_counts_packed_codes_at_their_size_and_every_float_at_two_bytes():
    import torch

    from sglang_evict.quality.real import qcache_peer

    codes = torch.zeros(4, 8, dtype=torch.uint8)  # 32 bytes
    meta = {"scale": torch.zeros(4, dtype=torch.float32), "zero": torch.zeros(4), "shape": (4,)}
    assert qcache_peer.tensor_bytes((codes, meta)) == 32 + 2 * 4 * 2
    assert qcache_peer.tensor_bytes(torch.zeros(3, 5, dtype=torch.float32)) == 30
    assert qcache_peer.tensor_bytes(None) == 0

    class Layer:  # a residual of 2 tokens beside the quantized part
        _quantized_keys = (codes, meta)
        _quantized_values = (codes, meta)
        keys = torch.zeros(1, 2, 2, 8)
        values = torch.zeros(1, 2, 2, 8)

    cache = types.SimpleNamespace(layers=[Layer(), Layer()])
    assert qcache_peer.held_bytes(cache) == 2 * (2 * 48 + 2 * 32 * 2)


def fake_peer(held: dict[str, float]) -> dict:
    entries = [
        {
            "task": "needle",
            "method": method,
            "rows": [
                {"key": f"code7-{i}", "kind": "code7", "found": i < 2, "held_fraction": f}
                for i in range(4)
            ],
        }
        for method, f in held.items()
    ]
    entries += [
        {"task": "perplexity", "method": m, "perplexity": 10.0 / f, "held_fraction": f}
        for m, f in held.items()
    ]
    return {
        "status": "ok",
        "entries": entries,
        "skipped": [{"task": "needle", "method": "hf-hqq 3b G64", "reason": "RuntimeError: x"}],
        "versions": {"hqq": "0.2.8.post1"},
    }


def test_the_peer_sits_beside_the_frontier_at_the_bytes_it_held(tmp_path):
    from sglang_evict.quality.real import qcache

    peer = fake_peer({"hf-full": 1.0, "hf-quanto 2b G64": 0.1571, "hf-quanto 4b G64": 0.2812})
    assert qcache.fractions(qcache.needle_rows(peer)) == [0.15, 0.28]
    results = fake_results(
        {"full": ({"code7": [True] * 4}, 10.0), "tier 3b G64": ({"code7": [True] * 4}, 10.0)}
    )
    for key, row in list(results["needle"].items()):  # the tier again at the peer's bytes
        if row["candidate"] != "full":
            results["needle"][key + "|peer"] = {**row, "fraction": 0.15, "held_fraction": 0.149}
    results["peers"] = {"quantized_cache": peer}
    needles, ppl, skipped = frontier_report.peer_tables(results)
    assert [(r["candidate"], r["at"]) for r in needles] == [
        ("hf-quanto 2b G64", 0.15),
        ("tier 3b G64", 0.15),
        ("hf-quanto 4b G64", 0.28),
    ]
    assert needles[0]["accuracy"] == 0.5 and needles[1]["accuracy"] == 1.0
    assert [r["candidate"] for r in ppl] == ["hf-quanto 2b G64", "hf-quanto 4b G64"]
    assert ppl[0]["relative"] == pytest.approx(1 / 0.1571)
    assert skipped == ["needle hf-hqq 3b G64: RuntimeError: x"]
    (tmp_path / "results.json").write_text(json.dumps(results))
    md, png = frontier_report.render(tmp_path)
    text = md.read_text()
    assert "| 0.15 | **hf-quanto 2b G64** | 0.157 | 0.50 |" in text
    assert "| 0.15 | tier 3b G64 | 0.149 | 1.00 |" in text
    assert "hf-hqq 3b G64: RuntimeError" in text
    assert png is None or png.stat().st_size > 1000


def test_a_peer_that_did_not_run_says_why_in_the_report(tmp_path):
    results = fake_results({"full": ({"code7": [True]}, 10.0)})
    results["peers"] = {"quantized_cache": {"status": "not run", "reason": "no network"}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    md, _ = frontier_report.render(tmp_path)
    assert "no network" in md.read_text()


def test_the_quantized_cache_peer_on_the_real_model(tmp_path, real_model, real_text):
    """transformers' QuantizedCache in its own environment on one real needle prompt and
    a short perplexity sequence: its full cache answers what the paged reference path's
    full cache answers; quanto's 2 bits in groups of 64 hold what the format says (2 bits
    and a 16-bit scale and shift per 64 values; the last prompt token in the residual).
    Runs where the environment exists (``sglang-evict eval-tier`` creates it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_evict.models.reference_model import PagedLlama
    from sglang_evict.quality import peer_env
    from sglang_evict.quality.real import qcache
    from sglang_evict.quality.real.needle import build_samples

    venv = qcache.QCACHE.default_venv()
    if peer_env.probe(qcache.QCACHE, venv) is None:
        pytest.skip(f"no quantized-cache environment at {venv} (set {qcache.QCACHE.venv_env})")
    tokenizer = AutoTokenizer.from_pretrained(str(real_model))
    text = real_text.read_text(encoding="utf-8")
    samples = build_samples(
        text, tokenizer, context_sizes=(600,), depths=(0.5,), first_index=7, kinds=("word",)
    )
    sequence = tokenizer(text[:4000], add_special_tokens=False)["input_ids"][:80]
    job = qcache.write_job(tmp_path / "job.json", real_model, samples, 8, [sequence], 16)
    spec = json.loads(job.read_text())
    spec["configs"] = [["quanto", 2]]
    job.write_text(json.dumps(spec))
    peer = peer_env.run_peer(
        venv, job, tmp_path / "out.json", module=qcache.PEER_MODULE, progress=False
    )
    assert peer["skipped"] == []
    needles = {r["candidate"]: r for r in qcache.needle_rows(peer)}
    hf = AutoModelForCausalLM.from_pretrained(str(real_model), dtype=torch.float32).eval()
    model = PagedLlama(hf)
    ids, _, _ = needle_answer(
        model, samples[0].prompt_ids, None, max_new_tokens=8, shape=Shape.of(model)
    )
    ours = found(samples[0].needle, tokenizer.decode(ids, skip_special_tokens=True))
    assert needles["hf-full"]["accuracy"] == float(ours)
    length = len(samples[0].prompt_ids)
    expected = ((length - 1) * (2 / 8 + 2 * 2 / 64) / 2 + 1) / length
    assert needles["hf-quanto 2b G64"]["held_fraction"] == pytest.approx(expected, abs=0.002)
    ppl = {r["candidate"]: r for r in qcache.perplexity_rows(peer)}
    assert ppl["hf-full"]["relative"] == 1.0 and ppl["hf-quanto 2b G64"]["perplexity"] > 1.0


def needle_entry(method, budget, rows):
    return {"task": "needle", "method": method, "budget": budget, "rows": rows}


def ppl_entry(method, budget, perplexity):
    return {"task": "perplexity", "method": method, "budget": budget, "perplexity": perplexity}


def test_kvpress_presses_sit_on_the_frontier_at_the_bytes_they_keep(tmp_path):
    results = fake_results({"full": ({"code7": [True] * 4, "word": [True] * 4}, 10.0)})
    for row in results["needle"].values():
        row["prompt_tokens"] = 1000
    rows = [
        {"key": f"{kind}-{i}", "found": kind == "word", "kept_tokens": 250}
        for kind in ("code7", "word")
        for i in range(4)
    ]
    results["settings"] = {"ppl_length": 1024}
    results["peers"] = {
        "kvpress": {
            "status": "ok",
            "entries": [
                needle_entry("kvpress:none", 1.0, rows),
                needle_entry("kvpress:KeyDiffPress", 0.25, rows),
                ppl_entry("kvpress:none", None, 10.0),
                ppl_entry("kvpress:TOVAPress", 256, 11.0),
            ],
        }
    }
    needles, ppl, reason = frontier_report.kvpress_tables(results)
    assert reason is None
    (row,) = needles
    assert row["candidate"] == "kvpress:KeyDiffPress" and row["held_fraction"] == 0.25
    assert row["by_kind"] == {"code7": 0.0, "word": 1.0} and row["accuracy"] == 0.5
    (line,) = ppl
    assert line["held_fraction"] == 0.25 and line["relative"] == pytest.approx(1.1)
    (tmp_path / "results.json").write_text(json.dumps(results))
    md, _ = frontier_report.render(tmp_path)
    text = md.read_text()
    assert "| kvpress:KeyDiffPress | 0.250 | 0.50 | 0.00 | 1.00 | 8 |" in text
    assert "| kvpress:TOVAPress | 0.250 | 11.000 | 1.100 |" in text
