"""KV buffers that two processes map: the scheduler owns them, the compactor writes them.

A CPU pool lives in one file on a tmpfs (``/dev/shm`` by default, mode 0600): every
layer's K and V buffer at its own 4 KiB-aligned offset. Both processes map the file
with ``MAP_SHARED`` (``torch.from_file(..., shared=True)``), so a copy made by the
compactor is the scheduler's KV. A GPU pool is exported with CUDA IPC (torch's own
reduction of a CUDA tensor, the mechanism ``torch.multiprocessing`` uses); the compactor
opens each handle once per pool and keeps it open for the pool's life.

    file layout (one pool)   [ k0 | pad ][ k1 | pad ] ... [ v0 | pad ] ... [ v(L-1) ]
    handle of buffer i        (shm_path, offset_bytes of i)

This module is transport-free: ``PoolLayout`` is a plain dataclass, converted to and
from the proto message by the gRPC layer.
"""

from __future__ import annotations

import io
import os
import pickle
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor

ALIGN_BYTES = 4096
DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "uint8": torch.uint8,  # fp8 pools store uint8
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
DEVICE_CPU = "cpu"
DEVICE_CUDA = "cuda"


class PoolMappingError(ValueError):
    """A pool layout cannot be mapped (missing file, wrong size, bad dtype)."""


@dataclass(frozen=True)
class BufferHandle:
    shm_path: str = ""  # CPU: the tmpfs file holding the buffer
    offset_bytes: int = 0
    cuda_ipc: bytes = b""  # CUDA: torch's IPC export of the buffer (pickled reduction)


@dataclass(frozen=True)
class PoolLayout:
    """What a compactor needs to map a scheduler's KV pool."""

    num_layers: int
    num_slots: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    device: str  # "cpu" or "cuda"
    device_index: int = 0
    k_buffers: tuple[BufferHandle, ...] = field(default_factory=tuple)
    v_buffers: tuple[BufferHandle, ...] = field(default_factory=tuple)

    @property
    def buffer_bytes(self) -> int:
        itemsize = DTYPES[self.dtype].itemsize
        return self.num_slots * self.num_kv_heads * self.head_dim * itemsize

    def validate(self) -> None:
        """Raise ``PoolMappingError`` unless the layout is self-consistent."""
        if self.dtype not in DTYPES:
            raise PoolMappingError(f"unknown dtype {self.dtype!r}; known: {sorted(DTYPES)}")
        if self.device not in (DEVICE_CPU, DEVICE_CUDA):
            raise PoolMappingError(f"unknown device {self.device!r}; known: cpu, cuda")
        for name in ("num_layers", "num_slots", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) < 1:
                raise PoolMappingError(f"{name} must be >= 1, got {getattr(self, name)}")
        if len(self.k_buffers) != self.num_layers or len(self.v_buffers) != self.num_layers:
            raise PoolMappingError(
                f"need {self.num_layers} K and V buffer handles, got "
                f"{len(self.k_buffers)} and {len(self.v_buffers)}"
            )


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclass
class SharedKVBuffers:
    """The scheduler's side of a CPU shared pool: per-layer views into one tmpfs file.

    ``close`` removes the file; mappings stay valid in processes that hold them until
    they drop their tensors (POSIX unlink semantics).
    """

    path: Path
    k: list[Tensor]
    v: list[Tensor]
    layout: PoolLayout

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


def create_shared_buffers(
    *,
    num_layers: int,
    num_slots: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    page_size: int,
    directory: str | os.PathLike = "/dev/shm",
    copy_from: tuple[Sequence[Tensor], Sequence[Tensor]] | None = None,
) -> SharedKVBuffers:
    """Allocate a CPU pool in a new tmpfs file (mode 0600), optionally copying the
    current contents of ``copy_from = (k_buffers, v_buffers)`` into it."""
    if dtype not in DTYPE_NAMES:
        raise PoolMappingError(f"unsupported KV dtype {dtype}; known: {sorted(DTYPES)}")
    directory = Path(directory)
    if not directory.is_dir():
        raise PoolMappingError(
            f"shared-memory directory {directory} does not exist; pass an existing tmpfs "
            f"directory (e.g. /dev/shm)"
        )
    layout = PoolLayout(
        num_layers=num_layers,
        num_slots=num_slots,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=DTYPE_NAMES[dtype],
        page_size=page_size,
        device=DEVICE_CPU,
    )
    stride = _aligned(layout.buffer_bytes)
    path = directory / f"sglang-evict-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 2 * num_layers * stride)
    finally:
        os.close(fd)
    handles = tuple(BufferHandle(str(path), i * stride) for i in range(2 * num_layers))
    layout = replace(layout, k_buffers=handles[:num_layers], v_buffers=handles[num_layers:])
    k, v = map_buffers(layout)
    if copy_from is not None:
        for dst, src in zip(k + v, [*copy_from[0], *copy_from[1]], strict=True):
            dst.copy_(src)
    return SharedKVBuffers(path=path, k=k, v=v, layout=layout)


def export_cuda_buffers(
    k_buffers: Sequence[Tensor], v_buffers: Sequence[Tensor], page_size: int
) -> PoolLayout:
    """A layout exporting CUDA buffers by IPC (the scheduler keeps owning them)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  registers the CUDA tensor reductions

    first = k_buffers[0]
    if first.dtype not in DTYPE_NAMES:
        raise PoolMappingError(f"unsupported KV dtype {first.dtype}; known: {sorted(DTYPES)}")

    def export(buffer: Tensor) -> BufferHandle:
        stream = io.BytesIO()
        ForkingPickler(stream, pickle.HIGHEST_PROTOCOL).dump(buffer)
        return BufferHandle(cuda_ipc=stream.getvalue())

    return PoolLayout(
        num_layers=len(k_buffers),
        num_slots=first.shape[0],
        num_kv_heads=first.shape[1],
        head_dim=first.shape[2],
        dtype=DTYPE_NAMES[first.dtype],
        page_size=page_size,
        device=DEVICE_CUDA,
        device_index=first.device.index or 0,
        k_buffers=tuple(export(b) for b in k_buffers),
        v_buffers=tuple(export(b) for b in v_buffers),
    )


def map_buffers(layout: PoolLayout) -> tuple[list[Tensor], list[Tensor]]:
    """Map every buffer of ``layout`` in this process: one mapping per file (CPU) or
    one IPC open per buffer (CUDA). Raises ``PoolMappingError`` and maps nothing if
    a file is missing or too small."""
    layout.validate()
    if layout.device == DEVICE_CUDA:
        buffers = [pickle.loads(h.cuda_ipc) for h in (*layout.k_buffers, *layout.v_buffers)]
        expected = (layout.num_slots, layout.num_kv_heads, layout.head_dim)
        for buffer in buffers:
            if tuple(buffer.shape) != expected or DTYPE_NAMES.get(buffer.dtype) != layout.dtype:
                raise PoolMappingError(
                    f"IPC buffer {tuple(buffer.shape)} {buffer.dtype} does not match the "
                    f"layout {expected} {layout.dtype}"
                )
        return buffers[: layout.num_layers], buffers[layout.num_layers :]
    files: dict[str, Tensor] = {}
    dtype = DTYPES[layout.dtype]
    shape = (layout.num_slots, layout.num_kv_heads, layout.head_dim)
    views = []
    for handle in (*layout.k_buffers, *layout.v_buffers):
        if handle.shm_path not in files:
            try:
                size_bytes = os.stat(handle.shm_path).st_size
            except OSError as error:
                raise PoolMappingError(
                    f"cannot open the pool's shared-memory file: {error}"
                ) from None
            files[handle.shm_path] = torch.from_file(
                handle.shm_path, shared=True, size=size_bytes, dtype=torch.uint8
            )
        whole = files[handle.shm_path]
        end = handle.offset_bytes + layout.buffer_bytes
        if handle.offset_bytes % ALIGN_BYTES or end > whole.numel():
            raise PoolMappingError(
                f"buffer at offset {handle.offset_bytes} (+{layout.buffer_bytes} bytes) does "
                f"not fit {handle.shm_path} ({whole.numel()} bytes, {ALIGN_BYTES}-aligned)"
            )
        views.append(whole[handle.offset_bytes : end].view(dtype).view(shape))
    return views[: layout.num_layers], views[layout.num_layers :]
