"""Demotions run by the compactor (issue 61, part 2 on the compactor's side): a pass's
plan carries the tokens that enter the request's tier and the arena slots they go to;
the compactor quantizes them from the pool into the arena, before the moves, inside the
pass's checks. The bytes equal the tier's own quantizer's, in process and through a
real sidecar process, and every bad demotion is refused with nothing written."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from compactor_service.client import GrpcCompactor
from compactor_service.compactor import InProcessCompactor
from compactor_service.demotion import ArenaMissing
from compactor_service.plan import PlanError
from compactor_service.runtime_dir import DEFAULT_POOL_DIR
from compactor_service.shared_arena import create_shared_arena
from compactor_service.shared_pool import create_shared_buffers
from compactor_service.v1 import compactor_pb2 as pb
from compactor_service.v1 import compactor_pb2_grpc as pb_grpc
from compactor_service.wire import plan_to_proto
from sglang_evict.passes.planner import plan_compaction
from sglang_evict_kernels import repack_kv_reference
from sglang_evict_kernels.tier_format import TierFormat, TierStore
from sglang_evict_kernels.tier_quant import quantize_into
from tests.compactor_process import CompactorProcess

LAYERS, SLOTS, HEADS, HEAD_DIM, PAGE = 3, 96, 2, 64, 4
FMT = TierFormat(bits=3, group_tokens=16, head_dim=HEAD_DIM, outlier_tokens=2)
GROUPS = 6  # arena slots 0..5, trash 6


def two_plans():
    """Two requests of 24 tokens (pages 2-7 and 10-15); each keeps 8 and demotes the
    other 16 (one group) into a claimed arena slot."""
    plans = []
    for first_page, claimed in ((2, 1), (10, 4)):
        row = torch.arange(first_page * PAGE, first_page * PAGE + 24, dtype=torch.int64)
        survivors = torch.tensor([0, 3, 5, 9, 12, 17, 20, 23])
        plan = plan_compaction(row, survivors, page_size=PAGE, positions=torch.arange(24))
        cold = row[~torch.isin(torch.arange(24), survivors)]
        plans.append(
            dataclasses.replace(
                plan,
                demote_slots=cold,
                demote_targets=torch.tensor([claimed]),
                arena_claimed=torch.tensor([claimed]),
            )
        )
    return plans


def expected_groups(k, v, plans) -> list[TierStore]:
    """Each layer's groups as the tier's quantizer writes them from the pre-pass KV."""
    slots = torch.cat([p.demote_slots for p in plans]).view(-1, FMT.group_tokens)
    out = []
    for layer in range(LAYERS):
        store = TierStore.empty(
            FMT, slots.shape[0], HEADS, k[0].dtype, outliers=FMT.outliers_for_layer(layer)
        )
        quantize_into(store, torch.arange(slots.shape[0]), k[layer], v[layer], slots, FMT)
        out.append(store)
    return out


def same_groups(stores, slots, expected) -> bool:
    for store, want in zip(stores, expected, strict=True):
        got = store.take(slots)
        for name, tensor in want.tensors().items():
            if not torch.equal(getattr(got, name).view(torch.uint8), tensor.view(torch.uint8)):
                return False
    return True


def random_pool(seed=0):
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(SLOTS, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    v = [torch.randn(SLOTS, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    return k, v


def arena_stores():
    return [
        TierStore.empty(FMT, GROUPS + 1, HEADS, torch.bfloat16, outliers=FMT.outliers_for_layer(i))
        for i in range(LAYERS)
    ]


def test_the_in_process_compactor_demotes_before_it_moves():
    k, v = random_pool()
    plans = two_plans()
    want = expected_groups(k, v, plans)
    k_ref, v_ref = [b.clone() for b in k], [b.clone() for b in v]
    for plan in plans:
        repack_kv_reference(k_ref, v_ref, plan.src_slots, plan.dst_slots)
    stores = arena_stores()
    compactor = InProcessCompactor(k, v, page_size=PAGE)
    compactor.attach_arena(stores, FMT)
    result = compactor.compact(plans)
    assert result.groups_demoted == 2
    assert same_groups(stores, torch.tensor([1, 4]), want)
    assert all(torch.equal(a, b) for a, b in zip(k + v, k_ref + v_ref, strict=True))


def _bad(plans, case):
    a, b = plans
    if case == "unclaimed target":
        return [dataclasses.replace(a, demote_targets=torch.tensor([2])), b], "did not claim"
    if case == "the trash claimed":
        return [dataclasses.replace(a, arena_claimed=torch.tensor([GROUPS])), b], "outside"
    if case == "a slot claimed twice":
        return [a, dataclasses.replace(b, arena_claimed=torch.tensor([1, 4]))], "same arena slot"
    if case == "a short group":
        return [dataclasses.replace(a, demote_slots=a.demote_slots[:-1]), b], "15 slots for 1"
    if case == "a slot outside the pool":
        slots = a.demote_slots.clone()
        slots[0] = SLOTS
        return [dataclasses.replace(a, demote_slots=slots), b], "outside"
    if case == "another request's kept slot":
        slots = a.demote_slots.clone()
        slots[0] = b.new_row[0]
        return [dataclasses.replace(a, demote_slots=slots), b], "another plan's row keeps"
    if case == "an arena slot claimed by two requests":
        taken = a.arena_claimed.clone()
        return [a, dataclasses.replace(b, demote_targets=taken, arena_claimed=taken)], (
            "claim the same arena slot"
        )
    raise AssertionError(case)


BAD = [
    "unclaimed target",
    "the trash claimed",
    "a slot claimed twice",
    "a short group",
    "a slot outside the pool",
    "another request's kept slot",
    "an arena slot claimed by two requests",
]


@pytest.mark.parametrize("case", BAD)
def test_a_bad_demotion_is_refused_and_nothing_is_written(case):
    k, v = random_pool()
    plans, text = _bad(two_plans(), case)
    stores = arena_stores()
    before = [b.clone() for b in k + v], [t.clone() for s in stores for t in s.tensors().values()]
    compactor = InProcessCompactor(k, v, page_size=PAGE)
    compactor.attach_arena(stores, FMT)
    with pytest.raises(PlanError, match=text):
        compactor.compact(plans)
    assert all(torch.equal(a, b) for a, b in zip(k + v, before[0], strict=True))
    after = [t for s in stores for t in s.tensors().values()]
    assert all(torch.equal(a, b) for a, b in zip(after, before[1], strict=True))


def test_a_demotion_for_a_pool_without_an_arena_is_refused():
    k, v = random_pool()
    before = [b.clone() for b in k + v]
    with pytest.raises(ArenaMissing, match="registered no tier arena"):
        InProcessCompactor(k, v, page_size=PAGE).compact(two_plans())
    assert all(torch.equal(a, b) for a, b in zip(k + v, before, strict=True))


@pytest.fixture(scope="module")
def compactor(tmp_path_factory):
    process = CompactorProcess(tmp_path_factory.mktemp("compactor")).start()
    yield process
    process.stop()


@pytest.fixture
def shared():
    pool = create_shared_buffers(
        num_layers=LAYERS,
        num_slots=SLOTS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
        page_size=PAGE,
        directory=DEFAULT_POOL_DIR,
    )
    k, v = random_pool(seed=3)
    for dst, src in zip(pool.k + pool.v, k + v, strict=True):
        dst.copy_(src)
    arena = create_shared_arena(
        FMT,
        num_groups=GROUPS,
        num_layers=LAYERS,
        kv_heads=HEADS,
        full_dtype=torch.bfloat16,
        directory=DEFAULT_POOL_DIR,
    )
    yield pool, arena
    pool.close()
    arena.close()


def test_the_sidecar_demotes_the_same_bytes_into_the_shared_arena(compactor, shared):
    pool, arena = shared
    plans = two_plans()
    want = expected_groups(pool.k, pool.v, plans)
    k_ref, v_ref = [b.clone() for b in pool.k], [b.clone() for b in pool.v]
    for plan in plans:
        repack_kv_reference(k_ref, v_ref, plan.src_slots, plan.dst_slots)
    client = GrpcCompactor(
        compactor.target, pool.layout, timeout_s=120, register_timeout_s=120, arena=arena.layout
    )
    result = client.compact(plans)
    client.close()
    assert result.groups_demoted == 2 and result.slots_moved == sum(p.num_moves for p in plans)
    assert same_groups(arena.stores, torch.tensor([1, 4]), want)
    assert all(torch.equal(a, b) for a, b in zip(pool.k + pool.v, k_ref + v_ref, strict=True))


def test_the_sidecar_refuses_a_demotion_without_an_arena_and_writes_nothing(compactor, shared):
    pool, arena = shared
    before = [b.clone() for b in pool.k + pool.v]
    client = GrpcCompactor(compactor.target, pool.layout, timeout_s=30)  # no arena
    pool_id, epoch = client.register()
    with grpc.insecure_channel(compactor.target) as channel:
        stub = pb_grpc.CompactorStub(channel)
        request = pb.CompactRequest(
            pool_id=pool_id,
            epoch=epoch,
            plans=[plan_to_proto(p) for p in two_plans()],
            call_seq=client.fence.next_seq(),
        )
        with pytest.raises(grpc.RpcError) as error:
            stub.Compact(request, timeout=30)
    client.close()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "registered no tier arena" in error.value.details()
    assert all(torch.equal(a, b) for a, b in zip(pool.k + pool.v, before, strict=True))
    assert all(not t.any() for s in arena.stores for t in s.tensors().values())


def test_a_demotion_reading_a_pinned_page_is_refused_with_the_lease():
    from compactor_service.compactor import LeaseClaim, LeaseRefused
    from compactor_service.leases import InProcessLeaseStore

    k, v = random_pool()
    plans = two_plans()
    leases = InProcessLeaseStore()
    grant = leases.acquire("pass", "scheduler", ttl_ms=60_000)
    page = int(plans[0].demote_slots[0]) // PAGE
    leases.pin([page], "other-scheduler")
    stores = arena_stores()
    compactor = InProcessCompactor(k, v, leases=leases, page_size=PAGE)
    compactor.attach_arena(stores, FMT)
    demotion_only = [p.without_moves() for p in plans]  # the pinned page is only read
    with pytest.raises(LeaseRefused, match="pinned"):
        compactor.compact(demotion_only, LeaseClaim("pass", grant.token, "scheduler"))
    assert all(not t.any() for s in stores for t in s.tensors().values())


def test_a_demoting_pass_is_two_calls_demotions_first():
    from compactor_service.compactor import CompactResult, in_two_phases

    calls = []

    def record(plans, claim):
        calls.append([(p.num_demoted_groups, p.num_moves) for p in plans])
        return CompactResult(0, 0, 0.0, "test", groups_demoted=sum(c[0] for c in calls[-1]))

    plans = two_plans()
    result = in_two_phases(record, plans, None)
    moves = [p.num_moves for p in plans]
    assert calls == [[(1, 0), (1, 0)], [(0, moves[0]), (0, moves[1])]]
    assert result.groups_demoted == 2
    calls.clear()
    in_two_phases(record, [p.without_demotion() for p in plans], None)
    assert len(calls) == 1  # nothing to order: one call


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU (not in CI)")
def test_gpu_the_sidecar_demotes_into_a_cuda_arena_by_ipc(compactor):
    """GPU only: the scheduler's CUDA pool and tier arena exported by IPC; the sidecar
    quantizes each demotion on the device into the arena, the bytes those of the tier's
    quantizer in this process, then moves the slots."""
    from compactor_service.cuda_ipc import export_cuda_buffers
    from compactor_service.shared_arena import export_cuda_arena

    k, v = random_pool(seed=4)
    k, v = [b.cuda() for b in k], [b.cuda() for b in v]
    plans = two_plans()
    want = expected_groups(k, v, plans)
    k_ref, v_ref = [b.clone() for b in k], [b.clone() for b in v]
    for plan in plans:
        repack_kv_reference(k_ref, v_ref, plan.src_slots.cuda(), plan.dst_slots.cuda())
    arena = export_cuda_arena(
        FMT,
        num_groups=GROUPS,
        num_layers=LAYERS,
        kv_heads=HEADS,
        full_dtype=torch.bfloat16,
        device="cuda",
    )
    client = GrpcCompactor(
        compactor.target, export_cuda_buffers(k, v, PAGE), timeout_s=120, arena=arena.layout
    )
    result = client.compact(plans)
    client.close()
    torch.cuda.synchronize()
    assert result.groups_demoted == 2
    assert same_groups(arena.stores, torch.tensor([1, 4], device="cuda"), want)
    assert all(torch.equal(a, b) for a, b in zip(k + v, k_ref + v_ref, strict=True))
