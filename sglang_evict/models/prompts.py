"""How a prompt is put to a model: through its chat template (an instruction-tuned
model), or as plain text to continue (a base model, which has no template, or whose
template it was never trained on)."""

from __future__ import annotations


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, ready for the
    assistant's turn (transformers 4 returns a list, 5 may return an encoding)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys") and "input_ids" in ids:
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def completion_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` for a base model to continue: the tokenizer's own special
    tokens (a BOS where the model expects one), no template."""
    return [int(i) for i in tokenizer(text)["input_ids"]]
