"""``random``: uniform random scores, a baseline for evaluations.

Deterministic: the generator is seeded from ``seed`` and the request's current
position, so tensor-parallel ranks (and reruns) draw the same survivors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sglang_evict.scorers.base import KVView, Scorer


@dataclass(frozen=True, kw_only=True)
class RandomScorer(Scorer):
    name = "random"
    seed: int = 0

    def score(self, view: KVView) -> Tensor:
        generator = torch.Generator(device="cpu")
        generator.manual_seed((self.seed * 1_000_003 + view.current_position) % (1 << 63))
        return torch.rand(view.num_tokens, generator=generator).to(view.keys.device)
