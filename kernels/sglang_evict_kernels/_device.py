"""Small int64 tensors the launchers hand their kernels (pointer tables, row sizes),
built without synchronising the host.

``torch.tensor(values, device="cuda")`` copies from pageable host memory and waits for
the copy (a stream synchronisation); inside a scheduler's decode step that wait is the
cost the batched pass avoids. Values are staged in pinned memory and copied with
``non_blocking=True`` instead (the pinned block is not reused before the copy ends:
PyTorch's caching host allocator records the copy's stream). Pointer tables depend only
on the buffers' addresses, which a KV pool never changes, so they are cached per
address tuple.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

_TABLES: dict[tuple, Tensor] = {}
_MAX_CACHED_TABLES = 64  # distinct buffer sets; a server has one pool (K, V, both)


def device_int64(values: Sequence[int], device: torch.device | str) -> Tensor:
    """int64 tensor of ``values`` on ``device``; on CUDA, copied without a host wait."""
    if hasattr(values, "__array__"):  # a numpy array: no Python int per value
        host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
    else:
        host = torch.tensor(list(values), dtype=torch.int64)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def cached_int64(key: tuple, values: Sequence[int], device: torch.device | str) -> Tensor:
    """``device_int64(values, device)``, built once per ``key`` (e.g. buffer addresses)."""
    full_key = (key, str(device))
    table = _TABLES.get(full_key)
    if table is None:
        if len(_TABLES) >= _MAX_CACHED_TABLES:
            _TABLES.clear()
        table = _TABLES[full_key] = device_int64(values, device)
    return table


def pointer_table(buffers: Sequence[Tensor]) -> Tensor:
    """int64 base address of each buffer, on the buffers' device (cached)."""
    pointers = tuple(b.data_ptr() for b in buffers)
    return cached_int64(("pointers", pointers), pointers, buffers[0].device)


def to_device(tensor: Tensor, device: torch.device | str) -> Tensor:
    """``tensor`` on ``device``; a host tensor goes to CUDA through pinned memory,
    without a host wait."""
    device = torch.device(device)
    if tensor.device == device or (device.type == "cuda" and tensor.device.type == "cuda"):
        return tensor.to(device)
    if device.type == "cuda":
        return tensor.contiguous().pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
