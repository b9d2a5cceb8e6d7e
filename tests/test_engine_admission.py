"""Budget-aware admission in SGLang's real engine: a pool that holds fewer than four
requests by SGLang's own reservation (prompt + ``max_new_tokens`` + a page) runs as
many as their bounded KV allows, without a retraction, and every request produces
exactly what it produces run alone."""

from __future__ import annotations

import pytest

from tests.engine_harness import BUDGET, CADENCE, EngineSpec, assert_clean_after, greedy

# Every test here runs on each supported SGLang release (a surface that differs).
pytestmark = [pytest.mark.engine, pytest.mark.release_smoke]

POOL_TOKENS = 512
NEW_TOKENS = 128
REQUESTS = 10


def test_bounded_admission_runs_requests_by_their_bounded_kv(engines, tokenizer):
    engine = engines.get(EngineSpec.plugin(1, max_total_tokens=POOL_TOKENS))
    prompts = [
        tokenizer(f"Request {i}: a story about {i * 37 % 100}.")["input_ids"]
        for i in range(REQUESTS)
    ]
    prompt_len = max(len(p) for p in prompts)
    sampling = greedy(NEW_TOKENS, ignore_eos=True)
    mark = engine.mark()
    outputs = engine.generate(prompts, sampling)
    assert [len(o["output_ids"]) for o in outputs] == [NEW_TOKENS] * REQUESTS
    assert sum(o["meta_info"]["num_retractions"] for o in outputs) == 0
    steps = engine.decode_steps(mark)
    steady = [s.running_requests for s in steps if s.queued_requests > 0]
    assert steady, "the pool never held requests back: no steady state to measure"
    mean_running = sum(steady) / len(steady)
    bounded = POOL_TOKENS / (prompt_len + BUDGET + CADENCE + 1)
    by_sglang = POOL_TOKENS / (prompt_len + NEW_TOKENS + 1)
    assert mean_running >= 0.9 * bounded > 1.5 * by_sglang
    engines.report("admission", "mean running requests while some waited", round(mean_running, 1))
    engines.report("admission", "pool / (prompt + budget + cadence + page)", round(bounded, 1))
    engines.report("admission", "pool / (prompt + max_new_tokens + page)", round(by_sglang, 1))
    engines.report("admission", "peak running", max(s.running_requests for s in steps))
    assert_clean_after(engine, mark)
    for prompt, output in zip(prompts, outputs, strict=True):
        alone = engine.generate(prompt, sampling)
        assert alone["output_ids"] == output["output_ids"]
