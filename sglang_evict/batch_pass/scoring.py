"""Scores of every due request of a batched pass, ``[R, N]`` on the pool's device.

A scorer with a batched form (``Scorer.batch_scores``: ``knorm`` reads every token's
key norm in one kernel launch or one gather, ``streaming`` returns the positions)
scores the whole batch at once. The others are scored one request at a time through
the scorer's own ``score(KVView)``, tokens in logical order as that contract says: a
loop over requests (not tokens), each a few launches, and, for query-reading scorers
(``window``, ``rkv``), the queries the CPU loop captured (``EvictionManager.
record_queries``). A device ring of queries indexed by request-pool row plugs in here
as a batched form of those scorers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from sglang_evict.scorers.base import BatchKVView, KVView, Scorer

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
