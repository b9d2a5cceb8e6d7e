"""The needle task on real text: a fact of our own hidden in a haystack of the Paul Graham
essays, asked for after it. Pure Python (no torch): the kvpress peer builds the same
prompts under its own ``transformers``.

One sample::

    system   "You are a helpful assistant. ..."
    user     <haystack: consecutive essay text, ~N tokens, with the needle sentence
              inserted at a sentence boundary at a fraction `depth` of it>
             "\\n\\nQuestion: What is the secret code of the <place> archive? ..."
    answer   the model's greedy continuation; found when it contains the code

The needles are generated, never tuned: a place from a fixed list and a 7-digit code
from a seeded generator (``needle_for``), written in one fixed sentence form. The
haystack of each sample starts at a seeded offset of the essays (the text is cut at
sentence boundaries), so every (size, depth, index) sees other text.

Budgets are fractions of the prompt's length: with ``--kv-evict-prompt`` the prompt is
compressed at the request's first pass (SnapKV's setting: queries captured at the end
of prefill score it), and the answer is decoded from the survivors.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

PLACES = (
    "Lisbon", "Oslo", "Nairobi", "Quito", "Hanoi", "Tbilisi", "Reykjavik", "Montevideo",
    "Kraków", "Osaka", "Tallinn", "Accra", "Cusco", "Perth", "Valletta", "Bergen",
    "Marrakesh", "Ljubljana", "Halifax", "Tromsø",
)  # fmt: skip
SYSTEM = "You are a helpful assistant. Answer questions about the text the user gives."
NEEDLE = "The secret code of the {place} archive is {code}."
QUESTION = (
    "Question: What is the secret code of the {place} archive? Answer with the code from the text."
)
# A needle's position: a fraction of the haystack (0: its start, 1: right before the
# question).
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
SEED_BASE = 20_251_125


@dataclass(frozen=True)
class Needle:
    place: str
    code: str

    @property
    def sentence(self) -> str:
        return NEEDLE.format(place=self.place, code=self.code)

    @property
    def question(self) -> str:
        return QUESTION.format(place=self.place)


@dataclass(frozen=True)
class NeedleSample:
    """One prompt of the task: its ids (chat template applied) and what it hides."""

    context_tokens: int  # the haystack size asked for
    depth: float
    index: int
    needle: Needle
    prompt_ids: tuple[int, ...]

    @property
    def key(self) -> str:
        return f"{self.context_tokens}-{self.depth:g}-{self.index}"


def needle_for(seed: int) -> Needle:
    rng = random.Random(SEED_BASE + seed)
    return Needle(place=rng.choice(PLACES), code=f"{rng.randrange(10**6, 10**7)}")


def found(needle: Needle, answer_text: str) -> bool:
    """The code appears in the answer (digits only, so "4 512 337" or "4,512,337"
    count too)."""
    return needle.code in re.sub(r"[^0-9]", "", answer_text)


def sentences(text: str) -> list[str]:
    """The text cut after every '.', '?' or '!' followed by white space, each sentence's
    white space (the essays' hard line breaks) made single spaces."""
    return [" ".join(s.split()) for s in re.split(r"(?<=[.?!])\s+", text) if s.strip()]


def build_sample(
    text_sentences: Sequence[str],
    count_tokens: Callable[[str], int],
    encode_chat: Callable[[list[dict]], list[int]],
    *,
    context_tokens: int,
    depth: float,
    index: int,
) -> NeedleSample:
    """The sample (``context_tokens``, ``depth``, ``index``): a haystack of as many whole
    sentences as fit in ``context_tokens`` tokens from a seeded offset, the needle at
    ``depth`` of it, the question after it, through the chat template (the prompt is the
    haystack plus about 70 tokens)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth {depth} is outside [0, 1]")
    seed = hash_seed(context_tokens, depth, index)
    needle = needle_for(seed)
    rng = random.Random(seed)
    start = rng.randrange(len(text_sentences))
    chosen, used = [], 0
    position = start
    while True:  # whole sentences, as many as fit in ``context_tokens``
        if len(chosen) >= len(text_sentences):
            raise ValueError(
                f"the text holds fewer than {context_tokens} tokens: a haystack that "
                f"size needs more text"
            )
        sentence = text_sentences[position % len(text_sentences)]
        size = count_tokens(" " + sentence)
        if chosen and used + size > context_tokens:
            break
        chosen.append(sentence)
        used += size
        position += 1
    at = round(depth * len(chosen))
    haystack = " ".join([*chosen[:at], needle.sentence, *chosen[at:]])
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{haystack}\n\n{needle.question}"},
    ]
    return NeedleSample(
        context_tokens=context_tokens,
        depth=depth,
        index=index,
        needle=needle,
        prompt_ids=tuple(encode_chat(messages)),
    )


def hash_seed(context_tokens: int, depth: float, index: int) -> int:
    """A stable seed per (size, depth, index) (Python's ``hash`` of a str is salted)."""
    return context_tokens * 1_000_003 + round(depth * 1000) * 1009 + index


def build_samples(
    text: str,
    tokenizer,
    *,
    context_sizes: Sequence[int],
    depths: Sequence[float] = DEFAULT_DEPTHS,
    per_depth: int = 1,
    first_index: int = 0,
) -> list[NeedleSample]:
    """Every (size, depth, index) sample over ``text`` with ``tokenizer`` (an HF
    tokenizer with a chat template), indexes ``first_index`` .. ``+ per_depth - 1``."""
    text_sentences = sentences(text)
    if not text_sentences:
        raise ValueError("the haystack text holds no sentences")

    def count(sentence: str) -> int:
        return len(tokenizer(sentence, add_special_tokens=False)["input_ids"])

    def encode(messages: list[dict]) -> list[int]:
        return chat_ids(tokenizer, messages)

    return [
        build_sample(text_sentences, count, encode, context_tokens=size, depth=depth, index=index)
        for size in context_sizes
        for depth in depths
        for index in range(first_index, first_index + per_depth)
    ]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, ready for the
    assistant's turn (transformers 4 returns a list, 5 may return an encoding)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys") and "input_ids" in ids:
        ids = ids["input_ids"]
    return [int(i) for i in ids]
