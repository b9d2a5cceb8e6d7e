"""The needle task on real text: a fact of our own hidden in a haystack of the Paul Graham
essays, asked for after it. Pure Python (no torch): the kvpress peer builds the same
prompts under its own ``transformers``.

One sample::

    system   "You are a helpful assistant. ..."
    user     <haystack: consecutive essay text, ~N tokens, with the needle sentence
              inserted at a sentence boundary at a fraction `depth` of it>
             "\\n\\nQuestion: What is the secret code of the <place> archive? ..."
    answer   the model's greedy continuation; found when it contains the code

or, for a base model (a tokenizer without a chat template: ``prompt_style_of``), the same
text to continue: ``<haystack>\n\nQuestion: ...\nAnswer: The secret code of the <place>
archive is`` (the needle sentence's opening, ``Needle.cloze``).

The needles are generated, never tuned: a place from a fixed list and, per kind, what
the answer must copy, from a seeded generator (``needle_for``), each kind in one fixed
sentence form (``KINDS``):

    code7   "The secret code of the <place> archive is 4512337."   (the original kind)
    code5   "The secret code of the <place> archive is 45123."
    word    "The password of the <place> archive is marigold."
    time    "The <place> archive opens at 7:45."

A default chosen on one kind of needle need not be the default for others, so the
tier's defaults are read on all four (``docs/quality.md``). The
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

from sglang_evict.models.prompts import chat_ids, completion_ids

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
# kind -> (needle sentence, question); ``{code}`` is what the answer must copy.
KINDS = {
    "code7": (NEEDLE, QUESTION),
    "code5": (NEEDLE, QUESTION),
    "word": (
        "The password of the {place} archive is {code}.",
        "Question: What is the password of the {place} archive? Answer with the password "
        "from the text.",
    ),
    "time": (
        "The {place} archive opens at {code}.",
        "Question: At what time does the {place} archive open? Answer with the time from the text.",
    ),
}
WORDS = (
    "marigold", "quartz", "lantern", "pelican", "saffron", "tundra", "falcon", "juniper",
    "obsidian", "walrus", "zephyr", "tangerine", "cobalt", "nectarine", "wombat", "fjord",
    "mosaic", "pumice", "glacier", "harpoon", "lavender", "basilisk", "meridian", "sorrel",
)  # fmt: skip
# A needle's position: a fraction of the haystack (0: its start, 1: right before the
# question).
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
SEED_BASE = 20_251_125


@dataclass(frozen=True)
class Needle:
    place: str
    code: str  # what the answer must copy (a code, a word or a time, by ``kind``)
    kind: str = "code7"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"needle kind {self.kind!r}; known: {list(KINDS)}")

    @property
    def sentence(self) -> str:
        return KINDS[self.kind][0].format(place=self.place, code=self.code)

    @property
    def question(self) -> str:
        return KINDS[self.kind][1].format(place=self.place)

    @property
    def cloze(self) -> str:
        """The needle sentence up to what it hides ("The secret code of the Oslo archive
        is"): what a base model is asked to continue."""
        return KINDS[self.kind][0].split("{code}")[0].format(place=self.place).rstrip()


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
        """``size-depth-index`` (``code7``, the original kind) or ``kind-size-depth-index``."""
        base = f"{self.context_tokens}-{self.depth:g}-{self.index}"
        return base if self.needle.kind == "code7" else f"{self.needle.kind}-{base}"


def needle_for(seed: int, kind: str = "code7") -> Needle:
    rng = random.Random(SEED_BASE + seed)
    place = rng.choice(PLACES)
    if kind == "code7":
        code = f"{rng.randrange(10**6, 10**7)}"
    elif kind == "code5":
        code = f"{rng.randrange(10**4, 10**5)}"
    elif kind == "word":
        code = rng.choice(WORDS)
    elif kind == "time":
        code = f"{rng.randrange(1, 13)}:{rng.randrange(60):02d}"
    else:
        raise ValueError(f"needle kind {kind!r}; known: {list(KINDS)}")
    return Needle(place=place, code=code, kind=kind)


def found(needle: Needle, answer_text: str) -> bool:
    """The answer holds what the needle hides: a code's digits (digits only, so
    "4 512 337" or "4,512,337" count too), the word (any case, as a word), the time
    (``7:45``, or ``7.45``/``7 45``; a leading zero allowed)."""
    if needle.kind in ("code7", "code5"):
        return needle.code in re.sub(r"[^0-9]", "", answer_text)
    if needle.kind == "word":
        return re.search(rf"\b{re.escape(needle.code)}\b", answer_text, re.IGNORECASE) is not None
    hours, minutes = needle.code.split(":")
    return re.search(rf"(?<!\d)0?{hours}\s*[:.\s]\s*{minutes}(?!\d)", answer_text) is not None


def sentences(text: str) -> list[str]:
    """The text cut after every '.', '?' or '!' followed by white space, each sentence's
    white space (the essays' hard line breaks) made single spaces."""
    return [" ".join(s.split()) for s in re.split(r"(?<=[.?!])\s+", text) if s.strip()]


# How a sample's prompt is put to the model: through its chat template (an
# instruction-tuned model), or as text for a base model to continue: the haystack, the
# question, then "Answer:" and the needle sentence's opening (``Needle.cloze``).
CHAT, COMPLETION = "chat", "completion"
PROMPT_STYLES = (CHAT, COMPLETION)


def prompt_style_of(tokenizer) -> str:
    """``chat`` when the tokenizer has a chat template, else ``completion``."""
    return CHAT if getattr(tokenizer, "chat_template", None) else COMPLETION


def build_sample(
    text_sentences: Sequence[str],
    count_tokens: Callable[[str], int],
    encode: Callable[[list[dict] | str], list[int]],
    *,
    context_tokens: int,
    depth: float,
    index: int,
    kind: str = "code7",
    style: str = CHAT,
) -> NeedleSample:
    """The sample (``context_tokens``, ``depth``, ``index``): a haystack of as many whole
    sentences as fit in ``context_tokens`` tokens from a seeded offset, the needle at
    ``depth`` of it, the question after it, through the chat template (``encode`` gets
    the messages) or as text to continue (``style`` ``completion``: ``encode`` gets the
    text); the prompt is the haystack plus about 70 tokens."""
    if style not in PROMPT_STYLES:
        raise ValueError(f"prompt style {style!r}; known: {list(PROMPT_STYLES)}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth {depth} is outside [0, 1]")
    seed = hash_seed(context_tokens, depth, index, kind)
    needle = needle_for(seed, kind)
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
    if style == COMPLETION:
        prompt = encode(f"{haystack}\n\n{needle.question}\nAnswer: {needle.cloze}")
    else:
        prompt = encode(
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{haystack}\n\n{needle.question}"},
            ]
        )
    return NeedleSample(
        context_tokens=context_tokens,
        depth=depth,
        index=index,
        needle=needle,
        prompt_ids=tuple(prompt),
    )


def hash_seed(context_tokens: int, depth: float, index: int, kind: str = "code7") -> int:
    """A stable seed per (size, depth, index, kind) (Python's ``hash`` of a str is
    salted); the original kind keeps its seeds."""
    seed = context_tokens * 1_000_003 + round(depth * 1000) * 1009 + index
    return seed + list(KINDS).index(kind) * 7_919_000_003


def build_samples(
    text: str,
    tokenizer,
    *,
    context_sizes: Sequence[int],
    depths: Sequence[float] = DEFAULT_DEPTHS,
    per_depth: int = 1,
    first_index: int = 0,
    kinds: Sequence[str] = ("code7",),
    style: str | None = None,
) -> list[NeedleSample]:
    """Every (size, depth, index) sample over ``text`` with ``tokenizer`` (an HF
    tokenizer), indexes ``first_index`` .. ``+ per_depth - 1``; ``style``: the prompt
    style (default: ``prompt_style_of(tokenizer)``)."""
    style = prompt_style_of(tokenizer) if style is None else style
    text_sentences = sentences(text)
    if not text_sentences:
        raise ValueError("the haystack text holds no sentences")

    def count(sentence: str) -> int:
        return len(tokenizer(sentence, add_special_tokens=False)["input_ids"])

    def encode(prompt: list[dict] | str) -> list[int]:
        if style == COMPLETION:
            return completion_ids(tokenizer, prompt)
        return chat_ids(tokenizer, prompt)

    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ValueError(f"needle kinds {unknown or '(none)'}; known: {list(KINDS)}")
    return [
        build_sample(
            text_sentences,
            count,
            encode,
            context_tokens=size,
            depth=depth,
            index=index,
            kind=kind,
            style=style,
        )
        for kind in kinds
        for size in context_sizes
        for depth in depths
        for index in range(first_index, first_index + per_depth)
    ]
