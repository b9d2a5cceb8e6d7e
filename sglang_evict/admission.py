"""How much KV an evicting request can still take, and which requests relieve a decode
step that cannot allocate: pure arithmetic on host ints, no SGLang, no device data.

SGLang reserves for a request the rest of its ``max_new_tokens`` (clipped, and scaled
by its ``new_token_ratio`` once running). Under a budget an evicting request never
holds more than

    peak = max(kv_now, survivors_cap + cadence + pass_group_steps - 1) + page_size

tokens, where ``survivors_cap = max(budget, lead_end + window)`` is the most a pass
ever keeps (``sglang_evict.passes.batch.counts``: the protected leading range
``[0, lead_end)`` and the recent window, or the budget when larger). A pass is due
once the request holds ``cadence`` tokens more than a pass would keep, so between two
passes it grows by less than ``cadence``; a step that finds a pass due runs it before
the step's allocation, and the allocator hands out whole pages (the ``page_size``).
With ``pass_group_steps`` G > 1, passes run on every G-th step only, so a due request
may add up to G - 1 more tokens before its pass.
So the tokens it may still add are ``peak - kv_now``, however long it generates:
``growth_tokens``. ``sglang_evict.srt.admission`` puts that figure into SGLang's own
admission arithmetic.

Under the quantized tier a request also holds up to ``tier_tokens / G`` groups of the
tier's arena, which lives outside SGLang's pool: ``tier_admits`` admits a request only
when the arena can hold its groups beside those its running and admitted requests may
hold, so the arena never turns groups away for lack of room (they would be dropped,
as beyond the tier).

When a decode step cannot allocate, ``choose_pressure_passes`` picks the requests to
compact early: the most evictable first, until the pages they free cover the
shortfall.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ADMISSIONS = ("bounded", "sglang")


def survivors_cap(*, lead_end: int, window_tokens: int, budget: int) -> int:
    """The most tokens a pass ever leaves a request: its budget, or its protected
    tokens when they alone exceed it (the leading range ``[0, lead_end)`` of
    ``sglang_evict.passes.batch.counts`` is fixed for the request's life, and the recent
    window is ``window_tokens`` long)."""
    return max(budget, lead_end + window_tokens)


def growth_tokens(
    *, kv_len: int, survivors_cap: int, cadence: int, page_size: int, pass_group_steps: int = 1
) -> int:
    """KV tokens a request holding ``kv_len`` may still add (module docstring)."""
    if kv_len < 0 or cadence < 1 or page_size < 1 or pass_group_steps < 1:
        raise ValueError(
            f"kv_len={kv_len}, cadence={cadence}, page_size={page_size}, "
            f"pass_group_steps={pass_group_steps}"
        )
    peak_before_page = survivors_cap + cadence + pass_group_steps - 1
    return max(peak_before_page - kv_len, 0) + page_size


def bounded_new_tokens(sglang_new_tokens: int, growth: int) -> int:
    """What admission counts for an evicting request's further KV: SGLang's figure of
    its further tokens (the rest of ``max_new_tokens``, clipped), capped by what
    eviction lets its KV grow. Not scaled by SGLang's ``new_token_ratio`` (its guess at
    how early requests stop): the bound holds however long the request runs, so
    counting all of it keeps admitted requests from ever outgrowing the pool."""
    return min(sglang_new_tokens, growth)


def tier_admits(*, reserved_groups: int, request_groups: int, arena_groups: int) -> bool:
    """Whether a request whose tier may hold ``request_groups`` groups fits an arena of
    ``arena_groups`` beside the ``reserved_groups`` its running and admitted requests
    may hold. A request asking more than the whole arena is admitted once nothing else
    holds any (its groups beyond the arena are dropped, as beyond its tier)."""
    if min(reserved_groups, request_groups, arena_groups) < 0:
        raise ValueError(
            f"reserved_groups={reserved_groups}, request_groups={request_groups}, "
            f"arena_groups={arena_groups}"
        )
    if request_groups == 0:
        return True
    return reserved_groups + min(request_groups, arena_groups) <= arena_groups


@dataclass(frozen=True)
class PressureCandidate:
    """A running request a pass could compact now (host counts)."""

    index: int  # its index in the decode batch
    tokens_evicted: int  # what a pass would evict now (> 0)
    pages_freed: int  # what that pass would give the allocator


def choose_pressure_passes(
    candidates: Sequence[PressureCandidate], shortfall_tokens: int, page_size: int
) -> list[int]:
    """Batch indices to compact early, most evictable first, until their freed pages
    cover ``shortfall_tokens``; all of them when even that is not enough (SGLang then
    retracts for the rest). Ties go to the earlier batch index."""
    if shortfall_tokens <= 0:
        return []
    chosen, freed_tokens = [], 0
    for candidate in sorted(candidates, key=lambda c: (-c.tokens_evicted, c.index)):
        if freed_tokens >= shortfall_tokens:
            break
        if candidate.pages_freed <= 0:
            continue  # evicting inside its last page frees nothing now
        chosen.append(candidate.index)
        freed_tokens += candidate.pages_freed * page_size
    return sorted(chosen)
