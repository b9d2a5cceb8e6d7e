"""Batched survivor selection on the device: every due request of a pass at once.

Same rule as ``sglang_evict.passes.selection.select_survivors`` (the reference, tested
against this): keep every protected token, then the best-scoring others up to the
request's budget; ties go to the later token in logical order. Per request ``r`` the
host already knows how many tokens go (``num_evicted[r] = kv_len - survivors``, see
``counts``), so instead of a top-k of the survivors (thousands per request) this takes
the bottom-``num_evicted`` of the candidates (about ``cadence`` per request), with one
``topk`` over the padded batch and a per-row cut.

The order is a total order on one int64 key per token, so ties cannot depend on the
sort algorithm or the device:

    key = sortable(score) * 2^32 + position        (lower key = evicted first)

``sortable`` maps a float32 to an int32 with the same order (the sign-magnitude bits
flipped for negatives; ``-0.0`` is first made ``+0.0``). Equal scores then order by
position, so the earlier token goes first and the later one stays: the reference's
tie rule. Protected and padding entries get the largest int64 and are never chosen
(positions are below 2^31, so no real key reaches it).

NaN scores cannot raise here (that would need the host to read device data): a NaN is
scored as ``-inf``, evicted first, and counted on the device
(``num_nonfinite``) for the caller to report off the hot path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sglang_evict.passes.batch.indices import arange

_NEVER = torch.iinfo(torch.int64).max
_LOW_31_BITS = 0x7FFFFFFF


def eviction_keys(scores: Tensor, positions: Tensor) -> Tensor:
    """int64 key per token: lower = evicted first (see the module docstring).

    ``scores`` float ``[..., N]``, ``positions`` int ``[..., N]`` in ``[0, 2^31)``.
    """
    return _keys_of(_nan_as_lowest(scores), positions)


def _nan_as_lowest(scores: Tensor) -> Tensor:
    """float32 scores with NaN as ``-inf`` and ``-0.0`` as ``+0.0``."""
    inf = float("inf")
    return torch.nan_to_num(scores.float(), nan=-inf, posinf=inf, neginf=-inf) + 0.0


def _keys_of(scores: Tensor, positions: Tensor) -> Tensor:
    bits = scores.contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ _LOW_31_BITS, bits).to(torch.int64)
    return ordered * (1 << 32) + positions.to(torch.int64)


def protected_ranges_mask(
    positions: Tensor, valid: Tensor, lead_end: Tensor, window_start: Tensor
) -> Tensor:
    """bool ``[R, N]``: valid entries whose position lies in ``[0, lead_end[r])`` or
    ``[window_start[r], next)`` (the host-known protected ranges, ``counts``)."""
    return valid & ((positions < lead_end.unsqueeze(1)) | (positions >= window_start.unsqueeze(1)))


def select_keep(
    scores: Tensor,
    positions: Tensor,
    valid: Tensor,
    protected: Tensor,
    num_evicted: Tensor,
    max_evicted: int,
) -> tuple[Tensor, Tensor]:
    """``(keep [R, N] bool, num_nonfinite [R] int64)``: survivors of every request.

    Args:
        scores: float ``[R, N]``, higher = keep (padding columns: anything).
        positions: int ``[R, N]`` logical positions.
        valid: bool ``[R, N]``, the request's entries (``column < kv_len[r]``).
        protected: bool ``[R, N]``, never evicted.
        num_evicted: int64 ``[R]`` on the device: how many candidates go, per request
            (host-known; the caller guarantees at least that many candidates).
        max_evicted: ``max(num_evicted)``, known to the host (sizes the ``topk``).
    """
    candidates = valid > protected  # valid and not protected (bools)
    cleaned = _nan_as_lowest(scores)
    keys = torch.where(candidates, _keys_of(cleaned, positions), _NEVER)
    num_nonfinite = (candidates & (cleaned.abs() == float("inf"))).sum(dim=1)
    if max_evicted <= 0:
        return valid.clone(), num_nonfinite
    lowest = torch.topk(keys, max_evicted, dim=1, largest=False, sorted=True).indices
    chosen = arange(max_evicted, keys.device).unsqueeze(0) < num_evicted.unsqueeze(1)
    evicted = torch.zeros_like(valid).scatter_(1, lowest, chosen)
    return valid > evicted, num_nonfinite
