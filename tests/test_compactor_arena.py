"""The tier's arena shared with the compactor sidecar as the KV pool is: allocated in a
file of the pool directory, registered after its pool, its layout checked, and every
wrong layout, size, format or file refused with its status and nothing held open.

The gRPC tests talk to a real ``python -m compactor_service`` process."""

from __future__ import annotations

import dataclasses
import os

import grpc
import pytest
import torch

from compactor_service.client import GrpcCompactor
from compactor_service.engine import CompactorEngine
from compactor_service.runtime_dir import DEFAULT_POOL_DIR
from compactor_service.shared_arena import (
    ArenaMappingError,
    arena_layout_for,
    create_shared_arena,
)
from compactor_service.shared_pool import PoolDirectory, PoolMappingError, create_shared_buffers
from compactor_service.v1 import compactor_pb2 as pb
from compactor_service.v1 import compactor_pb2_grpc as pb_grpc
from compactor_service.wire import arena_layout_from_proto, arena_layout_to_proto
from sglang_evict.tier.arena import TierArena
from sglang_evict_kernels.tier_format import TierFormat
from tests.compactor_process import CompactorProcess

LAYERS, SLOTS, HEADS, HEAD_DIM = 3, 64, 2, 64
FMT = TierFormat(bits=3, group_tokens=16, head_dim=HEAD_DIM, outlier_tokens=2)
GROUPS = 6


@pytest.fixture(scope="module")
def compactor(tmp_path_factory):
    process = CompactorProcess(tmp_path_factory.mktemp("compactor")).start()
    yield process
    process.stop()


@pytest.fixture
def pool():
    shared = create_shared_buffers(
        num_layers=LAYERS,
        num_slots=SLOTS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
        page_size=4,
        directory=DEFAULT_POOL_DIR,
    )
    yield shared
    shared.close()


@pytest.fixture
def arena():
    shared = create_shared_arena(
        FMT,
        num_groups=GROUPS,
        num_layers=LAYERS,
        kv_heads=HEADS,
        full_dtype=torch.bfloat16,
        directory=DEFAULT_POOL_DIR,
    )
    yield shared
    shared.close()


def register_arena(compactor, pool_layout, arena_layout):
    """Register the pool, then ``arena_layout`` for it, raw (the client would retry)."""
    client = GrpcCompactor(compactor.target, pool_layout, timeout_s=10)
    pool_id, epoch = client.register()
    with grpc.insecure_channel(compactor.target) as channel:
        stub = pb_grpc.CompactorStub(channel)
        request = pb.RegisterArenaRequest(
            pool_id=pool_id, epoch=epoch, layout=arena_layout_to_proto(arena_layout)
        )
        try:
            return stub.RegisterArena(request, timeout=10)
        finally:
            client.close()


def test_the_arena_lives_in_a_private_file_the_tier_arena_uses_as_its_stores(arena):
    info = os.stat(arena.path)
    assert info.st_mode & 0o777 == 0o600 and info.st_size == arena.layout.file_bytes
    tier = TierArena(
        FMT,
        num_groups=GROUPS,
        num_layers=LAYERS,
        kv_heads=HEADS,
        full_dtype=torch.bfloat16,
        stores=arena.stores,
    )
    tier.stores[1].k_codes[2].fill_(7)  # a write through the arena is in the file
    with open(arena.path, "rb") as f:
        spec = next(s for s in arena.layout.tensor_specs() if (s.layer, s.name) == (1, "k_codes"))
        f.seek(spec.offset_bytes + 2 * spec.nbytes // spec.shape[0])
        assert f.read(4) == b"\x07" * 4
    tier.check()
    for store in arena.stores:  # the kernels read codes by 32-bit words
        store.check_contiguous()
    wrong = create_shared_arena(
        dataclasses.replace(FMT, bits=2),
        num_groups=GROUPS,
        num_layers=LAYERS,
        kv_heads=HEADS,
        full_dtype=torch.bfloat16,
        directory=DEFAULT_POOL_DIR,
    )
    with pytest.raises(ValueError, match="layer 0 k_codes"):
        TierArena(
            FMT,
            num_groups=GROUPS,
            num_layers=LAYERS,
            kv_heads=HEADS,
            full_dtype=torch.bfloat16,
            stores=wrong.stores,
        )
    wrong.close()


def test_the_layout_crosses_the_wire_unchanged(arena):
    assert arena_layout_from_proto(arena_layout_to_proto(arena.layout)) == arena.layout


def test_a_client_registers_its_arena_with_its_pool_and_a_second_is_refused(compactor, pool, arena):
    client = GrpcCompactor(compactor.target, pool.layout, timeout_s=10, arena=arena.layout)
    pool_id, epoch = client.register()
    with grpc.insecure_channel(compactor.target) as channel:
        stub = pb_grpc.CompactorStub(channel)
        request = pb.RegisterArenaRequest(
            pool_id=pool_id, epoch=epoch, layout=arena_layout_to_proto(arena.layout)
        )
        with pytest.raises(grpc.RpcError) as error:
            stub.RegisterArena(request, timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "has its arena already" in error.value.details()
    client.close()


def _bad_layouts(pool, arena):
    layout = arena.layout
    return {
        "the pool's file": (
            dataclasses.replace(layout, shm_path=str(pool.path)),
            grpc.StatusCode.PERMISSION_DENIED,
            "is not a tier arena file",
        ),
        "outside the pool directory": (
            dataclasses.replace(layout, shm_path="/etc/passwd"),
            grpc.StatusCode.PERMISSION_DENIED,
            "not in the compactor's pool directory",
        ),
        "more slots than the file": (
            dataclasses.replace(layout, num_slots=layout.num_slots + 1),
            grpc.StatusCode.INVALID_ARGUMENT,
            "the layout needs exactly",
        ),
        "bits the kernels lack": (
            dataclasses.replace(layout, bits=5),
            grpc.StatusCode.INVALID_ARGUMENT,
            "bits",
        ),
        "another head dim than the pool's": (
            dataclasses.replace(layout, head_dim=128),
            grpc.StatusCode.INVALID_ARGUMENT,
            "arena.head_dim is 128, its pool's is 64",
        ),
        "another KV dtype": (
            dataclasses.replace(layout, full_dtype="float16"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "arena.full_dtype",
        ),
        "an unknown scale dtype": (
            dataclasses.replace(layout, scale_dtype="int8"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "scale_dtype",
        ),
        "a CUDA arena without its export": (
            dataclasses.replace(layout, device="cuda", shm_path=""),
            grpc.StatusCode.INVALID_ARGUMENT,
            "a CUDA arena carries its IPC export",
        ),
        "a CUDA arena for a CPU pool": (
            dataclasses.replace(layout, device="cuda", shm_path="", cuda=fake_cuda_export(layout)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "arena.device is 'cuda', its pool's is 'cpu'",
        ),
    }


def fake_cuda_export(layout):
    """A structurally valid CUDA IPC export of an arena of ``layout``'s size (its handle
    opens nothing: no CUDA call is made before the structural checks refuse)."""
    from compactor_service.shared_pool import CudaIpcBuffer

    return CudaIpcBuffer(
        mem_handle=bytes([2, ord("c")]) + bytes(64),
        storage_offset_bytes=0,
        storage_size_bytes=layout.file_bytes,
        tensor_offset=0,
    )


def test_a_cuda_arena_layout_crosses_the_wire_whole_and_its_export_is_checked(arena):
    from compactor_service.shared_arena import ArenaMappingError, PoolMappingError
    from compactor_service.wire import arena_layout_from_proto, arena_layout_to_proto

    cuda = dataclasses.replace(arena.layout, device="cuda", shm_path="")
    cuda = dataclasses.replace(cuda, cuda=fake_cuda_export(cuda))
    assert arena_layout_from_proto(arena_layout_to_proto(cuda)) == cuda
    short = dataclasses.replace(
        cuda, cuda=dataclasses.replace(cuda.cuda, storage_size_bytes=cuda.file_bytes - 1)
    )
    with pytest.raises(PoolMappingError, match="does not fit its storage"):
        short.validate()
    with pytest.raises(ArenaMappingError, match="carries no CUDA export"):
        dataclasses.replace(arena.layout, cuda=cuda.cuda).validate()


@pytest.mark.parametrize(
    "case",
    [
        "the pool's file",
        "outside the pool directory",
        "more slots than the file",
        "bits the kernels lack",
        "another head dim than the pool's",
        "another KV dtype",
        "an unknown scale dtype",
        "a CUDA arena without its export",
        "a CUDA arena for a CPU pool",
    ],
)
def test_a_wrong_arena_is_refused_with_its_status(compactor, pool, arena, case):
    layout, code, text = _bad_layouts(pool, arena)[case]
    with pytest.raises(grpc.RpcError) as error:
        register_arena(compactor, pool.layout, layout)
    assert error.value.code() == code, error.value.details()
    assert text in error.value.details()
    # the same registration's right arena is still taken: the refusal held nothing
    assert register_arena(compactor, pool.layout, arena.layout).arena_bytes == os.path.getsize(
        arena.path
    )


def test_an_arena_for_an_unknown_pool_is_not_found(compactor, arena):
    with grpc.insecure_channel(compactor.target) as channel:
        stub = pb_grpc.CompactorStub(channel)
        request = pb.RegisterArenaRequest(
            pool_id="nope", epoch=1, layout=arena_layout_to_proto(arena.layout)
        )
        with pytest.raises(grpc.RpcError) as error:
            stub.RegisterArena(request, timeout=10)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_refused_arena_leaves_the_pool_without_one(pool, arena, tmp_path):
    engine = CompactorEngine(pool_dir=PoolDirectory(DEFAULT_POOL_DIR))
    pool_id, epoch = engine.register_pool(pool.layout, "test")
    truncated = create_shared_arena(
        FMT,
        num_groups=GROUPS,
        num_layers=LAYERS,
        kv_heads=HEADS,
        full_dtype=torch.bfloat16,
        directory=DEFAULT_POOL_DIR,
    )
    os.truncate(truncated.path, 4096)
    with pytest.raises(PoolMappingError, match="the layout needs exactly"):
        engine.register_arena(pool_id, epoch, truncated.layout)
    assert engine.pools[pool_id].arena is None
    assert engine.register_arena(pool_id, epoch, arena.layout) == arena.layout.file_bytes
    engine.unregister_pool(pool_id, epoch)
    truncated.close()


def test_layouts_follow_the_format():
    small = arena_layout_for(
        FMT, num_groups=1, num_layers=1, kv_heads=1, full_dtype=torch.bfloat16, shm_path="x"
    )
    big = dataclasses.replace(small, num_slots=small.num_slots * 4)
    assert big.file_bytes > small.file_bytes
    for spec in big.tensor_specs():
        assert spec.offset_bytes % 64 == 0  # the codes start on words, every tensor aligned
    with pytest.raises(ArenaMappingError, match="head dim 96"):
        dataclasses.replace(small, head_dim=96).validate()
    with pytest.raises(ArenaMappingError, match="at least one group slot"):
        dataclasses.replace(small, num_slots=1).validate()
