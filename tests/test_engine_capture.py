"""Query capture in SGLang's real engine (CPU, ``torch_native`` attention, overlap
scheduler on): with ``window`` (each mode) and ``rkv`` the engine generates exactly what
the CPU reference loop generates for the same checkpoint, prompts and policy; the query
ring costs what the formula says and SGLang's KV pool is that much smaller; the
attention backend is the one SGLang chose; an evictable prompt is scored at its first
pass by the queries captured at the end of prefill.

Engines are few (each start costs 30-150 s here): one per scorer setting, the mode a
per-server setting (the policy), request slots bounded (``max_running_requests``) so the
ring of each is small. The GPU backends (``triton``, ``flashinfer``) and CUDA-graph
replay need a GPU: ``test_query_capture`` pins on CPU what keeps the copy graph-safe.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.engine_harness import (
    EngineSpec,
    assert_same_tokens,
    greedy,
    policy_fields,
    reference_outputs,
    shared_system_prompts,
)

pytestmark = pytest.mark.engine

MAX_RUNNING_REQUESTS = 8
QUERY_WINDOW = 32  # EvictionConfig.query_window_tokens' default
NEW_TOKENS = 80  # a first pass at 64 tokens, then one every 16: 2-3 passes per request


def capture_policy(scorer: str, compaction: str = "hole_fill", **scorer_params) -> dict:
    return policy_fields(
        scorer=scorer, compaction=compaction, scorer_params=scorer_params, evict_prompt=True
    )


def capture_spec(page_size: int, policy: dict) -> EngineSpec:
    return EngineSpec.plugin(
        page_size, engine_args={"max_running_requests": MAX_RUNNING_REQUESTS}, **policy
    )


WINDOW_LAST = capture_policy("window", mode="last")
# One query slot (--kv-query-slots 1): the prompts, each needing one, take turns.
ONE_SLOT = {
    **capture_policy("window", mode="cumulative", head_normalization="none"),
    "query_slots": 1,
}
# (page size, the server's policy, the scorer the requests choose: None, the server's).
# ``rkv`` is chosen per request on the window engine (a server capturing queries serves
# every query-reading scorer).
CASES = [
    pytest.param(1, WINDOW_LAST, None, id="page1-window-last"),
    pytest.param(1, ONE_SLOT, None, id="page1-window-cumulative-one-slot"),
    pytest.param(1, WINDOW_LAST, "rkv", id="page1-rkv-per-request"),
    pytest.param(
        4, capture_policy("window", compaction="repack"), None, id="page4-window-sum-repack"
    ),
]
PAGE4_SUM = capture_spec(4, capture_policy("window", compaction="repack"))


@pytest.fixture(scope="module")
def prompts(engine_model):
    return shared_system_prompts(engine_model)


def test_query_ring_costs_the_formula_and_the_kv_pool_shrinks_by_it(engines, engine_model, prompts):
    config = json.loads((engine_model / "config.json").read_text())
    layers, q_heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    head_dim = config["hidden_size"] // q_heads
    plain = engines.get(EngineSpec.plain(1)).server_info()
    engine = engines.get(capture_spec(1, WINDOW_LAST))
    info = engine.server_info()
    report = engine.plugin_state()["query_capture"]
    # Slots: what bounded admission lets run of requests over the budget, at most one
    # per request row (SGLang's padding row included).
    slots = min(
        MAX_RUNNING_REQUESTS + 1,
        plain["max_total_num_tokens"] // (WINDOW_LAST["kv_budget_tokens"] + 1),
    )
    assert report["num_slots"] == slots
    # The slots and the scratch slot; an int64 slot for each row and the scratch row.
    ring_bytes = (slots + 1) * QUERY_WINDOW * (layers * q_heads * head_dim * 4 + 8)  # float32
    ring_bytes += (MAX_RUNNING_REQUESTS + 2) * 8
    kv_bytes_per_token = kv_heads * 2 * head_dim * layers * 4
    assert report["ring_bytes"] == report["allocated_bytes"] == ring_bytes
    assert report["kv_bytes_per_token"] == kv_bytes_per_token
    reserved = math.ceil(ring_bytes / kv_bytes_per_token)  # page size 1
    # SGLang's own pool size, with and without capture, at the same --max-total-tokens.
    assert plain["max_total_num_tokens"] - info["max_total_num_tokens"] == reserved
    assert report["pool_tokens_after"] == info["max_total_num_tokens"]
    engines.report(
        "capture",
        "ring bytes; KV pool tokens plain -> capture",
        f"{ring_bytes}; {plain['max_total_num_tokens']} -> {info['max_total_num_tokens']}",
    )
    assert f"KV pool {plain['max_total_num_tokens']} -> {info['max_total_num_tokens']}" in (
        engine.log_text()
    )


def test_attention_backend_is_the_one_sglang_chose_and_captures_run_inside_it(engines, prompts):
    plain = engines.get(EngineSpec.plain(1)).server_info()
    engine = engines.get(capture_spec(1, WINDOW_LAST))
    mark = engine.mark()
    engine.generate(prompts[:1], greedy(8))
    info = engine.server_info()
    assert info["attention_backend"] == plain["attention_backend"] == "torch_native"
    report = engine.plugin_state()["query_capture"]
    assert report["attention_backend"] == "TorchNativeAttnBackend"
    assert "attention_backend=torch_native (TorchNativeAttnBackend" in engine.log_text()
    # The hook ran in the backend's forward, per layer, for the prefill and each step.
    calls = report["hook_calls"]
    assert calls["extend"] >= 2 and calls["decode"] >= 2 * 7
    assert engine.log_since(mark).count("Decode batch") >= 6


@pytest.mark.parametrize(("page_size", "policy", "request_scorer"), CASES)
def test_engine_outputs_equal_the_cpu_reference_loop_with_query_scorers(
    engines, reference_model, prompts, page_size, policy, request_scorer
):
    engine = engines.get(capture_spec(page_size, policy))
    assert engine.flush_cache()  # nothing cached from earlier tests: the same prefills
    custom = None if request_scorer is None else {"sglang_evict": {"scorer": request_scorer}}
    waits = engine.plugin_state()["query_slot_waits"]
    mark = engine.mark()
    extra = {} if custom is None else {"custom_params": custom}
    outputs = engine.generate(prompts, greedy(NEW_TOKENS, **extra))
    expected, result = reference_outputs(
        reference_model,
        prompts,
        NEW_TOKENS,
        page_size=page_size,
        policy=policy,
        custom_params=None if custom is None else [custom] * len(prompts),
    )
    assert len(result.passes) >= 2 * len(prompts)
    assert_same_tokens([out["output_ids"] for out in outputs], expected)
    passes = [r for record in engine.pass_records(mark) for r in record["requests"]]
    assert len(passes) == len(result.passes)
    # Every request a pass read held a slot, and gave it back.
    state = engine.plugin_state()
    ring = state["query_capture"]
    assert ring["slot_misses"] == 0 and ring["free_slots"] == ring["num_slots"]
    if policy.get("query_slots") == 1:  # the prompts took turns for the one slot
        assert state["query_slot_waits"] > waits
    engines.report(
        f"capture page {page_size} {policy['scorer']}/{request_scorer or policy['scorer']}",
        "passes (engine = reference), tokens evicted",
        f"{len(passes)}, {sum(r['tokens_before'] - r['tokens_after'] for r in passes)}",
    )


@pytest.mark.release_smoke  # prefill capture and prompt eviction, on every release
def test_an_evictable_prompt_is_scored_at_its_first_pass_by_its_prefill_queries(
    engines, reference_model, tokenizer
):
    """A 90-token prompt over budget + cadence, ``evict_prompt`` on: the engine's first
    pass comes at the second decode step (the window then holds the last prompt queries
    captured at prefill, and the first generated token's) and evicts prompt tokens; the
    outputs equal the reference loop's, which scores the same window."""
    from sglang_evict.models.engine_model import _CORPUS

    prompt = tokenizer(_CORPUS)["input_ids"][:90]
    new_tokens = 40
    engine = engines.get(PAGE4_SUM)
    assert engine.flush_cache()
    mark = engine.mark()
    (out,) = engine.generate([prompt], greedy(new_tokens))
    policy = capture_policy("window", compaction="repack")
    expected, result = reference_outputs(
        reference_model, [prompt], new_tokens, page_size=4, policy=policy
    )
    assert out["output_ids"] == expected[0]
    first = engine.pass_records(mark)[0]["requests"][0]
    assert first["tokens_before"] == len(prompt) + 1 == result.passes[0][2].tokens_before
    assert first["tokens_after"] == policy["kv_budget_tokens"]
    assert result.passes[0][1] == 1  # the reference's second decode step too


# The GPU test's pool: the pass graphs' memory pool is reserved from the KV pool
# (``sglang_evict.srt.graph_pool``), so the pool holds it (at 512 bytes a token: the
# head-dim-64 model's 2 layers x 1 KV head x 64 x K and V in bf16) beside the usual 4096.
GPU_PASS_GRAPH_POOL_MIB = 16
GPU_POOL_TOKENS = 4096 + GPU_PASS_GRAPH_POOL_MIB * 2**20 // 512


GPU_BACKENDS = {"triton": "TritonAttnBackend", "flashinfer": "FlashInferAttnBackend"}


def gpu_capture_spec(backend: str, graphs: bool) -> EngineSpec:
    """The GPU test's engine (``tests/test_gpu_preflight.py`` checks on CPU that it
    would start)."""
    from sglang_evict.models.engine_model import ensure_engine_model

    gpu = {
        # head dim 64: FlashInfer's prefill has no kernel for the base model's 16
        "model_path": str(ensure_engine_model(variant="head_dim64")),
        "device": "cuda",
        "attention_backend": backend,
        "model_impl": "auto",
        "dtype": "bfloat16",
        "disable_prefill_cuda_graph": True,  # decode's graphs are the subject (and start fast)
        "disable_cuda_graph": not graphs,
        "max_running_requests": MAX_RUNNING_REQUESTS,
    }
    return EngineSpec.plugin(
        1,
        max_total_tokens=GPU_POOL_TOKENS,
        engine_args=gpu,
        **capture_policy("rkv"),
        pass_graph_pool_mib=GPU_PASS_GRAPH_POOL_MIB,
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU backends)")
@pytest.mark.parametrize("backend", list(GPU_BACKENDS))
def test_gpu_backend_captures_queries_inside_cuda_graph_replays(engines, prompts, backend):
    """On a GPU backend, decode runs as CUDA-graph replays, where no Python hook runs:
    the ring still gets each step's queries (the copy is in the graph), so ``rkv``
    generates the same tokens with graphs as without, and the backend is SGLang's."""
    outputs = {}
    for graphs in (True, False):
        engine = engines.get(gpu_capture_spec(backend, graphs))
        mark = engine.mark()
        (out,) = engine.generate(prompts[:1], greedy(NEW_TOKENS))  # batch of one: no padding
        assert engine.pass_records(mark), "no pass ran"
        capture = engine.plugin_state()["query_capture"]
        assert capture["attention_backend"] == GPU_BACKENDS[backend]
        outputs[graphs] = out["output_ids"]
    assert outputs[True] == outputs[False]
