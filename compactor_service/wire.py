"""Conversions between the proto messages (``compactor_service.v1``) and domain types.

Slot arrays travel as little-endian int64 bytes; a malformed field is a ``PlanError``
or ``PoolMappingError`` (the servicer maps both to INVALID_ARGUMENT).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from compactor_service.compactor import LeaseClaim
from compactor_service.plan import ARRAY_FIELDS, CompactionPlan, PlanError
from compactor_service.shared_pool import (
    DEVICE_CPU,
    DEVICE_CUDA,
    BufferHandle,
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
    fields = {f"{name}_le64": tensor_to_le64(getattr(plan, name)) for name in ARRAY_FIELDS}
    return pb.Plan(rid=rid, page_size=plan.page_size, **fields)


def plan_from_proto(message: pb.Plan) -> CompactionPlan:
    arrays = {
        name: le64_to_tensor(f"{message.rid or 'plan'}.{name}", getattr(message, f"{name}_le64"))
        for name in ARRAY_FIELDS
    }
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


def layout_to_proto(layout: PoolLayout) -> pb.PoolLayout:
    def handle(h: BufferHandle) -> pb.BufferHandle:
        return pb.BufferHandle(
            shm_path=h.shm_path, offset_bytes=h.offset_bytes, cuda_ipc=h.cuda_ipc
        )

    return pb.PoolLayout(
        num_layers=layout.num_layers,
        num_slots=layout.num_slots,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        page_size=layout.page_size,
        device=_DEVICES[layout.device],
        device_index=layout.device_index,
        k_buffers=[handle(h) for h in layout.k_buffers],
        v_buffers=[handle(h) for h in layout.v_buffers],
    )


def layout_from_proto(message: pb.PoolLayout) -> PoolLayout:
    if message.device not in _DEVICE_NAMES:
        raise PoolMappingError(
            f"layout.device must be DEVICE_CPU or DEVICE_CUDA, got {message.device}"
        )

    def handle(h: pb.BufferHandle) -> BufferHandle:
        return BufferHandle(
            shm_path=h.shm_path, offset_bytes=int(h.offset_bytes), cuda_ipc=h.cuda_ipc
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
        k_buffers=tuple(handle(h) for h in message.k_buffers),
        v_buffers=tuple(handle(h) for h in message.v_buffers),
    )
    layout.validate()
    return layout
