"""``/metrics`` of a server started with ``sglang-evict serve`` on CPU: the plugin's
counters are there and agree with what SGLang's own log counted for the same workload
(passes, tokens evicted, the allocator's pages regained). The server is the session's
shared one (``POLICY_SERVER``), so counts are read as differences over this test."""

from __future__ import annotations

import pytest

from tests.engine_harness import BUDGET, POLICY_SERVER, greedy, prometheus_samples

# Every test here runs on each supported SGLang release (a surface that differs).
pytestmark = [pytest.mark.engine, pytest.mark.release_smoke]

NEW_TOKENS = 4 * BUDGET + 8
PAGE_SIZE = 1
COUNTERS = ("passes_total", "tokens_evicted_total", "pages_freed_total", "pass_failures_total")


def counters(server) -> dict[str, float]:
    """Each plugin counter summed over its labels (requests may choose their scorer)."""
    samples = prometheus_samples(server.get("/metrics").text)
    return {
        name: sum(v for key, v in samples.items() if key.startswith(f"sglang_evict:{name}{{"))
        for name in COUNTERS
    }


def test_metrics_route_shows_the_plugins_counters_matching_sglangs_log(engines, engine_model):
    from transformers import AutoTokenizer

    server = engines.served(POLICY_SERVER)
    tokenizer = AutoTokenizer.from_pretrained(str(engine_model))
    prompts = [tokenizer(f"Request {i}: tell me a story.")["input_ids"] for i in range(3)]
    mark, before = server.log_size(), counters(server)
    outputs = server.post(
        "/generate", {"input_ids": prompts, "sampling_params": greedy(NEW_TOKENS)}
    )
    assert [len(o["output_ids"]) for o in outputs] == [NEW_TOKENS] * 3

    records = server.pass_records(mark)
    passes = [r for record in records for r in record["requests"]]
    assert len(passes) >= 3 * 3
    regained = sum(r["free_slots_after"] - r["free_slots_before"] for r in records)

    after = counters(server)
    grew = {name: after[name] - before[name] for name in COUNTERS}
    assert grew["passes_total"] == len(passes)
    assert grew["tokens_evicted_total"] == sum(
        r["tokens_before"] - r["tokens_after"] for r in passes
    )
    assert grew["pages_freed_total"] * PAGE_SIZE == regained
    assert grew["pass_failures_total"] == 0
    samples = prometheus_samples(server.get("/metrics").text)
    assert 'sglang_evict:passes_total{scorer="streaming",strategy="hole_fill"}' in samples
