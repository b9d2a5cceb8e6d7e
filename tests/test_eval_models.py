"""The quality evaluation beyond Llama: a base model's needles as text to continue, the
architectures it accepts, and a tier's recent window covering a windowed model's."""

from __future__ import annotations

import json

import pytest

from sglang_evict.quality.real.frontier import Candidate
from sglang_evict.quality.real.frontier_run import WINDOW_TOKENS, window_for
from sglang_evict.quality.real.needle import (
    COMPLETION,
    build_sample,
    found,
    needle_for,
    prompt_style_of,
    sentences,
)
from sglang_evict.tier.policy import ModelShape

TEXT = " ".join(
    f"Sentence number {i} says something about startups and essays." for i in range(400)
)


@pytest.mark.parametrize("kind", ["code7", "code5", "word", "time"])
def test_a_base_models_needle_prompt_ends_with_the_needle_sentences_opening(kind):
    texts = []
    sample = build_sample(
        sentences(TEXT),
        lambda s: len(s.split()),
        lambda prompt: texts.append(prompt) or [1, 2, 3],
        context_tokens=300,
        depth=0.5,
        index=0,
        kind=kind,
        style=COMPLETION,
    )
    (text,) = texts
    assert isinstance(text, str) and sample.prompt_ids == (1, 2, 3)
    needle = sample.needle
    assert needle.sentence in text
    assert text.endswith(f"{needle.question}\nAnswer: {needle.cloze}")
    assert needle.sentence.startswith(needle.cloze) and needle.code not in needle.cloze
    assert found(needle, needle.sentence[len(needle.cloze) :])


def test_the_prompt_style_follows_the_chat_template():
    class Tokenizer:
        chat_template = None

    assert prompt_style_of(Tokenizer()) == COMPLETION
    Tokenizer.chat_template = "{{ messages }}"
    assert prompt_style_of(Tokenizer()) == "chat"
    with pytest.raises(ValueError, match="prompt style"):
        build_sample(["a."], len, list, context_tokens=1, depth=0.5, index=0, style="poem")
    assert needle_for(3).cloze == f"The secret code of the {needle_for(3).place} archive is"


def test_the_evaluation_takes_the_validated_architectures_and_names_them(tmp_path):
    from sglang_evict.quality.real.evaluation import check_model

    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"})
    )
    assert check_model(tmp_path)["model_type"] == "gemma3_text"
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["PhiForCausalLM"], "model_type": "phi"})
    )
    with pytest.raises(ValueError, match=r"PhiForCausalLM.*Gemma3ForCausalLM"):
        check_model(tmp_path)


def test_a_tiers_recent_window_covers_the_models_window_and_evictions_does_not():
    gemma = ModelShape(18, 1, 256, window_tokens=512)
    llama = ModelShape(30, 3, 64)
    tier, evict = Candidate.parse("3:32/rkv"), Candidate.parse("evict:rkv")
    assert window_for(tier, gemma) == 512 and window_for(evict, gemma) == WINDOW_TOKENS
    assert window_for(tier, llama) == WINDOW_TOKENS
    assert ModelShape.of_config(
        {"text_config": {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}}
    ) == ModelShape(2, 4, 16)
