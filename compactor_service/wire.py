"""Conversions between the proto messages (``compactor_service.v1``) and domain types.

Slot arrays travel as little-endian int64 bytes; a malformed field is a ``PlanError``
or ``PoolMappingError`` (the servicer maps both to INVALID_ARGUMENT). Every field is
plain data; nothing is deserialised as code.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from compactor_service.compactor import LeaseClaim
from compactor_service.limits import clip
from compactor_service.plan import WIRE_FIELDS, CompactionPlan, PlanError
from compactor_service.shared_arena import ArenaLayout, ArenaMappingError
from compactor_service.shared_pool import (
    DEVICE_CPU,
    DEVICE_CUDA,
    BufferHandle,
    CudaIpcBuffer,
    PoolLayout,
    PoolMappingError,
)
from compactor_service.v1 import compactor_pb2 as pb

_DEVICES = {DEVICE_CPU: pb.DEVICE_CPU, DEVICE_CUDA: pb.DEVICE_CUDA}
_DEVICE_NAMES = {value: name for name, value in _DEVICES.items()}
_LE64 = np.dtype("<i8")


def tensor_to_le64(values: Tensor) -> bytes:
    return values.detach().to("cpu", torch.int64).contiguous().numpy().astype(_LE64).tobytes()


def le64_to_tensor(name: str, data: bytes) -> Tensor:
    if len(data) % 8:
        raise PlanError(f"{name}: {len(data)} bytes is not a whole number of int64 values")
    return torch.from_numpy(np.frombuffer(data, dtype=_LE64).astype(np.int64))


def plan_to_proto(plan: CompactionPlan, rid: str = "") -> pb.Plan:
    fields = {f"{name}_le64": tensor_to_le64(getattr(plan, name)) for name in WIRE_FIELDS}
    return pb.Plan(rid=rid, page_size=plan.page_size, **fields)


def plan_from_proto(message: pb.Plan, max_values: int | None = None) -> CompactionPlan:
    """Decode one plan; with ``max_values``, refuse (before decoding) an array holding
    more values than that (a pool of N slots has no plan array longer than N)."""
    name_of_plan = clip(message.rid) if message.rid else "plan"
    arrays = {}
    for name in WIRE_FIELDS:
        data = getattr(message, f"{name}_le64")
        if max_values is not None and len(data) // 8 > max_values:
            raise PlanError(
                f"{name_of_plan}.{name} holds {len(data) // 8} values, more than the pool's "
                f"{max_values} slots"
            )
        arrays[name] = le64_to_tensor(f"{name_of_plan}.{name}", data)
    return CompactionPlan(page_size=int(message.page_size), **arrays)


def claim_to_proto(claim: LeaseClaim | None) -> pb.LeaseClaim | None:
    if claim is None:
        return None
    return pb.LeaseClaim(resource=claim.resource, fencing_token=claim.token, holder=claim.holder)


def claim_from_proto(request: pb.CompactRequest) -> LeaseClaim | None:
    if not request.HasField("claim"):
        return None
    c = request.claim
    return LeaseClaim(resource=c.resource, token=int(c.fencing_token), holder=c.holder)


def _cuda_to_proto(c: CudaIpcBuffer) -> pb.CudaIpcBuffer:
    return pb.CudaIpcBuffer(
        mem_handle=c.mem_handle,
        storage_offset_bytes=c.storage_offset_bytes,
        storage_size_bytes=c.storage_size_bytes,
        tensor_offset=c.tensor_offset,
    )


def _cuda_from_proto(c: pb.CudaIpcBuffer) -> CudaIpcBuffer:
    return CudaIpcBuffer(
        mem_handle=bytes(c.mem_handle),
        storage_offset_bytes=int(c.storage_offset_bytes),
        storage_size_bytes=int(c.storage_size_bytes),
        tensor_offset=int(c.tensor_offset),
    )


def _handle_to_proto(h: BufferHandle) -> pb.BufferHandle:
    if h.cuda is None:
        return pb.BufferHandle(shm_path=h.shm_path, offset_bytes=h.offset_bytes)
    return pb.BufferHandle(cuda=_cuda_to_proto(h.cuda))


def _handle_from_proto(h: pb.BufferHandle) -> BufferHandle:
    cuda = _cuda_from_proto(h.cuda) if h.HasField("cuda") else None
    return BufferHandle(shm_path=h.shm_path, offset_bytes=int(h.offset_bytes), cuda=cuda)


def layout_to_proto(layout: PoolLayout) -> pb.PoolLayout:
    return pb.PoolLayout(
        num_layers=layout.num_layers,
        num_slots=layout.num_slots,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        page_size=layout.page_size,
        device=_DEVICES[layout.device],
        device_index=layout.device_index,
        k_buffers=[_handle_to_proto(h) for h in layout.k_buffers],
        v_buffers=[_handle_to_proto(h) for h in layout.v_buffers],
    )


def layout_from_proto(message: pb.PoolLayout) -> PoolLayout:
    if message.device not in _DEVICE_NAMES:
        raise PoolMappingError(
            f"layout.device must be DEVICE_CPU or DEVICE_CUDA, got {message.device}"
        )
    counts = (len(message.k_buffers), len(message.v_buffers))
    if counts != (message.num_layers, message.num_layers):
        raise PoolMappingError(
            f"need {message.num_layers} K and V buffer handles, got {counts[0]} and {counts[1]}"
        )
    layout = PoolLayout(
        num_layers=int(message.num_layers),
        num_slots=int(message.num_slots),
        num_kv_heads=int(message.num_kv_heads),
        head_dim=int(message.head_dim),
        dtype=message.dtype,
        page_size=int(message.page_size),
        device=_DEVICE_NAMES[message.device],
        device_index=int(message.device_index),
        k_buffers=tuple(_handle_from_proto(h) for h in message.k_buffers),
        v_buffers=tuple(_handle_from_proto(h) for h in message.v_buffers),
    )
    layout.validate()
    return layout


_ARENA_FIELDS = (
    "bits",
    "group_tokens",
    "value_group_channels",
    "outlier_tokens",
    "head_dim",
    "scale_dtype",
    "full_dtype",
    "num_layers",
    "num_slots",
    "num_kv_heads",
    "device_index",
    "shm_path",
)


def arena_layout_to_proto(layout: ArenaLayout) -> pb.ArenaLayout:
    return pb.ArenaLayout(
        **{name: getattr(layout, name) for name in _ARENA_FIELDS},
        device=_DEVICES[layout.device],
        cuda=None if layout.cuda is None else _cuda_to_proto(layout.cuda),
    )


def arena_layout_from_proto(message: pb.ArenaLayout) -> ArenaLayout:
    if message.device not in _DEVICE_NAMES:
        raise ArenaMappingError(
            f"arena.device must be DEVICE_CPU or DEVICE_CUDA, got {message.device}"
        )
    layout = ArenaLayout(
        **{name: getattr(message, name) for name in _ARENA_FIELDS},
        device=_DEVICE_NAMES[message.device],
        cuda=_cuda_from_proto(message.cuda) if message.HasField("cuda") else None,
    )
    layout.validate()
    return layout
