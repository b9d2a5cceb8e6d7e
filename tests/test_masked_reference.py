"""The architecture-generic masked reference (``sglang_evict.models.masked_reference``)
held to what it claims: on the full cache it is transformers' own greedy generation
for every family (windows in SGLang's convention, one key wider than transformers');
given the survivor sets and tier groups of the project's CPU reference loop
(``PagedLlama`` through SGLang's memory classes, an independent implementation) it
generates exactly what that loop generates, with eviction and with the tier."""

from __future__ import annotations

import pytest
import torch

from sglang_evict.config import EvictionConfig
from sglang_evict.models.families import FAMILIES, ensure_family_model
from sglang_evict.models.masked_reference import (
    KeptState,
    MaskedReference,
    RequestTrace,
    traces_from_pass_records,
)
from sglang_evict.srt.windows import layer_windows

# The reference loop drives SGLang's memory classes, held on every release by
# test_reference_loop: this module runs on the first release only.

PROMPT = list(range(5, 29))  # 24 tokens: prompt + 12 new ones pass every window of 24


def hf_greedy(model, prompt, new_tokens):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_on_the_full_cache_it_is_transformers_own_greedy_generation(name):
    """Windowed layers get ``W - 1`` here, transformers' ``W`` keys in SGLang's ``W + 1``
    convention; Gemma 2's attention soft-capping, which SGLang does not apply, is left
    off on both sides."""
    from transformers import AutoModelForCausalLM

    path = ensure_family_model(name)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    if getattr(model.config, "attn_logit_softcapping", None):
        model.config.attn_logit_softcapping = None
    windows = [w - 1 if w >= 0 else -1 for w in layer_windows(model.config)]
    if name == "mistral_swa":  # transformers windows it; SGLang does not (layer_windows)
        windows = [model.config.sliding_window - 1] * model.config.num_hidden_layers
    expected = hf_greedy(model, PROMPT, 12)
    got = MaskedReference(model, windows=tuple(windows)).generate(PROMPT, 12)
    assert got == expected


def test_sglangs_window_is_one_key_wider_than_transformers():
    """The same Gemma 3 model's logits: with windows one shorter (transformers' W keys)
    the reference equals transformers' own; with SGLang's windows (``layer_windows``)
    they part exactly where the context passes the window."""
    from transformers import AutoModelForCausalLM

    path = ensure_family_model("gemma3")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompt = list(range(5, 45))  # 40 tokens, past the window of 24
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0]
    windows = layer_windows(model.config)
    narrower = tuple(w - 1 if w >= 0 else -1 for w in windows)
    torch.testing.assert_close(
        MaskedReference(model, windows=narrower).prompt_logits(prompt), expected
    )
    sglangs = MaskedReference(model).prompt_logits(prompt)
    window = max(windows)
    torch.testing.assert_close(sglangs[:window], expected[:window])  # within the window
    assert (sglangs[window:] - expected[window:]).abs().amax(dim=-1).min() > 1e-4


class RecordingDriver:
    """A ``MemoryDriver`` whose decode preparation records, per request and step, what
    the step attends: its full-precision positions and its tier groups' positions."""

    def __init__(self, driver):
        self._driver = driver
        self.states: dict[str, list[KeptState]] = {}

    def __getattr__(self, name):
        return getattr(self._driver, name)

    def prepare_decode(self, reqs):
        out = self._driver.prepare_decode(reqs)
        arena = self._driver.tier_arena
        for req in reqs:
            positions = self._driver.positions(req).tolist()
            query = positions[-1]  # the slot just allocated: the new token's position
            groups = () if arena is None else tuple(map(tuple, arena.positions_of(req.rid)))
            state = KeptState(query, tuple(positions[:-1]), groups)
            self.states.setdefault(req.rid, []).append(state)
        return out


def loop_and_trace(model_path, prompts, new_tokens, policy, page_size):
    """The CPU reference loop's outputs and, per request, its trace."""
    from sglang_evict.models.reference_loop import GenerationRequest, generate
    from sglang_evict.srt.cpu_driver import MemoryDriver
    from tests.engine_harness import load_reference_model

    model = load_reference_model(model_path)
    config = EvictionConfig(**policy, page_size=page_size)
    driver = MemoryDriver.for_model(
        model,
        page_size=page_size,
        num_tokens=len(prompts) * (max(map(len, prompts)) + new_tokens + 2 * page_size) + 64,
        config=config,
        max_context=max(map(len, prompts)) + new_tokens + 8,
    )
    recording = RecordingDriver(driver)
    requests = [GenerationRequest(f"r{i}", p, new_tokens) for i, p in enumerate(prompts)]
    result = generate(recording, model, requests)
    traces = {rid: RequestTrace(states) for rid, states in recording.states.items()}
    return [result.outputs[f"r{i}"][:new_tokens] for i in range(len(prompts))], traces, config


@pytest.mark.parametrize("page_size", [1, 16])
def test_given_the_loops_survivors_it_generates_what_the_loop_generates(engine_model, page_size):
    from tests.engine_harness import policy_fields, shared_system_prompts

    prompts = shared_system_prompts(engine_model)
    new_tokens = 120
    policy = policy_fields(scorer="knorm")
    outputs, traces, _ = loop_and_trace(engine_model, prompts, new_tokens, policy, page_size)
    reference = MaskedReference.from_folder(engine_model)
    for i, prompt in enumerate(prompts):
        trace = traces[f"r{i}"]
        assert len({s.full_positions for s in trace.states}) > 3  # passes evicted
        assert reference.generate(prompt, new_tokens, trace) == outputs[i]
    # and the full cache parts from them: the masks are what makes them equal
    assert reference.generate(prompts[2], new_tokens) != outputs[2]


def test_given_the_loops_tier_it_generates_what_the_loop_generates():
    from sglang_evict.models.engine_model import ensure_engine_model
    from tests.engine_harness import ENGINE_TIER, policy_fields, shared_system_prompts

    model_path = ensure_engine_model(variant="head_dim64")
    prompts = shared_system_prompts(model_path)
    new_tokens = 140
    policy = policy_fields(tier_bits=3, tier_outlier_tokens=2, **ENGINE_TIER)
    outputs, traces, config = loop_and_trace(model_path, prompts, new_tokens, policy, 1)
    assert any(s.tier_groups for trace in traces.values() for s in trace.states)
    reference = MaskedReference.from_folder(model_path, tier_format=config.tier_format(64))
    for i, prompt in enumerate(prompts):
        assert reference.generate(prompt, new_tokens, traces[f"r{i}"]) == outputs[i]


def test_a_trace_without_kept_positions_is_refused_naming_the_switch():
    with pytest.raises(ValueError, match="SGLANG_EVICT_LOG_KEPT=1"):
        traces_from_pass_records([{"requests": [{"rid": "a", "tokens_before": 9}]}])


def test_a_trace_must_come_in_position_order():
    trace = RequestTrace()
    trace.add(KeptState(10, (0, 1)))
    with pytest.raises(ValueError, match="position order"):
        trace.add(KeptState(8, (0,)))
    assert trace.at(9) is None and trace.at(10).full_positions == (0, 1)
