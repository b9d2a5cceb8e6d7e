"""``window``: attention of the last W captured queries over the cache.

SnapKV (Li et al. 2024) sums the softmax weights that an observation window of recent
queries puts on each cached token; TOVA (Oren et al. 2024) uses only the newest query;
H2O (Zhang et al. 2023) accumulates the weights over every decoding step. All three
signals are computed here from the cached keys and the queries captured by the plugin,
never by an eager attention pass of the model: the serving attention backend is
untouched.

Modes:
    ``sum``        SnapKV: softmax weights summed over the window's queries.
    ``last``       TOVA: the newest query's softmax weights.
    ``cumulative`` H2O-style: ``sum`` plus the scores this token accumulated in earlier
                   passes (``view.accumulated_scores``, kept by the mechanism). Needs
                   ``head_normalization="none"``: z-scores of different passes do not add.

A query only sees keys at logical positions <= its own (causal). ``pool_kernel`` > 1
max-pools the weights over neighbouring tokens (SnapKV's clustering, kernel 7 there).

Batched form (``batch_head_scores``, what a server's pass runs): every due request at
once, one layer at a time, from the query ring (``BatchKVView.queries``): the logits of
a layer are ``[R, q_heads, W, N]``, never ``N x N``; padding entries and ring cells not
holding one of the request's last ``W`` queries are masked out. Columns are in row order
(not logical order after a ``hole_fill`` pass), so pooling sorts each request's tokens
by position first. The same weights as the per-request form, up to float rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from sglang_evict.scorers.base import BatchKVView, KVView, Scorer, expand_kv_heads

WINDOW_MODES = ("sum", "last", "cumulative")


def weights_from_logits(
    logits: Tensor, positions: Tensor, query_positions: Tensor, mode: str, pool_kernel: int
) -> Tensor:
    """float32 ``[layers, q_heads, tokens]`` from ``q·k/sqrt(d)`` logits ``[layers,
    q_heads, window, tokens]``: causal softmax per query, reduced over queries by
    ``mode``, optionally max-pooled over neighbouring tokens."""
    # [window, tokens]: a query at position p sees keys at positions <= p.
    visible = positions.unsqueeze(0) <= query_positions.unsqueeze(1)
    if mode == "last":
        logits, visible = logits[:, :, -1:], visible[-1:]
    logits = logits.masked_fill(~visible.to(logits.device)[None, None], float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a query seeing nothing -> 0
    scores = weights.sum(dim=2)
    if pool_kernel > 1:
        flat = scores.reshape(-1, 1, scores.shape[-1])
        pooled = F.max_pool1d(flat, pool_kernel, stride=1, padding=pool_kernel // 2)
        scores = pooled.reshape(scores.shape)
    return scores


def window_attention_weights(view: KVView, mode: str, pool_kernel: int) -> Tensor:
    """float32 ``[layers, q_heads, tokens]``: softmax attention weight of the window's
    queries on each cached token, reduced over queries by ``mode``."""
    if view.queries is None or view.query_positions is None:
        raise ValueError("window attention needs captured queries and their positions")
    scale = 1.0 / math.sqrt(view.keys.shape[-1])
    logits = []
    for layer in range(view.keys.shape[0]):  # one layer at a time bounds memory to W x N per head
        queries = view.queries[layer].float()
        keys = expand_kv_heads(view.keys[layer].float(), queries.shape[1])
        logits.append(torch.einsum("whd,nhd->hwn", queries, keys) * scale)
    return weights_from_logits(
        torch.stack(logits), view.positions, view.query_positions, mode, pool_kernel
    )


def pool_in_logical_order(scores: Tensor, positions: Tensor, valid: Tensor, kernel: int) -> Tensor:
    """Max-pool ``scores [..., R, N]`` over each request's neighbouring tokens in logical
    order (``positions [R, N]``; invalid entries neither count nor matter)."""
    if kernel <= 1:
        return scores
    last = torch.iinfo(torch.int64).max
    order = torch.where(valid, positions, last).argsort(dim=-1)  # padding last
    index = order.expand_as(scores)
    ordered = scores.masked_fill(~valid, float("-inf")).gather(-1, index)
    flat = ordered.reshape(-1, 1, ordered.shape[-1])
    pooled = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2).reshape(ordered.shape)
    return torch.empty_like(scores).scatter_(-1, index, pooled).masked_fill(~valid, 0.0)


def batch_window_weights(view: BatchKVView, mode: str, pool_kernel: int) -> Tensor:
    """float32 ``[layers, q_heads, R, N]``: the softmax weight the captured queries of
    each request put on each of its tokens, reduced over queries by ``mode`` (``sum`` or
    ``last``), pooled over ``pool_kernel`` neighbours. No host synchronisation."""
    window = view.queries
    if window is None:
        raise ValueError(
            "window attention needs the requests' captured queries; this manager has no "
            "query ring (query capture in the attention is off)"
        )
    cells = window.valid
    if mode == "last":  # the newest captured query only
        newest = torch.where(cells, window.positions, -1).amax(dim=1, keepdim=True)
        cells = cells & (window.positions == newest)
    # [R, W, N]: a query sees the request's keys at positions <= its own.
    visible = (
        (view.positions.unsqueeze(1) <= window.positions.unsqueeze(2))
        & cells.unsqueeze(2)
        & view.valid.unsqueeze(1)
    )
    layers = []
    for layer in range(window.num_layers):  # bounds memory to R x q_heads x W x N
        queries = window.queries_of_layer(layer).float()  # [R, W, Hq, D]
        keys = view.layer_keys(layer)  # [R, N, Hkv, D]
        num_q_heads, head_dim = queries.shape[2], queries.shape[3]
        group = num_q_heads // keys.shape[2]
        keys = keys.repeat_interleave(group, dim=2)  # [R, N, Hq, D], GQA groups
        logits = torch.einsum("rwhd,rnhd->rhwn", queries, keys) / math.sqrt(head_dim)
        logits = logits.masked_fill(~visible.unsqueeze(1), float("-inf"))
        weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a query seeing nothing
        layers.append(weights.sum(dim=2))  # [R, Hq, N]
    scores = torch.stack(layers).transpose(1, 2)  # [L, Hq, R, N]
    return pool_in_logical_order(scores, view.positions, view.valid, pool_kernel)


@dataclass(frozen=True, kw_only=True)
class WindowScorer(Scorer):
    name = "window"
    graph_safe = True
    needs_queries = True
    mode: str = "sum"
    pool_kernel: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in WINDOW_MODES:
            raise ValueError(f"unknown window mode {self.mode!r}; known: {list(WINDOW_MODES)}")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel={self.pool_kernel} must be an odd integer >= 1")
        if self.mode == "cumulative" and self.head_normalization != "none":
            raise ValueError(
                "window mode 'cumulative' adds scores across passes, which z-scores do not "
                "support; set head_normalization='none'"
            )

    @property
    def carries_scores(self) -> bool:
        return self.mode == "cumulative"

    def head_scores(self, view: KVView) -> Tensor:
        return window_attention_weights(view, self.mode, self.pool_kernel)

    def batch_head_scores(self, view: BatchKVView) -> Tensor:
        return batch_window_weights(
            view, "last" if self.mode == "last" else "sum", self.pool_kernel
        )

    def batch_scores(self, view: BatchKVView) -> Tensor:
        scores = super().batch_scores(view)
        if self.mode == "cumulative" and view.accumulated_scores is not None:
            scores = scores + view.accumulated_scores.to(scores)
        return scores

    def score(self, view: KVView) -> Tensor:
        scores = super().score(view)
        if self.mode == "cumulative" and view.accumulated_scores is not None:
            scores = scores + view.accumulated_scores.to(scores)
        return scores
