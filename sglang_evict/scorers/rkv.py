"""``rkv``: importance combined with redundancy (R-KV, Cai et al. 2025).

Reasoning traces repeat themselves; R-KV evicts near-duplicate steps first. Per
(layer, kv head):

    importance  = window attention weights of the captured queries (SnapKV signal,
                  averaged over the query heads of the GQA group, max-pooled)
    redundancy  = mean cosine similarity of the token's key to every other cached key
    score       = mix_lambda * z(importance) - (1 - mix_lambda) * z(redundancy)

``z`` is a z-score over the request's tokens, so the two terms share a scale before
they mix. ``mix_lambda`` = 0.1 and ``pool_kernel`` = 7 follow the R-KV paper's
defaults. Cost: O(tokens^2) per head for the similarity, computed one layer at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sglang_evict.scorers.base import KVView, Scorer
from sglang_evict.scorers.window import window_attention_weights

_EPS = 1e-6


def _zscore(x: Tensor) -> Tensor:
    return (x - x.mean(dim=-1, keepdim=True)) / (x.std(dim=-1, keepdim=True, unbiased=False) + _EPS)


def key_redundancy(keys_layer: Tensor) -> Tensor:
    """float32 ``[kv_heads, tokens]``: mean cosine similarity of each key to the others."""
    unit = torch.nn.functional.normalize(keys_layer.float(), dim=-1).transpose(0, 1)
    similarity = unit @ unit.transpose(1, 2)  # [kv_heads, tokens, tokens]
    num_tokens = similarity.shape[-1]
    if num_tokens < 2:
        return torch.zeros(similarity.shape[:2])
    off_diagonal_sum = similarity.sum(dim=-1) - similarity.diagonal(dim1=-2, dim2=-1)
    return off_diagonal_sum / (num_tokens - 1)


@dataclass(frozen=True, kw_only=True)
class RKVScorer(Scorer):
    name = "rkv"
    needs_queries = True
    mix_lambda: float = 0.1
    pool_kernel: int = 7

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise ValueError(f"mix_lambda={self.mix_lambda} is out of range; allowed: [0, 1]")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel={self.pool_kernel} must be an odd integer >= 1")

    def head_scores(self, view: KVView) -> Tensor:
        num_layers, _, num_kv_heads, _ = view.keys.shape
        weights = window_attention_weights(view, "sum", self.pool_kernel)  # [L, Hq, N]
        group = weights.shape[1] // num_kv_heads
        importance = weights.reshape(num_layers, num_kv_heads, group, -1).mean(dim=2)
        redundancy = torch.stack([key_redundancy(view.keys[layer]) for layer in range(num_layers)])
        return self.mix_lambda * _zscore(importance) - (1.0 - self.mix_lambda) * _zscore(
            redundancy.to(importance)
        )
