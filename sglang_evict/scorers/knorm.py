"""``knorm``: keys with a low L2 norm are important (Devoto et al., "A Simple and
Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP 2024).

Score-free and FlashAttention-compatible: it reads only the cached keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sglang_evict.scorers.base import BatchKVView, KVView, Scorer


@dataclass(frozen=True, kw_only=True)
class KNormScorer(Scorer):
    name = "knorm"
    graph_safe = True

    def pool_head_scores(
        self, k_buffers, slots: Tensor, current_position: int, *, check_slots: bool = True
    ) -> Tensor:
        from sglang_evict_kernels.scoring import key_norms_triton

        return -key_norms_triton(k_buffers, slots, check_slots=check_slots)

    def batch_head_scores(self, view: BatchKVView) -> Tensor:
        # Norms do not depend on the request: one launch for the batch, or one gather
        # per layer (one layer's keys of the pass at a time, never every layer's).
        num_requests, width = view.slots.shape
        if view.use_pool_kernels:  # lower norm = keep: the scores are -norms
            flat = view.slots.reshape(-1)
            scores = self.pool_head_scores(view.k_buffers, flat, 0, check_slots=False)
            return scores.reshape(*scores.shape[:2], num_requests, width)
        layers = range(len(view.k_buffers))
        norms = torch.stack([view.layer_keys(layer).norm(dim=-1) for layer in layers])
        return -norms.permute(0, 3, 1, 2)  # [L, R, N, H] -> [L, H, R, N]

    def head_scores(self, view: KVView) -> Tensor:
        # [layers, tokens, kv_heads] -> [layers, kv_heads, tokens]; lower norm = keep.
        norms = view.keys.float().norm(dim=-1)
        return (-norms).transpose(1, 2)
