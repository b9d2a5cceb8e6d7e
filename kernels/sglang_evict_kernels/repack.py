"""Repack: copy slots ``src -> dst`` in every layer's K and V buffer.

Buffers follow SGLang's MHA KV pool layout: one ``[slots, kv_heads, head_dim]`` tensor
per layer for K and one for V (fp8 caches are stored as uint8; K and V may be views of
one allocation). A move copies a slot's whole row (all heads) in every buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def _check_moves(buffers: Sequence[Tensor], src_slots: Tensor, dst_slots: Tensor) -> None:
    if src_slots.shape != dst_slots.shape or src_slots.dim() != 1:
        raise ValueError(
            f"src_slots {tuple(src_slots.shape)} and dst_slots {tuple(dst_slots.shape)} must "
            f"be equal 1-D shapes"
        )
    if src_slots.dtype != torch.int64 or dst_slots.dtype != torch.int64:
        raise ValueError("src_slots and dst_slots must be int64")
    if src_slots.numel() == 0:
        return
    num_slots = min(buf.shape[0] for buf in buffers)
    for name, slots in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        if int(slots.min()) < 0 or int(slots.max()) >= num_slots:
            raise ValueError(f"{name} has slots outside [0, {num_slots})")


def repack_kv_reference(
    k_buffers: Sequence[Tensor],
    v_buffers: Sequence[Tensor],
    src_slots: Tensor,
    dst_slots: Tensor,
) -> None:
    """Torch reference: ``buf[dst] = buf[src]`` for every buffer, in place.

    Overlap-safe by staging: each buffer's sources are gathered into a new tensor before
    any destination is written, so a destination that is also a source still yields
    the pre-pass content. (Plans from the planner never overlap; this reference does
    not rely on it.)
    """
    buffers = [*k_buffers, *v_buffers]
    _check_moves(buffers, src_slots, dst_slots)
    if src_slots.numel() == 0:
        return
    for buf in buffers:
        src = src_slots.to(buf.device)
        dst = dst_slots.to(buf.device)
        staged = buf.index_select(0, src)
        buf.index_copy_(0, dst, staged)
