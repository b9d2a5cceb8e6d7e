"""Survivor selection: pure functions from scores to the set of tokens a pass keeps.

Policy only: no slot, page or allocator is touched here. Inputs are per-token tensors
of one request in logical order (the order of the scorer's view); the output indexes
them.

Protected tokens (always kept):
    sinks               logical positions [0, sink_tokens)
    protected prefix    logical positions [sink_tokens, sink_tokens + protected_tokens)
    pinned              tokens the engine marks immovable (shared radix-prefix tokens)
                        or not candidates (unshared prompt tokens unless evict_prompt)
    recent window       the window_tokens tokens with the highest logical positions
Everything else competes on score for the rest of the budget. Ties are broken toward
the later index (the more recent token in logical order), deterministically, so
tensor-parallel ranks holding identical inputs keep identical survivors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SurvivorSelection:
    """Result of ``select_survivors``.

    Attributes:
        indices: int64, ascending indices of the kept tokens.
        num_protected: how many kept tokens were protected.
        protected_over_budget: protected tokens alone exceeded the budget; all of them
            were kept and nothing else was (the pass reports it).
    """

    indices: Tensor
    num_protected: int
    protected_over_budget: bool


def protected_mask(
    positions: Tensor,
    *,
    sink_tokens: int,
    protected_tokens: int,
    window_tokens: int,
    pinned: Tensor | None = None,
) -> Tensor:
    """bool ``[tokens]``: tokens no pass may evict (see the module docstring)."""
    if positions.dim() != 1:
        raise ValueError(f"positions must be 1-D, got shape {tuple(positions.shape)}")
    mask = positions < sink_tokens + protected_tokens
    if window_tokens > 0:
        num_recent = min(window_tokens, positions.numel())
        recent = torch.topk(positions, num_recent, largest=True, sorted=False).indices
        mask[recent] = True
    if pinned is not None:
        if pinned.shape != positions.shape or pinned.dtype != torch.bool:
            raise ValueError(
                f"pinned must be bool {tuple(positions.shape)}, got {pinned.dtype} "
                f"{tuple(pinned.shape)}"
            )
        mask |= pinned
    return mask


def select_survivors(scores: Tensor, budget: int, protected: Tensor) -> SurvivorSelection:
    """Keep every protected token, then the highest-scoring others up to ``budget``.

    Never returns fewer protected tokens than exist. Raises ``ValueError`` on shape
    mismatches, a negative budget, or non-finite scores among candidates (a scorer bug
    must not silently decide what is evicted).
    """
    if scores.dim() != 1 or protected.shape != scores.shape:
        raise ValueError(
            f"scores {tuple(scores.shape)} and protected {tuple(protected.shape)} must be "
            f"equal 1-D shapes"
        )
    if protected.dtype != torch.bool:
        raise ValueError(f"protected must be a bool mask, got {protected.dtype}")
    if budget < 0:
        raise ValueError(f"budget={budget} must be >= 0")
    protected_idx = torch.nonzero(protected, as_tuple=True)[0]
    num_protected = protected_idx.numel()
    free_slots = budget - num_protected
    candidates = torch.nonzero(~protected, as_tuple=True)[0]
    if free_slots <= 0 or candidates.numel() == 0:
        chosen = protected_idx
    else:
        candidate_scores = scores[candidates].float()
        if not torch.isfinite(candidate_scores).all():
            raise ValueError("scores contain NaN or infinity among evictable tokens")
        # Stable descending sort of the reversed candidates: equal scores keep reversed
        # index order, so the later token wins a tie.
        order = torch.sort(candidate_scores.flip(0), descending=True, stable=True).indices
        winners = candidates.flip(0)[order[:free_slots]]
        chosen = torch.cat([protected_idx, winners])
    return SurvivorSelection(
        indices=torch.sort(chosen).values.to(torch.int64),
        num_protected=num_protected,
        protected_over_budget=num_protected > budget,
    )
