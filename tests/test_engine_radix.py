"""The radix cache stays on and correct in SGLang's real engine: requests sharing a system
prompt hit the cache exactly as often with eviction as without (SGLang's
``meta_info["cached_tokens"]``), and a prompt that repeats an evicted request's prompt
and output never matches its compacted KV: it generates what a fresh engine does."""

from __future__ import annotations

import pytest

from tests.engine_harness import (
    BUDGET,
    WINDOW,
    EngineSpec,
    greedy,
    policy_fields,
    reference_outputs,
)

# Every test here runs on each supported SGLang release (a surface that differs).
pytestmark = [pytest.mark.engine, pytest.mark.release_smoke]

NEW_TOKENS = 3 * BUDGET


@pytest.fixture(scope="module")
def prompts(engine_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(engine_model))
    system = "You are a helpful assistant. Answer the question step by step and explain."
    questions = ("What is the capital of France?", "Tell me a story.", "How many pages?")
    return [tokenizer(f"{system} {q}")["input_ids"] for q in questions]


def cached_tokens_of_a_shared_system_prompt(engine, prompts) -> list[int]:
    assert engine.flush_cache()
    first = engine.generate(prompts[0], greedy(NEW_TOKENS))
    rest = engine.generate(prompts[1:], greedy(NEW_TOKENS))
    return [out["meta_info"]["cached_tokens"] for out in [first, *rest]]


def test_cached_tokens_are_the_same_with_eviction_on_and_off(engines, prompts):
    plugin_engine, plain_engine = (
        engines.get(EngineSpec.plugin(1)),
        engines.get(EngineSpec.plain(1)),
    )
    with_plugin = cached_tokens_of_a_shared_system_prompt(plugin_engine, prompts)
    plain = cached_tokens_of_a_shared_system_prompt(plain_engine, prompts)
    assert with_plugin == plain
    engines.report("radix", "cached_tokens with eviction / plain", f"{with_plugin} / {plain}")
    assert plain[0] == 0 and min(plain[1:]) >= 10  # the system prompt was matched


def test_a_prompt_repeating_an_evicted_request_never_matches_compacted_kv(
    engines, reference_model, prompts
):
    engine = engines.get(EngineSpec.plugin(1))
    assert engine.flush_cache()
    mark = engine.mark()
    first = engine.generate(prompts[0], greedy(NEW_TOKENS))
    assert engine.pass_records(mark), "the first request was never evicted"
    follow_up = prompts[0] + first["output_ids"]

    # Where the first request's cache stopped being an uncompacted cache of its tokens.
    _, result = reference_outputs(
        reference_model, [prompts[0]], NEW_TOKENS, page_size=1, policy=policy_fields()
    )
    kept_at_end = set(result.attended["r0"][-1].tolist())
    first_evicted = min(set(range(len(follow_up))) - kept_at_end)

    # Fewer new tokens than the recent window: nothing of the follow-up itself is evicted
    # (its long prompt is protected), so only the prefix it matched can make it differ.
    new_tokens = WINDOW - 2
    second = engine.mark()
    repeated = engine.generate(follow_up, greedy(new_tokens))
    assert all(
        r["tokens_before"] == r["tokens_after"]
        for record in engine.pass_records(second)
        for r in record["requests"]
    )
    cached = repeated["meta_info"]["cached_tokens"]
    assert len(prompts[0]) <= cached <= first_evicted
    engines.report(
        "radix",
        "repeat of an evicted request: cached (prompt, first evicted)",
        f"{cached} ({len(prompts[0])}, {first_evicted})",
    )

    fresh = engines.get(EngineSpec.plain(1))
    assert fresh.flush_cache()
    expected = fresh.generate(follow_up, greedy(new_tokens))
    assert expected["meta_info"]["cached_tokens"] == 0
    assert repeated["output_ids"] == expected["output_ids"]
