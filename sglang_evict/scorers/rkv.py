"""``rkv``: importance combined with redundancy (R-KV, Cai et al. 2025).

Reasoning traces repeat themselves; R-KV evicts near-duplicate steps first. Per
(layer, kv head):

    importance  = window attention weights of the captured queries (SnapKV signal,
                  averaged over the query heads of the GQA group, max-pooled)
    redundancy  = mean cosine similarity of the token's key to every other cached key
    score       = mix_lambda * z(importance) - (1 - mix_lambda) * z(redundancy)

``z`` is a z-score over the request's tokens, so the two terms share a scale before
they mix. ``mix_lambda`` = 0.1 and ``pool_kernel`` = 7 follow the R-KV paper's
defaults.

Cost: the mean similarity needs no ``N x N`` matrix. With unit keys ``u_i`` and their
sum ``S`` over the request's tokens, ``sum_{j != i} u_i . u_j = u_i . S - u_i . u_i``,
so redundancy is O(tokens) per head, and the importance term is ``window``'s
(``W x N`` logits per layer). The batched form (``batch_head_scores``) scores every due
request of a pass at once from the query ring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sglang_evict.scorers.base import BatchKVView, KVView, Scorer
from sglang_evict.scorers.window import batch_window_weights, window_attention_weights
from sglang_evict_kernels.normalize import zscore_segments_reference

_EPS = 1e-6


def _zscore(x: Tensor) -> Tensor:
    return (x - x.mean(dim=-1, keepdim=True)) / (x.std(dim=-1, keepdim=True, unbiased=False) + _EPS)


def mean_similarity_to_others(unit: Tensor, valid: Tensor) -> Tensor:
    """float32 ``[..., N, heads]``: mean cosine similarity of each unit key ``unit
    [..., N, heads, D]`` to the other ``valid [..., N]`` keys of its request (0 when
    it has no other), as ``(u_i . S - u_i . u_i) / (n - 1)`` (module docstring)."""
    unit = unit * valid.unsqueeze(-1).unsqueeze(-1).to(unit.dtype)
    total = unit.sum(dim=-3, keepdim=True)  # [..., 1, heads, D]
    others = (unit * total).sum(dim=-1) - unit.square().sum(dim=-1)
    count = valid.sum(dim=-1, keepdim=True).unsqueeze(-1).to(unit.dtype)
    return others / (count - 1).clamp(min=1.0)


def key_redundancy(keys_layer: Tensor) -> Tensor:
    """float32 ``[kv_heads, tokens]``: mean cosine similarity of each key to the others."""
    unit = torch.nn.functional.normalize(keys_layer.float(), dim=-1)
    valid = torch.ones(unit.shape[0], dtype=torch.bool, device=unit.device)
    return mean_similarity_to_others(unit, valid).transpose(0, 1)


@dataclass(frozen=True, kw_only=True)
class RKVScorer(Scorer):
    name = "rkv"
    graph_safe = True
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

    def batch_head_scores(self, view: BatchKVView) -> Tensor:
        weights = batch_window_weights(view, "sum", self.pool_kernel)  # [L, Hq, R, N]
        num_layers, num_q_heads = weights.shape[:2]
        redundancy = []
        for layer in range(num_layers):
            unit = torch.nn.functional.normalize(view.layer_keys(layer), dim=-1)
            redundancy.append(mean_similarity_to_others(unit, view.valid).permute(2, 0, 1))
        redundancy = torch.stack(redundancy)  # [L, Hkv, R, N]
        num_kv_heads = redundancy.shape[1]
        importance = weights.reshape(
            num_layers, num_kv_heads, num_q_heads // num_kv_heads, *weights.shape[2:]
        ).mean(dim=2)
        return self.mix_lambda * zscore_segments_reference(importance, view.valid) - (
            1.0 - self.mix_lambda
        ) * zscore_segments_reference(redundancy, view.valid)
