"""Index vectors without a launch each: ``arange(n, device)`` is a view of one cached
``0, 1, 2, ...`` per device, grown (doubled) when a pass needs a longer one.

A pass needs a handful of index vectors (columns, pages, offsets in a page, new-row
indices); on a GPU each ``torch.arange`` is a kernel launch and a dispatch the host
pays for. A slice is a view: no launch. The views share storage, so a caller must
never write into one (``expand(...).contiguous()`` or any out-of-place op copies).
"""

from __future__ import annotations

import torch
from torch import Tensor

_MIN_LENGTH = 4096
_CACHED: dict[torch.device, Tensor] = {}


def _key(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def arange(n: int, device: torch.device | str) -> Tensor:
    """int64 ``[0, n)`` on ``device`` (a read-only view; see the module docstring)."""
    cached = _CACHED.get(device)  # the caller's own device object or name: one lookup
    if cached is None or not 0 <= n <= cached.shape[0]:
        cached = _grow(n, device)
    return cached[:n]


def _grow(n: int, device: torch.device | str) -> Tensor:
    if n < 0:
        raise ValueError(f"arange of negative length {n}")
    key = _key(device)
    cached = _CACHED.get(key)
    if cached is None or cached.shape[0] < n:
        length = max(n, _MIN_LENGTH, 2 * (0 if cached is None else cached.shape[0]))
        cached = _CACHED[key] = torch.arange(length, device=key)
    if torch.device(device) == key:  # not a bare "cuda": its meaning follows the current device
        _CACHED[device] = cached
    return cached
