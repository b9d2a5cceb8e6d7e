"""MLA (DeepSeek V2's latent KV, ``MLATokenToKVPool``) in SGLang's real engine on CPU,
page 16, overlap scheduler and radix cache on, with eviction, held to the
architecture-generic reference (transformers' DeepSeek-V2 on the full cache, each decode
step attending only to what the engine kept: ``sglang_evict.models.masked_reference``).

How SGLang's DeepSeek model runs here (each a path SGLang has, nothing of SGLang
edited): its native model (``model_impl="auto"``; the transformers backend refuses MLA's
``mla_kv_a_proj`` TP style), the ``triton`` attention backend under Triton's interpreter
(``torch_native`` has no MLA path: SGLang's DeepSeek runs its prefill as MHA over the
new tokens' K/V, which ``torch_native`` reads from the latent cache instead), YaRN RoPE
(SGLang's CPU rotary factory takes DeepSeek's YaRN only), and one test-only stand-in:
``tests/stand_ins/vllm`` satisfies an import SGLang makes on CPU and never calls
(tests/stand_ins/README.md).

Per request: identity (float32, greedy), KV within its bound, the allocator gaining
exactly the pages the passes freed (whole pages of latent rows), radix hits in whole
pages, and the idle check clean after an abort and after retraction."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sglang_evict.config import EvictionConfig
from sglang_evict.models.families import ensure_family_model
from sglang_evict.models.masked_reference import MaskedReference, traces_from_pass_records
from sglang_evict.request_policy import bounded_kv_tokens, default_policy, report_of
from tests.engine_harness import (
    EngineSpec,
    assert_abort_and_retraction_leave_it_clean,
    assert_clean_after,
    assert_radix_hits_in_whole_pages,
    assert_same_tokens,
    greedy,
    policy_fields,
    shared_system_prompts,
)

pytestmark = pytest.mark.engine

PAGE = 16
POOL_TOKENS = 512
NEW_TOKENS = 96
STAND_INS = Path(__file__).parent / "stand_ins"
POLICY = dict(scorer="knorm", window_tokens=32)


def mla_env() -> dict:
    path = os.pathsep.join(p for p in (str(STAND_INS), os.environ.get("PYTHONPATH")) if p)
    return {"SGLANG_EVICT_LOG_KEPT": "1", "TRITON_INTERPRET": "1", "PYTHONPATH": path}


@pytest.fixture(scope="module")
def mla_model():
    return ensure_family_model("deepseek_v2")


@pytest.fixture(scope="module")
def mla_engine(engines, mla_model):
    spec = EngineSpec.plugin(
        PAGE,
        max_total_tokens=POOL_TOKENS,
        engine_args={
            "model_path": str(mla_model),
            "model_impl": "auto",
            "attention_backend": "triton",
            "disable_cuda_graph": True,  # SGLang turns graphs off for torch_native only
            "schedule_conservativeness": 0.01,
        },
        env={**mla_env(), "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "16"},
        **policy_fields(**POLICY),
    )
    return engines.get(spec)


@pytest.fixture(scope="module")
def mla_prompts(mla_model):
    return shared_system_prompts(mla_model)[:3]


def test_mla_eviction_generates_what_the_masked_full_cache_generates(
    engines, mla_engine, mla_model, mla_prompts
):
    mark = mla_engine.mark()
    outputs = mla_engine.generate(mla_prompts, greedy(NEW_TOKENS))
    records = mla_engine.pass_records(mark)
    traces = traces_from_pass_records(records)
    reference = MaskedReference.from_folder(mla_model)
    expected = []
    for prompt, output in zip(mla_prompts, outputs, strict=True):
        trace = traces.get(output["meta_info"]["id"])
        assert trace is not None and len(trace.states) >= 3, "fewer than 3 passes"
        expected.append(reference.generate(prompt, NEW_TOKENS, trace))
    assert_same_tokens([o["output_ids"] for o in outputs], expected)
    config = EvictionConfig(**policy_fields(**POLICY), page_size=PAGE)
    policy = default_policy(config)
    bounds = [
        bounded_kv_tokens(policy, config, prompt_len=len(p), max_new_tokens=NEW_TOKENS)
        for p in mla_prompts
    ]
    peaks = [report_of(o["meta_info"])["peak_kv_tokens"] for o in outputs]
    assert all(peak <= bound for peak, bound in zip(peaks, bounds, strict=True)), (peaks, bounds)
    assert all(b < len(p) + NEW_TOKENS for b, p in zip(bounds, mla_prompts, strict=True))
    for record in records:  # SGLang's allocator free count, before and after each pass
        pages = sum(r["pages_freed"] for r in record["requests"])
        assert record["free_slots_after"] - record["free_slots_before"] == pages * PAGE
    freed = sum(r["pages_freed"] for rec in records for r in rec["requests"])
    assert freed > 0
    engines.report(
        "MLA (DeepSeek-V2, tiny random)",
        "passes, pages freed, peak KV per request (bound)",
        f"{sum(len(r['requests']) for r in records)}, {freed}, {max(peaks)} ({max(bounds)})",
    )
    assert_clean_after(mla_engine, mark)


def test_mla_radix_hits_are_the_shared_prefix_in_whole_pages(mla_engine, mla_prompts):
    assert_radix_hits_in_whole_pages(mla_engine, mla_prompts, PAGE, NEW_TOKENS)


def test_mla_abort_and_retraction_leave_the_idle_check_clean(mla_engine, tokenizer):
    # Nine requests in a pool of 512 tokens: SGLang retracts (eight of 112 tokens did not).
    assert_abort_and_retraction_leave_it_clean(
        mla_engine, tokenizer, after_chunks=60, requests=9, new_tokens=160
    )
