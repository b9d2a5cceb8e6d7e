"""The quantized tier with SGLang's ``triton`` attention backend, in SGLang's real engine
on CPU: SGLang's own split-KV decode kernels and the tier's Triton kernel run under
Triton's interpreter (``TRITON_INTERPRET=1``), and each decode layer merges the two by
the log-sum-exp that the decode's first stage leaves per split (``sglang_evict.srt.
tier.split_kv_lse``) — the path a GPU runs, without its CUDA graphs.

The engine generates exactly what the CPU reference loop generates for the same
checkpoint, prompts and policy (an 8-bit tier: the reference applies the same
quantizer), with the merge reading its full side from ``triton``'s stage 1 and its tier
side from the Triton kernel, not from the CPU's compiled kernel. The interpreter is
slow, so the test is short: two prompts, one engine."""

from __future__ import annotations

import pytest
import torch

from sglang_evict.srt.server_args import TIER_GPU_TRIAL_ENV
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

# release_smoke: the backend's decode metadata this reads (``attn_lse``,
# ``num_kv_splits``, ``kv_indptr``) is SGLang's, and differs by release.
pytestmark = [pytest.mark.engine, pytest.mark.release_smoke]

TIER = ENGINE_TIER
NEW_TOKENS = 130  # every request's tier fills, then gives groups up


def test_the_tier_merged_with_tritons_split_kv_decode_equals_the_reference_loop(
    engines, engine_model
):
    from sglang_evict.models.engine_model import ensure_engine_model

    model = ensure_engine_model(variant="head_dim64")
    prompts = shared_system_prompts(engine_model)[:2]
    policy = policy_fields(tier_bits=8, **TIER)
    engine = engines.get(
        EngineSpec.plugin(
            1,
            engine_args={"model_path": str(model), "attention_backend": "triton"},
            env={"TRITON_INTERPRET": "1"},
            **policy,
        )
    )
    mark = engine.mark()
    outputs = engine.generate(prompts, greedy(NEW_TOKENS))
    expected, result = reference_outputs(
        load_reference_model(model), prompts, NEW_TOKENS, page_size=1, policy=policy
    )
    demoted = sum(r.tokens_demoted for _, _, r in result.passes)
    assert demoted >= len(prompts) * TIER["tier_max_tokens"]  # every tier filled
    assert_same_tokens([out["output_ids"] for out in outputs], expected)
    passes = [r for record in engine.pass_records(mark) for r in record["requests"]]
    assert len(passes) == len(result.passes)
    tier = engine.plugin_state()["tier"]
    calls = tier["hook_calls"]
    # Every merge read its full side from triton's stage 1 and its tier side from the
    # Triton kernel; the CPU's compiled kernel was not built.
    assert calls["decode_merged"] > 0 and calls["split_kv_lse"] == calls["decode_merged"]
    assert tier["merged_by"] == "tier_attention_triton" and tier["cpu_kernel"] is None
    assert_clean_after(engine, mark)
    assert engine.plugin_state()["tier"]["groups_held"] == 0
    engines.report(
        "tier with the triton backend (interpreted)",
        "passes (engine = reference), tokens demoted, merges from split-KV stage 1",
        f"{len(passes)}, {demoted}, {calls['split_kv_lse']}",
    )


def gpu_tier_specs() -> dict[str, EngineSpec]:
    """The GPU test's engines, by label: the tier with SGLang's decode CUDA graphs, the
    tier without them, and eviction alone (graphs on) as the control.
    ``tests/test_gpu_preflight.py`` checks on CPU that each would start."""
    from sglang_evict.models.engine_model import ensure_engine_model

    gpu = {
        "model_path": str(ensure_engine_model(variant="head_dim64")),
        "device": "cuda",
        "attention_backend": "triton",
        "model_impl": "auto",  # SGLang's own Llama, as a server on a GPU runs
        "dtype": "bfloat16",
        "max_running_requests": 4,
        "cuda_graph_max_bs_decode": 4,
        "disable_prefill_cuda_graph": True,  # decode's graphs are the subject (and start fast)
    }
    # triton with the tier is refused on a GPU until this test passes there
    # (``server_args.TIER_BACKENDS_CPU_ONLY``): the trial switch starts it anyway.
    trial = {TIER_GPU_TRIAL_ENV: "1"}
    tier = policy_fields(tier_bits=3, **TIER)
    # the control evicts as the tier's passes do: eagerly (no pass graphs, no pool)
    alone = policy_fields(**TIER, pass_cuda_graph=False)
    return {
        "graphs": EngineSpec.plugin(1, engine_args=gpu, env=trial, **tier),
        "eager": EngineSpec.plugin(
            1, engine_args={**gpu, "disable_cuda_graph": True}, env=trial, **tier
        ),
        "no tier": EngineSpec.plugin(1, engine_args=gpu, **alone),
    }


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")
def test_the_tier_merges_inside_cuda_graph_replays_on_a_gpu(engines, engine_model):
    """On a GPU, decode runs as CUDA-graph replays, where no Python hook runs: the merge
    recorded at capture (the tier's Triton kernel, ``split_kv_lse`` over stage 1's
    buffers, the merge) must read each replay's rows and groups. A 3-bit tier in bf16:
    graphs on generate what graphs off generate, and not what eviction alone does with
    the same budget (so the replays did attend the tier)."""
    from sglang_evict.request_policy import report_of

    prompts = shared_system_prompts(engine_model)[:2]  # a batch of two: no padded rows
    outputs, tiers = {}, {}
    for label, spec in gpu_tier_specs().items():
        engine = engines.get(spec)
        mark = engine.mark()
        outs = engine.generate(prompts, greedy(NEW_TOKENS))
        outputs[label] = [o["output_ids"] for o in outs]
        assert engine.pass_records(mark), f"{label}: no pass ran"
        if spec.policy().get("tier_bits") is not None:
            held = [report_of(o["meta_info"])["tier_tokens_held"] for o in outs]
            assert all(h > 0 for h in held), f"{label}: a request held no tier: {held}"
            tier = engine.plugin_state()["tier"]
            calls = tier["hook_calls"]
            assert calls["decode_merged"] > 0 and calls["split_kv_lse"] == calls["decode_merged"]
            assert tier["merged_by"] == "tier_attention_triton"
            tiers[label] = calls
        assert_clean_after(engine, mark)
    assert_same_tokens(outputs["graphs"], outputs["eager"], who="CUDA graphs on")
    assert outputs["graphs"] != outputs["no tier"], "the replays generated as if no tier were held"
    engines.report(
        "tier with the triton backend on a GPU",
        "merges recorded (graphs) / run (eager); graphs = eager tokens",
        f"{tiers['graphs']['decode_merged']} / {tiers['eager']['decode_merged']}; equal",
    )
