"""``PagedModel`` (``sglang_evict.models.paged_model``): any architecture's own
transformers model over SGLang's paged KV pool. On a Llama it generates what
``PagedLlama`` generates under eviction; on the full cache it is each family's own
``generate``; under eviction and the tier it generates what the masked reference
generates for the survivor sets and tier groups of its own run (two generic paths, one
masking a full cache, the other reading a compacted pool). The SGLang classes it drives
(``srt.cpu_driver``) are held on every release by ``test_reference_loop``; this runs on
the first."""

from __future__ import annotations

import pytest
import torch

from sglang_evict.config import EvictionConfig
from sglang_evict.models.families import FAMILIES, ensure_family_model
from sglang_evict.models.masked_reference import MaskedReference
from sglang_evict.models.paged_model import PagedModel, paged_model
from sglang_evict.models.reference_model import PagedLlama
from sglang_evict.srt.windows import layer_windows
from tests.test_masked_reference import PROMPT, RecordingDriver, hf_greedy


def run(model, prompts, new_tokens, policy=None, page_size=16):
    """The reference loop's outputs for ``prompts`` under ``policy`` (None: the full
    cache) and, per request, its trace."""
    from sglang_evict.models.masked_reference import RequestTrace
    from sglang_evict.models.reference_loop import GenerationRequest, generate
    from sglang_evict.srt.cpu_driver import MemoryDriver

    config = None if policy is None else EvictionConfig(**policy, page_size=page_size)
    longest = max(map(len, prompts))
    driver = MemoryDriver.for_model(
        model,
        page_size=page_size,
        num_tokens=len(prompts) * (longest + new_tokens + 2 * page_size) + 64,
        config=config,
        max_context=longest + new_tokens + 8,
    )
    recording = RecordingDriver(driver)
    requests = [GenerationRequest(f"r{i}", p, new_tokens) for i, p in enumerate(prompts)]
    result = generate(recording, model, requests)
    traces = {rid: RequestTrace(states) for rid, states in recording.states.items()}
    return [result.outputs[f"r{i}"][:new_tokens] for i in range(len(prompts))], traces


def hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_on_a_llama_it_generates_what_paged_llama_generates_under_eviction(engine_model):
    from tests.engine_harness import policy_fields, shared_system_prompts

    prompts = shared_system_prompts(engine_model)
    policy = policy_fields(scorer="knorm")
    generic, _ = run(PagedModel(hf(engine_model)), prompts, 120, policy)
    llama, _ = run(PagedLlama(hf(engine_model)), prompts, 120, policy)
    assert generic == llama
    assert isinstance(paged_model(hf(engine_model)), PagedLlama)


# MLA's latent rows live in no MHA pool: PagedModel refuses it (below), and its proof
# runs in SGLang's engine (tests/test_engine_mla.py).
MHA_FAMILIES = sorted(name for name in FAMILIES if name != "deepseek_v2")


def test_an_mla_model_is_refused_by_name():
    with pytest.raises(ValueError, match="DeepseekV2ForCausalLM is MLA"):
        PagedModel(hf(ensure_family_model("deepseek_v2")))


@pytest.mark.parametrize("name", MHA_FAMILIES)
def test_on_the_full_cache_it_is_each_familys_own_greedy_generation(name):
    model = hf(ensure_family_model(name))
    if getattr(model.config, "attn_logit_softcapping", None):
        model.config.attn_logit_softcapping = None  # not applied here, as in SGLang
    windows = [w - 1 if w >= 0 else -1 for w in layer_windows(model.config)]
    if name == "mistral_swa":  # transformers windows it; SGLang does not
        windows = [model.config.sliding_window - 1] * model.config.num_hidden_layers
    expected = hf_greedy(model, PROMPT, 12)
    outputs, _ = run(PagedModel(model, windows=tuple(windows)), [PROMPT], 12)
    assert outputs[0] == expected


@pytest.mark.parametrize("name", ["gemma3"])  # windowed and full layers, q/k norm
def test_under_eviction_and_the_tier_it_equals_the_masked_reference(name):
    from tests.engine_harness import ENGINE_TIER, policy_fields, shared_system_prompts

    path = ensure_family_model(name)
    prompts = shared_system_prompts(path)
    policy = policy_fields(
        tier_bits=3, **{**ENGINE_TIER, "window_tokens": 32, "tier_outlier_tokens": 2}
    )
    outputs, traces = run(paged_model(hf(path)), prompts, 140, policy)
    assert any(s.tier_groups for t in traces.values() for s in t.states)
    fmt = EvictionConfig(**policy, page_size=16).tier_format(64)
    reference = MaskedReference.from_folder(path, tier_format=fmt)
    for i, prompt in enumerate(prompts):
        assert reference.generate(prompt, 140, traces[f"r{i}"]) == outputs[i]
