"""The recall-chain task: long-range retrieval during generation, with known answers.

One sequence (token ids, vocabulary below)::

    prompt     BOS TASK                                     2 tokens (radix-cached)
    forced     body ... QUERY x0                            decoded, teacher-forced
    answer     x1 x2 ... xC                                 decoded, free (greedy)

``body`` holds ``num_facts`` facts ``FACT k v`` among ``num_distractors`` distractor
tokens, listed in random order. The facts are a random permutation ``f`` of
``num_facts`` distinct symbols: one cycle ``x0 -> x1 -> ... -> xC -> x0`` that the
answer walks, the other symbols in a cycle of decoy facts. Each answer token is
``f(previous token)``, so step i needs one specific fact from far back, chosen by the
model's own last output. Every symbol is the key of one fact and the value of another,
and the decoys keep many unused symbols to the last step, so nothing but the fact
itself gives the answer (no elimination shortcut). Facts whose step has passed are
stale; decoy facts and distractors are never needed, but only hindsight tells.

Variants (the ``TASK`` token tells the model which):
    ``spread``  facts at uniformly random places of the body;
    ``middle``  facts in one block in the middle of the body, long distractor runs on
                both sides: neither attention sinks nor a recency window reach them.

Why the facts are decoded tokens, not prompt tokens: in SGLang the prompt enters the
radix tree after prefill, and tree-owned tokens are never eviction candidates (they
may be shared by other requests). The plugin evicts only what a request decodes, so
the facts a quality test wants evicted (or kept) must be part of the decoded stream:
``forced`` is fed one token per decode step, as if the model had written it earlier
in its own trace.

Everything here is pure Python (no torch): the kvpress peer imports it under another
``transformers``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

# --- vocabulary ---------------------------------------------------------------------
PAD = 0
BOS = 1
FACT = 2
QUERY = 3
TASK_TOKENS = {"spread": 4, "middle": 5}
FIRST_SYMBOL = 8
NUM_SYMBOLS = 64  # fact keys/values: ids [8, 72)
FIRST_DISTRACTOR = FIRST_SYMBOL + NUM_SYMBOLS
NUM_DISTRACTOR_TOKENS = 56  # ids [72, 128)
VOCAB_SIZE = FIRST_DISTRACTOR + NUM_DISTRACTOR_TOKENS  # 128
VARIANTS = tuple(TASK_TOKENS)
PROMPT_TOKENS = 2
# Data seeds below this train the reference model; held-out (evaluation) data uses
# HELD_OUT_SEED_BASE + seed, so no evaluation sequence was ever trained on.
HELD_OUT_SEED_BASE = 10_000


@dataclass(frozen=True)
class TaskSpec:
    """Shape of one family of sequences.

    Attributes:
        variant: ``spread`` or ``middle``.
        num_facts: facts in the body (the cycle length), 2..NUM_SYMBOLS.
        num_distractors: distractor tokens in the body.
        chain_steps: answer tokens (at most ``num_facts - 1``: the walk never
            returns to a fact it has used, so used facts are stale for good); the
            ``num_facts - chain_steps - 1`` symbols off the walk are decoys.
    """

    variant: str = "spread"
    num_facts: int = 32
    num_distractors: int = 224
    chain_steps: int = 16

    def __post_init__(self) -> None:
        if self.variant not in TASK_TOKENS:
            raise ValueError(f"unknown task variant {self.variant!r}; known: {list(VARIANTS)}")
        if not 2 <= self.num_facts <= NUM_SYMBOLS:
            raise ValueError(f"num_facts={self.num_facts} is out of range; allowed: [2, 64]")
        if self.num_distractors < 0:
            raise ValueError(f"num_distractors={self.num_distractors} must be >= 0")
        if not 1 <= self.chain_steps <= self.num_facts - 1:
            raise ValueError(
                f"chain_steps={self.chain_steps} is out of range; allowed: [1, "
                f"num_facts - 1 = {self.num_facts - 1}]"
            )

    @property
    def body_tokens(self) -> int:
        return self.num_distractors + 3 * self.num_facts

    @property
    def forced_tokens(self) -> int:
        return self.body_tokens + 2  # + QUERY x0

    @property
    def total_tokens(self) -> int:
        """Every token of a sequence: prompt, forced stream and answer."""
        return PROMPT_TOKENS + self.forced_tokens + self.chain_steps


@dataclass(frozen=True)
class Sample:
    """One sequence of the task and what answers it.

    Attributes:
        prompt: ``[BOS, TASK]``.
        forced: the decoded stream fed to the model (body, ``QUERY``, ``x0``).
        answer: the correct chain ``x1 .. xC``.
        successor: the facts, ``k -> f(k)``.
        fact_positions: logical positions (in prompt + forced) of each ``FACT`` marker.
    """

    spec: TaskSpec
    prompt: tuple[int, ...]
    forced: tuple[int, ...]
    answer: tuple[int, ...]
    successor: dict[int, int] = field(repr=False)
    fact_positions: tuple[int, ...] = field(repr=False)

    @property
    def start(self) -> int:
        return self.forced[-1]

    @property
    def tokens(self) -> list[int]:
        """The whole sequence with the correct answer (training input)."""
        return [*self.prompt, *self.forced, *self.answer]


def make_sample(spec: TaskSpec, seed: int, index: int) -> Sample:
    """The ``index``-th sequence of ``spec`` under ``seed`` (pure function of the three)."""
    variant_code = VARIANTS.index(spec.variant)
    rng = random.Random((seed * 1_000_003 + index) * 8 + variant_code)
    symbols = rng.sample(range(FIRST_SYMBOL, FIRST_SYMBOL + NUM_SYMBOLS), spec.num_facts)
    # The walked cycle has chain_steps + 1 symbols; a lone leftover symbol joins it
    # (a one-symbol decoy cycle would be a fact k -> k).
    walked = spec.chain_steps + 1
    if spec.num_facts - walked == 1:
        walked += 1
    successor = {}
    for cycle in (symbols[:walked], symbols[walked:]):
        for i, key in enumerate(cycle):
            successor[key] = cycle[(i + 1) % len(cycle)]
    facts = [[FACT, k, successor[k]] for k in symbols]
    rng.shuffle(facts)
    distractors = [
        rng.randrange(FIRST_DISTRACTOR, FIRST_DISTRACTOR + NUM_DISTRACTOR_TOKENS)
        for _ in range(spec.num_distractors)
    ]
    if spec.variant == "spread":
        # Each fact goes into one of the num_distractors + 1 gaps, chosen independently.
        gaps = sorted(rng.randrange(spec.num_distractors + 1) for _ in facts)
    else:
        # One block; its start jitters by up to a tenth of the distractors around the middle.
        jitter = spec.num_distractors // 10
        middle = spec.num_distractors // 2 + rng.randint(-jitter, jitter)
        gaps = [middle] * len(facts)
    body: list[int] = []
    fact_positions = []
    next_fact = 0
    for gap in range(spec.num_distractors + 1):
        while next_fact < len(facts) and gaps[next_fact] == gap:
            fact_positions.append(PROMPT_TOKENS + len(body))
            body.extend(facts[next_fact])
            next_fact += 1
        if gap < spec.num_distractors:
            body.append(distractors[gap])
    start = symbols[0]
    chain = [start]
    for _ in range(spec.chain_steps):
        chain.append(successor[chain[-1]])
    return Sample(
        spec=spec,
        prompt=(BOS, TASK_TOKENS[spec.variant]),
        forced=(*body, QUERY, start),
        answer=tuple(chain[1:]),
        successor=successor,
        fact_positions=tuple(fact_positions),
    )


def held_out_samples(spec: TaskSpec, seed: int, count: int) -> list[Sample]:
    """``count`` evaluation sequences of ``spec``: data seed ``HELD_OUT_SEED_BASE + seed``,
    disjoint from every training seed."""
    return [make_sample(spec, HELD_OUT_SEED_BASE + seed, i) for i in range(count)]


@dataclass(frozen=True)
class ChainScore:
    """How a generated chain compares with the facts.

    ``steps_correct`` counts steps whose token is the successor of the token before it
    (the model's own previous output, ``x0`` for the first): each step is judged on the
    one retrieval it had to make, so an early mistake is not counted again downstream.
    ``exact`` is the whole chain equal to the answer.
    """

    steps_correct: int
    num_steps: int
    exact: bool


def score_chain(sample: Sample, generated: Sequence[int]) -> ChainScore:
    """Score ``generated`` (the answer tokens the model produced) against ``sample``."""
    if len(generated) != len(sample.answer):
        raise ValueError(
            f"generated chain has {len(generated)} tokens, the task asks for {len(sample.answer)}"
        )
    previous = sample.start
    correct = 0
    for token in generated:
        correct += int(sample.successor.get(previous) == token)
        previous = token
    return ChainScore(correct, len(generated), tuple(generated) == sample.answer)
