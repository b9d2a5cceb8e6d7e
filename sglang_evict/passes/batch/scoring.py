"""Scores of every due request of a batched pass, ``[R, N]`` on the pool's device.

A scorer with a batched form (``Scorer.batch_scores``: ``knorm`` reads every token's
key norm in one kernel launch or one gather per layer, ``streaming`` returns the
positions, ``window`` and ``rkv`` read the captured queries of every request at once,
``random`` draws on the host) scores the whole batch at once; the torch forms read keys
one layer at a time (``BatchKVView.layer_keys``). The others are scored one request at
a time through the scorer's own ``score(KVView)``, tokens in logical order as that
contract says (``request_view``): a loop over requests (not tokens), each a few
launches.

Requests of one pass may have chosen different scorers (a per-request policy):
``score_rows`` groups the rows by scorer and scores each group as its own batch
(``BatchKVView.select_rows``). Selection is per row, so scores of different scorers
never meet.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch
from torch import Tensor

from sglang_evict.scorers.base import BatchKVView, KVView, Scorer
from sglang_evict_kernels import device_int64

logger = logging.getLogger(__name__)


def request_view(view: BatchKVView, r: int, order: Tensor) -> KVView:
    """Request ``r``'s ``KVView``, its tokens taken in ``order`` (its columns in logical
    order): the per-request form, for scorers without a batched one."""
    queries = query_positions = accumulated = None
    if view.queries is not None:
        queries, query_positions = view.queries.request_queries(r)
    length = view.lengths[r]
    if view.accumulated_scores is not None:
        accumulated = view.accumulated_scores[r, :length][order]
    return KVView(
        keys=view.gather_keys(view.slots[r, :length][order]),
        positions=view.positions[r, :length][order],
        current_position=view.current_positions_host[r],
        queries=queries,
        query_positions=query_positions,
        accumulated_scores=accumulated,
    )


def score_batch(scorer: Scorer, view: BatchKVView) -> Tensor:
    """float32 ``[R, N]``, higher = keep; padding columns hold 0."""
    scores = scorer.batch_scores(view)
    if scores is not None:
        return scores.float()
    out = torch.zeros(view.slots.shape, dtype=torch.float32, device=view.slots.device)
    for r, length in enumerate(view.lengths):
        if length == 0:  # a padded request (``passes.batch.shapes``): nothing to score
            continue
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
            scores = scorer.score(request_view(view, r, order))
        out[r, :length] = torch.zeros_like(scores).scatter_(0, order, scores.float())
    return out


def score_rows(scorers: Sequence[Scorer], view: BatchKVView) -> Tensor:
    """float32 ``[R, N]``: row ``r`` scored by ``scorers[r]``. One ``score_batch`` per
    distinct scorer, over that scorer's rows only (the whole batch when all agree)."""
    groups: dict[int, list[int]] = {}
    for r, scorer in enumerate(scorers):
        groups.setdefault(id(scorer), []).append(r)
    if len(groups) == 1:
        return score_batch(scorers[0], view)
    out = torch.zeros(view.slots.shape, dtype=torch.float32, device=view.slots.device)
    for rows in groups.values():
        index = device_int64(rows, view.slots.device)
        sub = view.select_rows(rows, index)
        out.index_copy_(0, index, score_batch(scorers[rows[0]], sub))
    return out


def score_rows_or_fall_back(scorers: Sequence[Scorer], view: BatchKVView) -> tuple[Tensor, bool]:
    """``(score_rows(scorers, view), False)``; where the pool-reading kernels raise (a
    Triton kernel that does not compile or launch on this GPU: raised on the host before
    any of its device work), the torch forms' scores and True, so the caller stops asking
    for the kernels. Scoring changes no state, so scoring again is safe; a failure of
    the torch forms propagates (the pass is then skipped before anything moved)."""
    if not view.use_pool_kernels:
        return score_rows(scorers, view), False
    try:
        return score_rows(scorers, view), False
    except Exception as error:
        logger.error(
            "sglang-evict: a pool-reading scoring kernel failed (%s: %s); this and later "
            "passes score with the torch forms (same survivors, more device work)",
            type(error).__name__,
            error,
        )
        return score_rows(scorers, dataclasses.replace(view, use_pool_kernels=False)), True
