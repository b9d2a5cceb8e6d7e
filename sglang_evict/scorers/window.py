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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from sglang_evict.scorers.base import KVView, Scorer, expand_kv_heads

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


@dataclass(frozen=True, kw_only=True)
class WindowScorer(Scorer):
    name = "window"
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

    def head_scores(self, view: KVView) -> Tensor:
        return window_attention_weights(view, self.mode, self.pool_kernel)

    def score(self, view: KVView) -> Tensor:
        scores = super().score(view)
        if self.mode == "cumulative" and view.accumulated_scores is not None:
            scores = scores + view.accumulated_scores.to(scores)
        return scores
