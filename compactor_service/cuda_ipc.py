"""CUDA IPC export and import of KV buffers as plain fields (no pickle).

``torch.multiprocessing`` shares a CUDA tensor by pickling ``rebuild_cuda_tensor`` with
the tuple ``UntypedStorage._share_cuda_()`` returns; unpickling client bytes would run
any code the client chose. Here the scheduler calls ``_share_cuda_`` itself and sends
only the fields a rebuild needs (``CudaIpcBuffer``); the compactor checks them and
rebuilds the storage with ``UntypedStorage._new_shared_cuda``, then the tensor with
``Tensor.set_``, exactly as ``rebuild_cuda_tensor`` does, minus what it does not need:

    _share_cuda_() -> (device, mem_handle, storage_size_bytes, storage_offset_bytes,
                       ref_counter_handle, ref_counter_offset, event_handle,
                       event_sync_required)

* ``mem_handle``: the caching allocator's shareable handle. torch 2.11 writes a version
  byte (2), a type byte, then the payload. Only type ``'c'`` (a ``cudaMalloc`` block,
  payload = the 64-byte ``cudaIpcMemHandle_t``) is accepted; ``'e'`` (expandable
  segments) makes the importer fetch file descriptors from the pid written in the
  handle, which a client must not choose.
* ``ref_counter_handle``/``ref_counter_offset`` name a shared-memory file of the
  exporter and a slot in it that the importer decrements when it drops the storage.
  Taken from a client they would let it pick a file and an offset to write: the
  compactor passes an empty name instead, so that decrement fails and is skipped (the
  path torch takes when the exporter has exited). The scheduler's counter then stays
  at 1, which only keeps its KV buffers from being freed before it exits; it never
  frees them earlier anyway.
* ``event_handle``: an IPC event the importer waits on before first use. Not needed
  here: the scheduler synchronises its device before every pass, so it is not read.
* The storage is checked against the allocation the handle opens
  (``cuMemGetAddressRange``): ``storage_offset_bytes + storage_size_bytes`` must lie
  inside it, and the buffer inside the storage, so that no view reaches past the
  scheduler's allocation into other memory of the compactor's device.

Not run here (no GPU in CI); ``tests/test_compactor_service.py`` has the GPU test.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import Tensor

from compactor_service.shared_pool import (
    DEVICE_CUDA,
    DTYPE_NAMES,
    DTYPES,
    BufferHandle,
    CudaIpcBuffer,
    PoolDeviceUnavailable,
    PoolLayout,
    PoolMappingError,
)

# torch 2.11's CUDACachingAllocator (SHAREABLE_HANDLE_VERSION, SHAREABLE_CUDA_MALLOC).
HANDLE_VERSION = 2
HANDLE_TYPE_CUDA_MALLOC = ord("c")
CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
MEM_HANDLE_BYTES = 2 + CUDA_IPC_HANDLE_BYTES
MAX_STORAGE_BYTES = 1 << 48  # far above any GPU's memory; keeps the arithmetic sane
NO_REF_COUNTER = b""  # see the module docstring


def check_cuda_buffer(name: str, buffer: CudaIpcBuffer, layout: PoolLayout) -> None:
    """Structural checks of one export (no CUDA call): raise ``PoolMappingError``."""
    itemsize = DTYPES[layout.dtype].itemsize
    check_ipc_handle(name, buffer, layout.buffer_bytes, itemsize)


def check_ipc_handle(name: str, buffer: CudaIpcBuffer, nbytes: int, itemsize: int = 1) -> None:
    """Structural checks of one export of ``nbytes`` (elements of ``itemsize`` bytes)
    with no CUDA call: raise ``PoolMappingError``."""
    handle = buffer.mem_handle
    if len(handle) != MEM_HANDLE_BYTES:
        raise PoolMappingError(
            f"{name}.cuda.mem_handle holds {len(handle)} bytes, expected {MEM_HANDLE_BYTES} "
            f"(version, type 'c', cudaIpcMemHandle_t)"
        )
    if handle[0] != HANDLE_VERSION:
        raise PoolMappingError(
            f"{name}.cuda.mem_handle has version {handle[0]}, expected {HANDLE_VERSION} "
            f"(torch 2.11)"
        )
    if handle[1] != HANDLE_TYPE_CUDA_MALLOC:
        raise PoolMappingError(
            f"{name}.cuda.mem_handle is not a cudaMalloc block (type {handle[1]!r}); "
            f"run the scheduler with PYTORCH_CUDA_ALLOC_CONF expandable_segments:False"
        )
    for field in ("storage_offset_bytes", "storage_size_bytes"):
        if not 0 <= getattr(buffer, field) <= MAX_STORAGE_BYTES:
            raise PoolMappingError(f"{name}.cuda.{field} is out of range")
    if not 0 <= buffer.tensor_offset <= MAX_STORAGE_BYTES:
        raise PoolMappingError(f"{name}.cuda.tensor_offset is out of range")
    end_bytes = (buffer.tensor_offset * itemsize) + nbytes
    if end_bytes > buffer.storage_size_bytes:
        raise PoolMappingError(
            f"{name}: the buffer ({nbytes} bytes at element "
            f"{buffer.tensor_offset}) does not fit its storage ({buffer.storage_size_bytes} "
            f"bytes)"
        )


def _allocation_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the device allocation holding ``ptr`` (driver API)."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    get_range = libcuda.cuMemGetAddressRange_v2
    get_range.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    get_range.restype = ctypes.c_int
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    result = get_range(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if result != 0:
        raise PoolMappingError(f"cuMemGetAddressRange failed (CUresult {result})")
    return base.value, size.value


def open_storage(name: str, buffer: CudaIpcBuffer, device_index: int):
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            device_index,
            buffer.mem_handle,
            buffer.storage_size_bytes,
            buffer.storage_offset_bytes,
            NO_REF_COUNTER,
            0,
            b"",
            False,
        )
    except RuntimeError as error:  # torch's CUDA errors (invalid handle, ...)
        raise PoolMappingError(
            f"{name}: CUDA could not open the IPC handle ({str(error)[:200]})"
        ) from None
    base_ptr = storage.data_ptr() - buffer.storage_offset_bytes
    allocation_base, allocation_bytes = _allocation_range(base_ptr)
    if allocation_base != base_ptr or (
        buffer.storage_offset_bytes + buffer.storage_size_bytes > allocation_bytes
    ):
        raise PoolMappingError(
            f"{name}: the storage ({buffer.storage_size_bytes} bytes at "
            f"{buffer.storage_offset_bytes}) lies outside the exported allocation "
            f"({allocation_bytes} bytes)"
        )
    return storage


def open_cuda_buffers(layout: PoolLayout) -> tuple[list[Tensor], list[Tensor]]:
    """Open every buffer of a CUDA ``layout`` (validated by the caller)."""
    for name, handle in layout.handles():
        check_cuda_buffer(name, handle.cuda, layout)
    if not torch.cuda.is_available():
        raise PoolDeviceUnavailable(
            "layout.device is DEVICE_CUDA but the compactor's host has no CUDA device; run "
            "the compactor on the scheduler's GPU host"
        )
    if layout.device_index >= torch.cuda.device_count():
        raise PoolDeviceUnavailable(
            f"layout.device_index {layout.device_index}: the compactor sees "
            f"{torch.cuda.device_count()} CUDA devices"
        )
    torch.cuda._lazy_init()
    dtype = DTYPES[layout.dtype]
    shape = layout.shape
    stride = (layout.num_kv_heads * layout.head_dim, layout.head_dim, 1)
    buffers = []
    with torch.cuda.device(layout.device_index):
        for name, handle in layout.handles():
            storage = open_storage(name, handle.cuda, layout.device_index)
            empty = torch.empty((0,), dtype=dtype, device=storage.device)
            buffers.append(empty.set_(storage, handle.cuda.tensor_offset, shape, stride))
    return buffers[: layout.num_layers], buffers[layout.num_layers :]


def export_cuda_buffers(
    k_buffers: Sequence[Tensor], v_buffers: Sequence[Tensor], page_size: int
) -> PoolLayout:
    """A layout exporting CUDA buffers by IPC (the scheduler keeps owning them)."""
    first = k_buffers[0]
    if first.dtype not in DTYPE_NAMES:
        raise PoolMappingError(f"unsupported KV dtype {first.dtype}; known: {sorted(DTYPES)}")

    def export(buffer: Tensor) -> BufferHandle:
        if (
            not buffer.is_cuda
            or not buffer.is_contiguous()
            or buffer.shape != first.shape
            or buffer.dtype != first.dtype
            or buffer.device != first.device
        ):
            raise PoolMappingError(
                "every KV buffer must be a contiguous CUDA tensor of one shape, dtype and "
                "device to be shared with the compactor"
            )
        _, mem_handle, size_bytes, offset_bytes, *_ = buffer.untyped_storage()._share_cuda_()
        if len(mem_handle) < 2 or mem_handle[1] != HANDLE_TYPE_CUDA_MALLOC:
            raise PoolMappingError(
                "the KV buffers were allocated in expandable segments, which the compactor "
                "does not import; set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"
            )
        return BufferHandle(
            cuda=CudaIpcBuffer(
                mem_handle=bytes(mem_handle),
                storage_offset_bytes=int(offset_bytes),
                storage_size_bytes=int(size_bytes),
                tensor_offset=int(buffer.storage_offset()),
            )
        )

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


def map_cuda_buffers(layout: PoolLayout) -> tuple[list[Tensor], list[Tensor]]:
    """Open every buffer of a CUDA ``layout`` in this process (one IPC open per buffer).
    Raises ``PoolMappingError`` (or a subclass) and opens nothing on any failed check."""
    layout.validate()
    if layout.device != DEVICE_CUDA:
        raise PoolMappingError("map_cuda_buffers takes a CUDA layout")
    return open_cuda_buffers(layout)
