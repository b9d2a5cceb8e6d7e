"""What a pass will do to one request, computed on the host from lengths it already
knows: never from device data.

The batched pass (``sglang_evict.passes.batch``) must size every device tensor, give the
allocator a tensor of known length and shrink SGLang's lengths without reading
anything back from the device. That works because the number of survivors follows from
counts alone:

    survivors = min(kv_len, max(budget, |protected|))

where the protected tokens are a union of two ranges of *logical positions*, each
fully present in the row:

    leading   [0, lead_end)               lead_end = max(sinks + protected prefix,
                                                         prompt_len  (unless evict_prompt),
                                                         frozen_len)
    recent    [next - window, next)       next = the next token's logical position

    frozen_len = min(ceil(num_shared / P) * P, kv_len): the shared (radix-tree owned)
    prefix rounded up to whole pages; its entries never move, so entry i holds
    position i there.

Why both ranges are present in full: every earlier pass protected them, the leading
range is fixed for a request's life, and the recent range only moves forward over
tokens appended since (``EvictionManager.check_request`` verifies it after every
operation in the tests). And if a future policy protected more than an earlier pass
did, the count would only over-estimate the protected tokens actually present, which
keeps the survivor count reachable: the device selection evicts exactly
``kv_len - survivors`` unprotected tokens, and at least that many exist.

Diagram (kv_len 12 after an earlier pass, next = 20, lead_end 4, window 3)::

    logical positions held   0 1 2 3 . . 6 . 8 9 . . . 13 . 15 16 17 18 19
    protected                [leading ]                          [ recent ]
    |protected| = 4 + 3 = 7 (the ranges do not overlap here)

A pass is due when the request holds ``cadence`` tokens more than a pass would keep
(``kv_len - survivors >= cadence``): with the usual budget > protected this is the
trigger ``kv_len >= budget + cadence``; when the protected tokens alone exceed the
budget (a long protected prompt), the request still runs at most one pass per
``cadence`` tokens it generates, each evicting at least ``cadence`` tokens, instead of
a pass per step evicting one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PassCounts:
    """Host-known counts of one request's pass (all ints; ``survivors`` etc. as above).

    Attributes:
        kv_len: row entries in use before the pass.
        next_position: logical position of the next token (``kv_len + offset``).
        lead_end, window_start: the protected ranges ``[0, lead_end)`` and
            ``[window_start, next_position)`` of logical positions.
        frozen_len: leading row entries that never move (whole shared pages).
        num_protected: ``|protected|``.
        survivors: the request's KV length after the pass.
        pages_before, pages_after: ``ceil(tokens / page_size)`` before and after.
        budget: the request's budget (a per-request policy plugs in here).
    """

    kv_len: int
    next_position: int
    lead_end: int
    window_start: int
    frozen_len: int
    num_protected: int
    survivors: int
    pages_before: int
    pages_after: int
    budget: int
    page_size: int

    @property
    def tokens_evicted(self) -> int:
        return self.kv_len - self.survivors

    @property
    def pages_freed(self) -> int:
        """Net pages the allocator gains: pages before - pages after."""
        return self.pages_before - self.pages_after

    @property
    def frozen_pages(self) -> int:
        """Whole leading pages that never move (``frozen_len`` is a multiple of the page
        size whenever a pass evicts anything: else every entry is protected)."""
        return self.frozen_len // self.page_size

    @property
    def protected_over_budget(self) -> bool:
        return self.num_protected > self.budget

    def staging_pages(self, strategy: str) -> int:
        """Fresh pages ``repack`` claims at most: every page it builds past the frozen
        ones (page size 1 builds nothing: each slot is its own page)."""
        if strategy != "repack" or self.page_size == 1:
            return 0
        return ceil_div(self.survivors - self.frozen_len, self.page_size)


def protected_count(
    kv_len: int,
    position_offset: int,
    num_shared: int,
    prompt_len: int,
    page_size: int,
    sink_tokens: int,
    protected_tokens: int,
    window_tokens: int,
    evict_prompt: bool,
) -> tuple[int, int, int, int, int]:
    """``(next_position, frozen_len, lead_end, window_start, num_protected)`` of a
    request holding ``kv_len`` entries (module docstring): the arithmetic of
    ``pass_counts``, positional host ints and no object, because the decode step's due
    check asks it of every request past its budget at every step."""
    next_position = kv_len + position_offset
    frozen_len = min(-(-num_shared // page_size) * page_size, kv_len)
    lead_end = max(sink_tokens + protected_tokens, 0 if evict_prompt else prompt_len, frozen_len)
    lead = min(lead_end, next_position)
    window_start = max(next_position - window_tokens, 0)
    overlap = max(0, lead - window_start)
    num_protected = min(lead + (next_position - window_start) - overlap, kv_len)
    return next_position, frozen_len, lead_end, window_start, num_protected


def pass_counts(
    *,
    kv_len: int,
    position_offset: int,
    num_shared: int,
    prompt_len: int,
    page_size: int,
    budget: int,
    sink_tokens: int,
    protected_tokens: int,
    window_tokens: int,
    evict_prompt: bool,
) -> PassCounts:
    """The counts of a pass over a request holding ``kv_len`` entries (see the module
    docstring); O(1), host ints only."""
    if kv_len < 0 or page_size < 1 or budget < 0:
        raise ValueError(
            f"kv_len={kv_len}, page_size={page_size}, budget={budget}: need kv_len >= 0, "
            f"page_size >= 1, budget >= 0"
        )
    next_position, frozen_len, lead_end, window_start, num_protected = protected_count(
        kv_len,
        position_offset,
        num_shared,
        prompt_len,
        page_size,
        sink_tokens,
        protected_tokens,
        window_tokens,
        evict_prompt,
    )
    survivors = min(kv_len, max(budget, num_protected))
    return PassCounts(
        kv_len=kv_len,
        next_position=next_position,
        lead_end=lead_end,
        window_start=window_start,
        frozen_len=frozen_len,
        num_protected=num_protected,
        survivors=survivors,
        pages_before=ceil_div(kv_len, page_size),
        pages_after=ceil_div(survivors, page_size),
        budget=budget,
        page_size=page_size,
    )


# Per-request page counts the batched planners use (``page_counts``), in this order.
PAGE_COUNTS = ("frozen_pages", "pages_before", "full_pages", "partial_len", "partial_page")


def page_counts(*, kv_len: int, survivors: int, frozen_len: int, page_size: int) -> tuple:
    """Host ints of ``PAGE_COUNTS`` for one request: whole frozen pages, pages before
    the pass, and the new row's layout past the frozen pages (``full_pages`` whole
    pages then, when ``partial_len`` > 0, one page holding that many at new-row page
    ``partial_page``)."""
    frozen_pages = frozen_len // page_size
    full_pages, partial_len = divmod(survivors - frozen_len, page_size)
    return (
        frozen_pages,
        ceil_div(kv_len, page_size),
        full_pages,
        partial_len,
        frozen_pages + full_pages,
    )


@dataclass(frozen=True)
class BatchCounts:
    """``PassCounts`` of every request of a pass at once: one int64 numpy array per
    field (``page_size`` is the server's). ``batch_pass_counts`` computes it with the
    arithmetic of ``pass_counts``, a few array operations for the whole batch, so the
    pass's host time does not grow by a Python object per due request."""

    kv_len: np.ndarray
    next_position: np.ndarray
    lead_end: np.ndarray
    window_start: np.ndarray
    frozen_len: np.ndarray
    num_protected: np.ndarray
    survivors: np.ndarray
    pages_before: np.ndarray
    pages_after: np.ndarray
    budget: np.ndarray
    page_size: int

    def __len__(self) -> int:
        return len(self.kv_len)

    @property
    def tokens_evicted(self) -> np.ndarray:
        return self.kv_len - self.survivors

    @property
    def pages_freed(self) -> np.ndarray:
        return self.pages_before - self.pages_after

    def take(self, index: np.ndarray) -> BatchCounts:
        """The counts of the requests ``index`` selects (a boolean mask or indices)."""
        arrays = {name: getattr(self, name)[index] for name in _ARRAYS}
        return BatchCounts(**arrays, page_size=self.page_size)

    def request(self, i: int) -> PassCounts:
        """Request ``i``'s ``PassCounts``."""
        values = {name: int(getattr(self, name)[i]) for name in _ARRAYS}
        return PassCounts(**values, page_size=self.page_size)

    def staging_pages(self, strategy: str) -> np.ndarray:
        """``PassCounts.staging_pages`` of every request."""
        if strategy != "repack" or self.page_size == 1:
            return np.zeros(len(self), dtype=np.int64)
        return ceil_div(self.survivors - self.frozen_len, self.page_size)

    def page_counts(self) -> tuple[np.ndarray, ...]:
        """``page_counts`` of every request, the arrays in ``PAGE_COUNTS`` order."""
        frozen_pages = self.frozen_len // self.page_size
        full_pages, partial_len = np.divmod(self.survivors - self.frozen_len, self.page_size)
        return frozen_pages, self.pages_before, full_pages, partial_len, frozen_pages + full_pages


_ARRAYS = tuple(f.name for f in fields(BatchCounts) if f.name != "page_size")


def batch_pass_counts(
    *,
    kv_len: np.ndarray,
    position_offset: np.ndarray,
    num_shared: np.ndarray,
    prompt_len: np.ndarray,
    budget: np.ndarray,
    page_size: int,
    sink_tokens: int,
    protected_tokens: int,
    window_tokens: int,
    evict_prompt: bool,
) -> BatchCounts:
    """``pass_counts`` of many requests (int64 arrays of one length; the config's ints
    are the server's): the same values, request for request."""
    if page_size < 1 or (len(kv_len) and (kv_len.min() < 0 or budget.min() < 0)):
        raise ValueError(
            f"kv_len {kv_len.tolist()}, page_size={page_size}, budget {budget.tolist()}: "
            f"need kv_len >= 0, page_size >= 1, budget >= 0"
        )
    next_position = kv_len + position_offset
    frozen_len = np.minimum(ceil_div(num_shared, page_size) * page_size, kv_len)
    lead_end = np.maximum(frozen_len, sink_tokens + protected_tokens)
    if not evict_prompt:
        lead_end = np.maximum(lead_end, prompt_len)
    lead = np.minimum(lead_end, next_position)
    window_start = np.maximum(next_position - window_tokens, 0)
    overlap = np.maximum(lead - window_start, 0)
    num_protected = np.minimum(lead + (next_position - window_start) - overlap, kv_len)
    survivors = np.minimum(kv_len, np.maximum(budget, num_protected))
    return BatchCounts(
        kv_len=kv_len,
        next_position=next_position,
        lead_end=lead_end,
        window_start=window_start,
        frozen_len=frozen_len,
        num_protected=num_protected,
        survivors=survivors,
        pages_before=ceil_div(kv_len, page_size),
        pages_after=ceil_div(survivors, page_size),
        budget=budget,
        page_size=page_size,
    )


def batch_strategy(
    configured: str, counts: BatchCounts, available_pages: Callable[[], int]
) -> tuple[str, np.ndarray]:
    """The batch's strategy and staging pages per request: ``repack`` claims an upper
    bound of staging pages; when the allocator (its host-known free count,
    ``available_pages()``) is short, the whole batch fills holes instead."""
    staging = counts.staging_pages(configured)
    total = int(staging.sum())
    if total and available_pages() < total:
        return "hole_fill", np.zeros(len(counts), dtype=np.int64)
    return configured, staging
