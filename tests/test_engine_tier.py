"""The quantized tier in SGLang's real engine (CPU, ``torch_native``, overlap scheduler
on): what a pass does not keep enters the request's tier, and every decode layer's
attention merges the tier's with the full-precision pages' (``sglang_evict.srt.tier``).

The engine generates exactly what the project's CPU reference loop generates for the
same checkpoint, prompts and policy: the loop runs the same passes and the same
quantizer over SGLang's memory classes, and its model merges the tier's attention by
the torch reference (``reference_model.PagedLlama``). The arena is carved from the KV
pool SGLang sizes, and every request gives its tier back when it ends."""

from __future__ import annotations

import pytest

from sglang_evict.request_policy import report_of
from tests.engine_harness import (
    ENGINE_TIER,
    EngineSpec,
    assert_clean_after,
    assert_same_tokens,
    greedy,
    load_reference_model,
    policy_fields,
    reference_outputs,
    shared_system_prompts,
)

pytestmark = pytest.mark.engine

TIER = ENGINE_TIER
NEW_TOKENS_BY_PAGE = {1: 140, 4: 100}


@pytest.fixture(scope="module")
def prompts(engine_model):
    return shared_system_prompts(engine_model)


@pytest.fixture(scope="module")
def tier_model():
    """The engine tests' model with head dim 64 (the tier's kernels hold 64 and 128;
    the base model's is 16), same tokenizer."""
    from sglang_evict.models.engine_model import ensure_engine_model

    return ensure_engine_model(variant="head_dim64")


@pytest.fixture(scope="module")
def tier_reference(tier_model):
    return load_reference_model(tier_model)


@pytest.mark.parametrize(
    ("page_size", "bits"),
    [
        # On SGLang 0.5.23 the tier's torch_native merge is proven by
        # tests/test_engine_tensor_parallel.py, and the triton one by
        # tests/test_engine_tier_triton.py (both release_smoke).
        pytest.param(1, 8, id="page1-8bit"),
        pytest.param(4, 3, id="page4-3bit"),
    ],
)
def test_engine_outputs_equal_the_reference_loop_with_the_tier(
    engines, tier_model, tier_reference, prompts, page_size, bits
):
    policy = policy_fields(tier_bits=bits, **TIER)
    engine = engines.get(
        EngineSpec.plugin(page_size, engine_args={"model_path": str(tier_model)}, **policy)
    )
    new_tokens = NEW_TOKENS_BY_PAGE[page_size]
    before = engine.plugin_state()["tier"]["hook_calls"]["decode_merged"]
    mark = engine.mark()
    outputs = engine.generate(prompts, greedy(new_tokens))
    engine_ids = [out["output_ids"] for out in outputs]
    expected, result = reference_outputs(
        tier_reference, prompts, new_tokens, page_size=page_size, policy=policy
    )
    demoted = sum(r.tokens_demoted for _, _, r in result.passes)
    assert demoted >= len(prompts) * TIER["tier_max_tokens"]  # every tier filled
    assert_same_tokens(engine_ids, expected)
    passes = [r for record in engine.pass_records(mark) for r in record["requests"]]
    assert len(passes) == len(result.passes)
    tier = engine.plugin_state()["tier"]
    assert tier["hook_calls"]["decode_merged"] > before  # the merge ran in the engine
    assert tier["cpu_kernel"] == "compiled"  # ... with the compiled CPU kernel
    assert tier["merged_by"] == "tier_decode_merge_cpu"  # one compiled call per layer
    assert tier["pool_tokens_after"] < tier["pool_tokens_before"]  # carved from the pool
    assert_clean_after(engine, mark)
    assert engine.plugin_state()["tier"]["groups_held"] == 0
    engines.report(
        f"tier page {page_size} {bits} bits",
        "passes (engine = reference), tokens demoted, KV pool before -> after the arena",
        f"{len(passes)}, {demoted}, {tier['pool_tokens_before']} -> {tier['pool_tokens_after']}",
    )


def test_each_request_brings_its_own_tier_and_equals_the_reference_loop(
    engines, tier_model, tier_reference, prompts
):
    """``custom_params``: the first request runs no tier (eviction alone), the others
    a tier of 32 tokens (the server's 64); the engine equals the reference loop given
    the same per-request policies, and the tier-less request's passes demote nothing."""
    policy = policy_fields(tier_bits=8, **TIER)
    engine = engines.get(
        EngineSpec.plugin(1, engine_args={"model_path": str(tier_model)}, **policy)
    )
    custom = [{"sglang_evict": {"tier_tokens": 0 if i == 0 else 32}} for i in range(len(prompts))]
    new_tokens = 120
    mark = engine.mark()
    outputs = engine.generate(prompts, [greedy(new_tokens, custom_params=c) for c in custom])
    expected, result = reference_outputs(
        tier_reference, prompts, new_tokens, page_size=1, policy=policy, custom_params=custom
    )
    assert [o["output_ids"] for o in outputs] == expected
    demoted = {}
    for rid, _, r in result.passes:
        demoted[rid] = demoted.get(rid, 0) + r.tokens_demoted
    assert demoted.get("r0", 0) == 0 and all(demoted[f"r{i}"] > 0 for i in range(1, len(prompts)))
    reports = [report_of(o["meta_info"]) for o in outputs]
    assert reports[0]["tier_tokens_held"] == 0
    assert all(0 < r["tier_tokens_held"] <= 32 for r in reports[1:])
    assert_clean_after(engine, mark)


def test_an_abort_mid_generation_gives_the_tier_back(engines, tier_model, prompts):
    """Aborted after its passes filled its tier: the engine stays clean and the arena
    holds nothing once the scheduler is idle."""
    engine = engines.get(
        EngineSpec.plugin(
            1, engine_args={"model_path": str(tier_model)}, **policy_fields(tier_bits=8, **TIER)
        )
    )
    mark = engine.mark()
    out = engine.generate_then_abort(prompts[0], greedy(2000), after_chunks=160)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    demoted = [r for record in engine.pass_records(mark) for r in record["requests"]]
    assert sum(r.get("tokens_demoted", 0) for r in demoted) > 0, "aborted before any demotion"
    assert_clean_after(engine, mark)
    assert engine.plugin_state()["tier"]["groups_held"] == 0


def test_retraction_with_the_tier_gives_it_back_and_re_prefills(engines, tier_model, tokenizer):
    """The lifecycle test's retraction (``test_engine_lifecycle``: a pool too small for
    the batch, SGLang told to admit greedily) with the tier: the arena is carved from a
    pool that leaves about the same 640 tokens. SGLang retracts; the retracted request
    gives its tier back, is re-prefilled in full precision (the extend batch holds no
    tier: asserted by the engine) and completes; the idle check stays clean."""
    fields = {**TIER, "kv_budget_tokens": 100, "cadence_tokens": 64}
    spec = EngineSpec.plugin(
        1,
        max_total_tokens=int(640 / (1 - TIER["tier_pool_share"])),
        engine_args={"model_path": str(tier_model), "schedule_conservativeness": 0.01},
        env={"SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "16"},
        tier_bits=3,
        **fields,
    )
    engine = engines.get(spec)
    prompts = [tokenizer(f"Request {i}: tell me a story.")["input_ids"] for i in range(7)]
    new_tokens = 300
    mark = engine.mark()
    sampling = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "temperature": 0}
    outputs = engine.generate(prompts, sampling)
    assert all(len(o["output_ids"]) == new_tokens for o in outputs)
    retractions = sum(o["meta_info"]["num_retractions"] for o in outputs)
    assert retractions >= 1
    reports = [report_of(o["meta_info"]) for o in outputs]
    assert all(r["tier_tokens_held"] > 0 for r in reports)  # every request demoted
    engines.report("tier retraction", "SGLang's num_retractions", retractions)
    assert_clean_after(engine, mark)
    assert engine.plugin_state()["tier"]["groups_held"] == 0


def test_the_tier_with_the_compactor_sidecar_equals_the_reference_loop(
    engines, tier_model, tier_reference, prompts, tmp_path_factory
):
    """``--kv-compactor grpc`` with the tier: the sidecar (a real compactor process)
    quantizes each pass's demotions into the arena the scheduler shares with it, then
    moves the slots; the engine equals the reference loop (in-process demotion, the same
    quantizer's bytes) and gives every group back."""
    from tests.compactor_process import CompactorProcess

    process = CompactorProcess(tmp_path_factory.mktemp("tier-sidecar")).start()
    engine = None
    try:
        policy = policy_fields(
            tier_bits=3, compactor="grpc", compactor_socket=str(process.socket), **TIER
        )
        engine = engines.get(
            EngineSpec.plugin(4, engine_args={"model_path": str(tier_model)}, **policy)
        )
        new_tokens = NEW_TOKENS_BY_PAGE[4]
        mark = engine.mark()
        outputs = engine.generate(prompts, greedy(new_tokens))
        reference = {k: v for k, v in policy.items() if not k.startswith("compactor")}
        expected, result = reference_outputs(
            tier_reference, prompts, new_tokens, page_size=4, policy=reference
        )
        assert_same_tokens([out["output_ids"] for out in outputs], expected)
        assert any(r.tokens_dropped for _, _, r in result.passes)  # swaps ran too
        compactor = engine.plugin_state()["compactor"]
        stats = process.stats()
        assert compactor["sidecar_passes"] > 0 and compactor["fallback_passes"] == 0, compactor
        assert stats["groups_demoted"] > 0, stats
        assert_clean_after(engine, mark)
        assert engine.plugin_state()["tier"]["groups_held"] == 0
        engines.report(
            "tier page 4 3 bits, compactor sidecar",
            "sidecar calls, groups the sidecar demoted",
            f"{compactor['sidecar_passes']}, {stats['groups_demoted']}",
        )
    finally:
        for key, live in list(engines.live.items()):  # its sidecar ends with this test
            if live is engine:
                engines.live.pop(key).close()
        process.stop()
