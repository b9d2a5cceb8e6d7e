"""The shapes of a batched pass: exact, or padded to buckets (a static-shape pass).

Every device tensor of a pass is sized by six host ints (``PassShape``). The exact
pass sizes them by the due requests (the longest row, the most survivors, ...), so two
passes rarely share a shape. The static-shape pass rounds each up to a bucket of a
fixed ladder, so passes of a server in steady state share a handful of shapes and each
shape can be captured once as a CUDA graph and replayed (``sglang_evict.passes.graphs``).

    field           exact                              static (bucketed)
    requests        due requests R                     next power of two
    width           longest row, whole pages (N)       pages on the ladder, <= row capacity
    survivors       most survivors (K)                 ladder, <= width
    evicted         most evicted (top-k size)          ladder, <= width
    released        pages the allocator gets back      ladder (the tail is 0: sliced off
                                                       on the host, which knows the count)
    staging_width   most staging pages of a request    ladder (0 stays 0)
    staging_total   staging pages claimed              ladder (0 stays 0)

Padding is a no-op by construction: padded requests have ``kv_len`` 0 (no entry is
valid, nothing survives, moves are ``0 -> 0`` self-moves the repack skips, no page is
released) and repeat request 0's writes (``inputs.COLUMNS``' ``alias``), padded columns
are invalid entries, a larger top-k picks padding keys a per-row cut drops, and the
plan's released-page list is compact with its tail 0. ``tests/test_static_shape_pass``
holds the padded pass to the exact one on generated batches.

The ladder is ``1, 2, 3, 4, 6, 8, 12, 16, 24, ...`` (powers of two and 1.5 times
them): a bucket is at most 1.5x (3/2) its content past 2, so padding at most adds half
of a pass's device work, and a decade of sizes is six buckets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglang_evict.passes.batch.counts import BatchCounts, ceil_div


def ladder_bucket(n: int) -> int:
    """The smallest of ``1, 2, 3, 4, 6, 8, 12, 16, 24, ...`` that is ``>= n`` (0 for 0)."""
    if n < 0:
        raise ValueError(f"a bucket of a negative size {n}")
    if n <= 4:
        return n
    power = 1 << (n - 1).bit_length()  # the next power of two >= n
    three_halves = 3 * power // 4
    return three_halves if three_halves >= n else power


def power_of_two_bucket(n: int) -> int:
    """The smallest power of two ``>= n`` (0 for 0)."""
    if n < 0:
        raise ValueError(f"a bucket of a negative size {n}")
    return 0 if n == 0 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class PassShape:
    """The six sizes of a pass's device tensors (module docstring)."""

    requests: int
    width: int
    survivors: int
    evicted: int
    released: int
    staging_width: int
    staging_total: int


def pass_shape(
    counts: BatchCounts,
    staging_counts: np.ndarray,
    *,
    page_size: int,
    row_capacity: int,
    static: bool,
) -> PassShape:
    """The exact shape of a pass over ``counts``, or (``static``) its bucket."""
    if not len(counts):
        raise ValueError("a pass needs at least one request")
    # Python's max/sum over short lists: cheaper on the host than numpy reductions.
    staging = staging_counts.tolist()
    staging_total = sum(staging)
    width = min(ceil_div(max(counts.kv_len.tolist()), page_size) * page_size, row_capacity)
    exact = PassShape(
        requests=len(counts),
        width=width,
        survivors=max(counts.survivors.tolist()),
        evicted=max(counts.tokens_evicted.tolist()),
        released=sum(counts.pages_freed.tolist()) + staging_total,
        staging_width=max(staging),
        staging_total=staging_total,
    )
    if not static:
        return exact
    width = min(ladder_bucket(ceil_div(exact.width, page_size)) * page_size, row_capacity)
    return PassShape(
        requests=power_of_two_bucket(exact.requests),
        width=width,
        survivors=min(ladder_bucket(exact.survivors), width),
        evicted=min(ladder_bucket(exact.evicted), width),
        released=ladder_bucket(exact.released),
        staging_width=ladder_bucket(exact.staging_width),
        staging_total=ladder_bucket(exact.staging_total),
    )
