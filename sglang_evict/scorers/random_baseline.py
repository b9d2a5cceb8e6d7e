"""``random``: uniform random scores, a baseline for evaluations.

Deterministic: the generator is seeded from ``seed`` and the request's current
position, so tensor-parallel ranks (and reruns) draw the same survivors.

The batched form draws each due request's numbers on the host exactly as ``score``
does (tokens in logical order) and places them with one copy to the device and one
scatter: no key is read, and the survivors are those of ``score``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sglang_evict.scorers.base import BatchKVView, KVView, Scorer
from sglang_evict_kernels import to_device

_LAST = torch.iinfo(torch.int64).max


@dataclass(frozen=True, kw_only=True)
class RandomScorer(Scorer):
    name = "random"
    seed: int = 0

    def _draw(self, num_tokens: int, current_position: int) -> Tensor:
        generator = torch.Generator(device="cpu")
        generator.manual_seed((self.seed * 1_000_003 + current_position) % (1 << 63))
        return torch.rand(num_tokens, generator=generator)

    def score(self, view: KVView) -> Tensor:
        return self._draw(view.num_tokens, view.current_position).to(view.keys.device)

    def batch_scores(self, view: BatchKVView) -> Tensor:
        drawn = torch.zeros(view.slots.shape, dtype=torch.float32)  # host; padding: 0
        for r, (length, current) in enumerate(
            zip(view.lengths, view.current_positions_host, strict=True)
        ):
            drawn[r, :length] = self._draw(length, current)
        # Column of each request's k-th token in logical order (padding columns last):
        # the k-th draw goes there, as ``score`` over the logical-order view.
        logical = torch.where(view.valid, view.positions, _LAST).argsort(dim=1)
        drawn = to_device(drawn, view.slots.device)
        return torch.zeros_like(drawn).scatter_(1, logical, drawn)
