"""Memory returned, read off SGLang's own accounting in its real engine: the KV tokens
held per running request stay within budget + cadence + one page while requests
generate many times the budget (without the plugin they grow with the output), and
SGLang's allocator gains exactly the pages the plugin says each pass freed."""

from __future__ import annotations

import itertools

import pytest

from tests.engine_harness import BUDGET, CADENCE, EngineSpec, greedy

# Every test here runs on each supported SGLang release (a surface that differs).
pytestmark = [pytest.mark.engine, pytest.mark.release_smoke]

NEW_TOKENS = 4 * BUDGET + 8


@pytest.fixture(scope="module")
def prompts(engine_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(engine_model))
    system = "You are a helpful assistant. Answer the question step by step."
    return [
        tokenizer(f"{system} {q}")["input_ids"]
        for q in ("Question: what is 1 2 3?", "Tell me a story.", "Explain the cache.")
    ]


def busy_steps(steps, num_requests):
    """Decode steps with every request running (the last lines, logged after the batch
    released its KV, read 0)."""
    return [s for s in steps if s.running_requests == num_requests and s.tokens_held]


@pytest.mark.parametrize(
    ("page_size", "scorer"), [(1, "streaming"), (4, "knorm")], ids=["page1", "page4"]
)
def test_kv_held_per_request_stays_within_budget_cadence_and_a_page(
    engines, prompts, page_size, scorer
):
    engine = engines.get(EngineSpec.plugin(page_size, scorer=scorer))
    mark = engine.mark()
    outputs = engine.generate(prompts, greedy(NEW_TOKENS))
    assert all(len(o["output_ids"]) == NEW_TOKENS for o in outputs)

    steps = busy_steps(engine.decode_steps(mark), len(prompts))
    assert len(steps) >= NEW_TOKENS - 2
    bound = BUDGET + CADENCE + page_size
    per_request = [s.tokens_held / s.running_requests for s in steps]
    assert max(per_request) <= bound, f"peak {max(per_request):.1f} tokens per request > {bound}"
    label = f"memory page {page_size} {scorer}"
    peak = f"{max(per_request):.0f} ({bound})"
    engines.report(label, "peak KV tokens per running request (bound)", peak)
    # Saw-tooth: SGLang's count drops at passes, so it is not monotone.
    assert sum(b < a for a, b in itertools.pairwise(per_request)) >= 3

    records = engine.pass_records(mark)
    assert len(records) >= 3
    for record in records:  # SGLang's allocator free count, read before and after a pass
        pages = sum(r["pages_freed"] for r in record["requests"])
        gained = record["free_slots_after"] - record["free_slots_before"]
        assert gained == pages * page_size, record
    freed = sum(r["pages_freed"] for record in records for r in record["requests"])
    engines.report(label, "steps with passes, pages freed", f"{len(records)}, {freed}")
    for record in records:  # pages before - pages after, exactly (compaction's promise)
        for r in record["requests"]:
            pages_before, pages_after = (
                -(-r[k] // page_size) for k in ("tokens_before", "tokens_after")
            )
            assert r["pages_freed"] == pages_before - pages_after, r


def test_without_the_plugin_kv_held_grows_with_the_output(engines, prompts):
    engine = engines.get(EngineSpec.plain(1))
    mark = engine.mark()
    engine.generate(prompts, greedy(NEW_TOKENS))
    steps = busy_steps(engine.decode_steps(mark), len(prompts))
    per_request = [s.tokens_held / s.running_requests for s in steps]
    assert per_request == sorted(per_request)  # never drops
    peak = f"{per_request[-1]:.0f}"
    engines.report("memory plain SGLang", "peak KV tokens per running request", peak)
    # Each request's own output alone (its prompt's shared part is counted once).
    assert per_request[-1] >= NEW_TOKENS - 2 > BUDGET + CADENCE + 1
