"""Scores of every due request of a batched pass, ``[R, N]`` on the pool's device.

A scorer with a batched form (``Scorer.batch_scores``: ``knorm`` reads every token's
key norm in one kernel launch or one gather, ``streaming`` returns the positions)
scores the whole batch at once. The others are scored one request at a time through
the scorer's own ``score(KVView)``, tokens in logical order as that contract says: a
loop over requests (not tokens), each a few launches, and, for query-reading scorers
(``window``, ``rkv``), the queries the CPU loop captured (``EvictionManager.
record_queries``). A device ring of queries indexed by request-pool row plugs in here
as a batched form of those scorers.

Requests of one pass may have chosen different scorers (a per-request policy):
``score_rows`` groups the rows by scorer and scores each group as its own batch.
Selection is per row, so scores of different scorers never meet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from sglang_evict.scorers.base import BatchKVView, KVView, Scorer
from sglang_evict_kernels import device_int64

# (request index, its tokens' columns in logical order) -> that request's KVView.
RequestView = Callable[[int, Tensor], KVView]


def score_batch(scorer: Scorer, view: BatchKVView, request_view: RequestView) -> Tensor:
    """float32 ``[R, N]``, higher = keep; padding columns hold 0."""
    scores = scorer.batch_scores(view)
    if scores is not None:
        return scores.float()
    out = torch.zeros(view.slots.shape, dtype=torch.float32, device=view.slots.device)
    for r, length in enumerate(view.lengths):
        order = torch.argsort(view.positions[r, :length])  # logical order
        per_head = None
        if view.use_pool_kernels and not scorer.needs_queries:
            per_head = scorer.pool_head_scores(
                view.k_buffers,
                view.slots[r, :length][order],
                view.current_positions_host[r],
                check_slots=False,
            )
        if per_head is not None:
            scores = scorer.aggregate(per_head)
        else:
            scores = scorer.score(request_view(r, order))
        out[r, :length] = torch.zeros_like(scores).scatter_(0, order, scores.float())
    return out


def score_rows(scorers: Sequence[Scorer], view: BatchKVView, request_view: RequestView) -> Tensor:
    """float32 ``[R, N]``: row ``r`` scored by ``scorers[r]``. One ``score_batch`` per
    distinct scorer, over that scorer's rows only (the whole batch when all agree)."""
    groups: dict[int, list[int]] = {}
    for r, scorer in enumerate(scorers):
        groups.setdefault(id(scorer), []).append(r)
    if len(groups) == 1:
        return score_batch(scorers[0], view, request_view)
    out = torch.zeros(view.slots.shape, dtype=torch.float32, device=view.slots.device)
    for rows in groups.values():
        index = device_int64(rows, view.slots.device)
        sub = view.select_rows(rows, index)

        def sub_request_view(r: int, order: Tensor, rows=rows) -> KVView:
            return request_view(rows[r], order)

        out.index_copy_(0, index, score_batch(scorers[rows[0]], sub, sub_request_view))
    return out
