"""Eviction and the quantized tier on one axis: KV bytes held as a fraction of the full
cache's, through the paged reference path (SGLang's memory classes in
``MemoryDriver``, the plugin's passes, ``PagedLlama`` merging the tier's attention).

A configuration is a way to spend the same bytes:

    evict <scorer>        a budget of ``f * L`` full-precision tokens; the rest evicted
    tier <b>b G<g> o<n>   the cold tokens at ``b`` bits (groups of ``g``, ``n`` outlier
                          tokens per group), the full-precision budget what the bytes
                          leave; when even the smallest budget (sinks + window) leaves too
                          few bytes for every cold token, the tier holds what fits and the
                          scorer evicts the rest ("eviction beyond the tier")

Bytes are counted as ``sglang_evict.tier.policy.kv_bytes`` does, in bfloat16 (what a GPU
server stores; the CPU path computes in float32, which changes no ratio): for a prompt of
``L`` tokens, ``full * F + tier * T <= f * L * F`` with ``F`` a token's full-precision
bytes and ``T`` its tier bytes (codes, scales, outlier tokens; every layer and KV head).
Each row of the results records the fraction it actually held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sglang_evict.config import EvictionConfig
from sglang_evict.tier.policy import ModelShape as Shape
from sglang_evict.tier.policy import tier_token_ratio

BYTES_DTYPE = torch.bfloat16  # the accounting's full precision (module docstring)


@dataclass(frozen=True)
class Candidate:
    """One way to hold the bytes: eviction alone (``bits`` None) or the tier."""

    scorer: str = "streaming"
    bits: int | None = None
    group_tokens: int = 32
    outlier_tokens: int = 0
    value_group_channels: int = 32

    @property
    def name(self) -> str:
        if self.bits is None:
            return f"evict {self.scorer}"
        tail = f" o{self.outlier_tokens}" if self.outlier_tokens else ""
        if self.value_group_channels != 32:
            tail += f" V{self.value_group_channels}"
        if self.scorer != "streaming":
            tail += f" {self.scorer}"
        return f"tier {self.bits}b G{self.group_tokens}{tail}"

    @classmethod
    def of_config(cls, config) -> Candidate:
        """The candidate an ``EvictionConfig`` runs (its tier's format, if any)."""
        return cls(
            scorer=config.scorer,
            bits=config.tier_bits,
            group_tokens=config.tier_group_tokens,
            outlier_tokens=config.tier_outlier_tokens,
            value_group_channels=config.tier_value_group_channels,
        )

    @classmethod
    def parse(cls, text: str, scorer: str = "streaming") -> Candidate:
        """``evict`` / ``evict:rkv`` or ``BITS:G[:OUTLIERS[:VALUE_GROUP]][/SCORER]``
        (``3:32``, ``2:64:3``, ``3:64:0:64`` (values in groups of 64 channels; 32 by
        default), ``3:64/rkv``: the scorer that picks the groups evicted beyond the
        tier)."""
        if text == "evict" or text.startswith("evict:"):
            return cls(scorer=text.partition(":")[2] or scorer)
        text, slash, tier_scorer = text.partition("/")
        if slash:
            if not tier_scorer:
                raise ValueError(f"--candidates {text}/: a scorer after '/' (e.g. 3:64/rkv)")
            scorer = tier_scorer
        parts = text.split(":")
        try:
            numbers = [int(p) for p in parts]
        except ValueError:
            numbers = []
        if len(numbers) not in (2, 3, 4):
            raise ValueError(
                f"--candidates {text!r}: 'evict', 'evict:SCORER' or "
                f"BITS:GROUP[:OUTLIERS[:VALUE_GROUP]][/SCORER] (e.g. 3:32, 2:64:3, 3:64/rkv)"
            )
        numbers += [0, 32][len(numbers) - 2 :]
        return cls(scorer, *numbers)


@dataclass(frozen=True)
class Spend:
    """How a candidate spends ``fraction`` of ``length`` tokens' full-precision bytes."""

    budget_tokens: int  # full precision after the pass
    tier_tokens: int  # the tier's bound (0: no tier)
    fraction: float  # the bytes it holds after a pass over ``length`` tokens


def tier_ratio(candidate: Candidate, shape: Shape, full_dtype: torch.dtype = BYTES_DTYPE) -> float:
    """A tier token's bytes over a full-precision token's (every layer and KV head),
    full precision in ``full_dtype`` (the accounting's bfloat16 unless asked)."""
    return tier_token_ratio(_format(candidate, shape), shape, full_dtype)


def _format(candidate: Candidate, shape: Shape):
    from sglang_evict_kernels.tier_format import TierFormat

    return TierFormat(
        bits=candidate.bits,
        group_tokens=candidate.group_tokens,
        outlier_tokens=candidate.outlier_tokens,
        value_group_channels=candidate.value_group_channels,
        head_dim=shape.head_dim,
    )


def spend(
    candidate: Candidate, *, fraction: float, length: int, shape: Shape, min_budget: int
) -> Spend:
    """The module docstring's split of ``fraction * length`` tokens' bytes; the budget
    never below ``min_budget`` (sinks + window + 1), the tier in whole groups, the cold
    tokens a whole number of groups (nothing waits), and never above the bytes."""
    target = fraction * length
    if candidate.bits is None:
        budget = max(min_budget, math.floor(target))
        return Spend(budget, 0, budget / length)
    g = candidate.group_tokens
    r = tier_ratio(candidate, shape)
    # Every cold token in the tier: budget + (length - budget) * r <= target.
    budget = math.floor((target - length * r) / (1 - r))
    if budget >= min_budget:
        cold_groups = math.ceil((length - budget) / g)  # budget rounded down: whole groups
        budget = length - cold_groups * g
    if budget >= min_budget:
        tier = (length - budget) // g * g
        return Spend(budget, max(tier, g), (budget + tier * r) / length)
    # Eviction beyond the tier: the smallest budget (and the cold tokens left over from
    # whole groups, waiting in full precision), the tier what the bytes leave.
    budget = min_budget
    waiting = (length - budget) % g
    groups = math.floor((target - budget - waiting) / (r * g))
    if groups < 1:
        raise ValueError(
            f"{candidate.name}: {fraction:g} of the KV bytes of {length} tokens cannot hold "
            f"the {min_budget} protected tokens and one group"
        )
    return Spend(budget, groups * g, (budget + waiting + groups * g * r) / length)


def config_for(
    candidate: Candidate,
    spent: Spend,
    *,
    page_size: int = 16,
    sink_tokens: int = 4,
    window_tokens: int = 32,
    cadence_tokens: int = 64,
    evict_prompt: bool = True,
    stats: str | None = None,
) -> EvictionConfig:
    fields = dict(
        kv_budget_tokens=spent.budget_tokens,
        cadence_tokens=cadence_tokens,
        sink_tokens=sink_tokens,
        window_tokens=window_tokens,
        scorer=candidate.scorer,
        scorer_params={"stats_path": stats} if stats else {},
        evict_prompt=evict_prompt,
        page_size=page_size,
        tier_pool_share=0.5,
    )
    if candidate.bits is not None:
        fields.update(
            tier_bits=candidate.bits,
            tier_group_tokens=candidate.group_tokens,
            tier_outlier_tokens=candidate.outlier_tokens,
            tier_value_group_channels=candidate.value_group_channels,
            tier_max_tokens=spent.tier_tokens,
        )
    return EvictionConfig(**fields)


@dataclass(frozen=True)
class Held:
    """What a request holds: full-precision tokens, tier tokens, all its tokens, and the
    bytes as a fraction of all its tokens in full precision."""

    full_tokens: int
    tier_tokens: int
    all_tokens: int
    fraction: float


def held_now(driver, req, shape: Shape) -> Held:
    """What ``req`` holds now (``Held``)."""
    from sglang_evict.tier.policy import full_bytes_per_token, kv_bytes

    kv_len = driver.kv(req).kv_committed_len
    offset = 0 if driver.evictor is None else driver.evictor.position_offset(req.rid)
    arena = driver.tier_arena
    if arena is None:
        return Held(kv_len, 0, kv_len + offset, kv_len / (kv_len + offset))
    args = dict(layers=shape.num_layers, kv_heads=shape.num_kv_heads, full_dtype=BYTES_DTYPE)
    tier = arena.tokens_of(req.rid)
    held = kv_bytes(full_tokens=kv_len, tier_tokens=tier, fmt=arena.fmt, **args)
    full = full_bytes_per_token(arena.fmt, **args) * (kv_len + offset)
    return Held(kv_len, tier, kv_len + offset, held / full)


def needle_answer(
    model, prompt_ids, config: EvictionConfig | None, *, max_new_tokens: int, shape: Shape
) -> tuple[list[int], Held | None, int]:
    """Greedy answer ids of one needle prompt through the paged reference path
    (``config`` None: the full cache), what it held right after the prompt's pass
    (the decode step after prefill; None without one), and the passes run."""
    from sglang_evict.models.reference_loop import GenerationRequest, generate
    from sglang_evict.srt.cpu_driver import MemoryDriver

    length = len(prompt_ids)
    page = 16 if config is None else config.page_size
    num_tokens = 2 * (length + max_new_tokens + 4 * page)  # half of it the tier's arena
    driver = MemoryDriver.for_model(
        model,
        page_size=page,
        num_tokens=num_tokens,
        config=config,
        max_requests=2,
        max_context=length + max_new_tokens + 2 * page,
    )
    held: list[Held] = []

    def on_step(step, result):
        if result.passes and not held:  # right after the prompt's pass
            for req in driver.running.values():
                held.append(held_now(driver, req, shape))

    result = generate(
        driver,
        model,
        [GenerationRequest("q", list(prompt_ids), max_new_tokens)],
        on_step=on_step,
    )
    return result.outputs["q"], (held[0] if held else None), len(result.passes)
