"""``/metrics`` of a server started with ``sglang-evict serve`` on CPU: the plugin's
counters are there and agree with what SGLang's own log counted for the same workload
(passes, tokens evicted, the allocator's pages regained)."""

from __future__ import annotations

import pytest

from sglang_evict.srt.engine_runner import parse_pass_lines
from tests.engine_harness import (
    BUDGET,
    CADENCE,
    SINKS,
    WINDOW,
    ServedEngine,
    greedy,
    prometheus_samples,
)

pytestmark = pytest.mark.engine

NEW_TOKENS = 4 * BUDGET + 8
PAGE_SIZE = 1


@pytest.fixture(scope="module")
def server(engine_model, tmp_path_factory):
    flags = [
        "--kv-budget",
        str(BUDGET),
        "--kv-cadence",
        str(CADENCE),
        "--kv-window",
        str(WINDOW),
        "--kv-sink-tokens",
        str(SINKS),
        "--kv-scorer",
        "streaming",
    ]
    log = tmp_path_factory.mktemp("serve") / "server.log"
    served = ServedEngine(engine_model, log, flags).start()
    yield served
    served.stop()


def test_metrics_route_shows_the_plugins_counters_matching_sglangs_log(server, engine_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(engine_model))
    prompts = [tokenizer(f"Request {i}: tell me a story.")["input_ids"] for i in range(3)]
    outputs = server.post(
        "/generate", {"input_ids": prompts, "sampling_params": greedy(NEW_TOKENS)}
    )
    assert [len(o["output_ids"]) for o in outputs] == [NEW_TOKENS] * 3

    records = parse_pass_lines(server.log_path.read_text(errors="replace"))
    passes = [r for record in records for r in record["requests"]]
    assert len(passes) >= 3 * 3
    regained = sum(r["free_slots_after"] - r["free_slots_before"] for r in records)

    samples = prometheus_samples(server.get("/metrics").text)
    labels = '{scorer="streaming",strategy="hole_fill"}'
    assert samples[f"sglang_evict:passes_total{labels}"] == len(passes)
    assert samples[f"sglang_evict:tokens_evicted_total{labels}"] == sum(
        r["tokens_before"] - r["tokens_after"] for r in passes
    )
    assert samples[f"sglang_evict:pages_freed_total{labels}"] * PAGE_SIZE == regained
    assert samples.get(f"sglang_evict:pass_failures_total{labels}", 0) == 0
