"""Every way a request ends, in SGLang's real engine with eviction: abort mid-generation,
EOS, max tokens, a stop string, and retraction under memory pressure. Afterwards
SGLang's own idle memory check passes (it raises on a leaked page or request slot, in
its default strict mode, before the plugin's idle check runs; ``idle_checks`` counts the
idle passes that got that far) and the plugin holds no per-request state."""

from __future__ import annotations

import pytest

from tests.engine_harness import (
    BUDGET,
    CADENCE,
    EngineSpec,
    assert_clean_after,
    greedy,
    policy_fields,
    reference_outputs,
)

# Every test here runs on each supported SGLang release (a surface that differs).
pytestmark = [pytest.mark.engine, pytest.mark.release_smoke]

LONG = 4 * BUDGET


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer("You are a helpful assistant. Tell me a story about a cache.")["input_ids"]


def test_abort_mid_generation_releases_everything(engines, prompt):
    engine = engines.get(EngineSpec.plugin(1))
    mark = engine.mark()
    out = engine.generate_then_abort(prompt, greedy(10 * BUDGET), after_chunks=LONG)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < 10 * BUDGET
    assert engine.pass_records(mark), "aborted before any pass"
    assert_clean_after(engine, mark)


def test_finish_by_max_tokens_releases_everything(engines, prompt):
    engine = engines.get(EngineSpec.plugin(1))
    mark = engine.mark()
    out = engine.generate(prompt, greedy(LONG))
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}
    assert engine.pass_records(mark)
    assert_clean_after(engine, mark)


def test_finish_by_eos_releases_everything(engines, reference_model, tokenizer):
    """A prompt whose greedy output reaches EOS only after passes (found with the CPU
    reference loop, which the identity tests tie to the engine)."""
    eos = tokenizer.eos_token_id
    candidates = [tokenizer(f"Question {i}: tell me a long story.")["input_ids"] for i in range(40)]
    after_passes = BUDGET + 2 * CADENCE
    chosen = None
    for candidate in candidates:
        outputs, _ = reference_outputs(
            reference_model, [candidate], LONG, page_size=1, policy=policy_fields()
        )
        if eos in outputs[0][after_passes:] and eos not in outputs[0][:after_passes]:
            chosen, at = candidate, outputs[0].index(eos)
            break
    assert chosen is not None, "no candidate prompt reaches EOS after a pass"
    engine = engines.get(EngineSpec.plugin(1))
    mark = engine.mark()
    out = engine.generate(chosen, {"max_new_tokens": LONG, "temperature": 0})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert len(out["output_ids"]) == at + 1
    assert engine.pass_records(mark)
    assert_clean_after(engine, mark)


def test_finish_by_stop_string_releases_everything(engines, prompt, tokenizer):
    engine = engines.get(EngineSpec.plugin(1))
    full = engine.generate(prompt, greedy(LONG))
    text = tokenizer.decode(full["output_ids"])
    # A stop string that first appears after the first passes.
    start = len(tokenizer.decode(full["output_ids"][: BUDGET + 2 * CADENCE]))
    stop = next(
        text[i : i + 6]
        for i in range(start, len(text) - 6)
        if text[i : i + 6].strip() and text.find(text[i : i + 6]) == i
    )
    mark = engine.mark()
    out = engine.generate(prompt, greedy(LONG, stop=[stop]))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert len(out["output_ids"]) < LONG
    assert engine.pass_records(mark)
    assert_clean_after(engine, mark)


def test_retraction_under_memory_pressure_releases_everything(engines, tokenizer):
    """A pool too small for the batch, and SGLang told to admit greedily (it estimates
    a new request's growth as at most ``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION`` tokens,
    and a running one's as ``max_new_tokens x new_token_ratio`` scaled by
    ``schedule_conservativeness``, unless it ignores EOS: EOS is kept off by
    ``min_new_tokens`` instead). Seven requests fill the 640-token pool at about 91
    tokens each, below their budget of 100: no pass can free anything, so SGLang
    retracts (its own ``num_retractions``). The six left outgrow the pool past their
    budget, well before their cadence trigger (164): pressure passes compact them
    instead of further retractions. The retracted request is re-prefilled later and
    every request completes."""
    spec = EngineSpec.plugin(
        1,
        max_total_tokens=640,
        kv_budget_tokens=100,
        cadence_tokens=64,
        engine_args={"schedule_conservativeness": 0.01},
        env={"SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "16"},
    )
    engine = engines.get(spec)
    prompts = [tokenizer(f"Request {i}: tell me a story.")["input_ids"] for i in range(7)]
    new_tokens = 300
    mark = engine.mark()
    sampling = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "temperature": 0}
    outputs = engine.generate(prompts, sampling)
    finished = [(o["meta_info"]["finish_reason"], len(o["output_ids"])) for o in outputs]
    assert all(length == new_tokens for _, length in finished), finished
    retractions = sum(o["meta_info"]["num_retractions"] for o in outputs)
    assert retractions >= 1
    engines.report("lifecycle retraction", "SGLang's num_retractions", retractions)
    records = engine.pass_records(mark)
    pressure = [r for r in records if r.get("pressure")]
    assert pressure, "no pressure pass ran"
    for record in pressure:  # every pressure pass freed slots and kept the budget
        assert record["free_slots_after"] > record["free_slots_before"]
        assert all(r["tokens_after"] >= 100 for r in record["requests"])
    engines.report(
        "lifecycle retraction", "pressure passes", sum(len(r["requests"]) for r in pressure)
    )
    assert_clean_after(engine, mark)
