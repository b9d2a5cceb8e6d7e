"""Bounded work per call and per client: a flood of plans is refused before it is
parsed, batches over the bounds are split by the client, a pool's passes in flight are
capped, registrations are bounded and expire unless renewed (``compactor_service.limits``).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from compactor_service.client import GrpcCompactor
from compactor_service.engine import CompactorEngine, UnknownPool
from compactor_service.limits import InFlight, LimitExceeded, ServerLimits
from compactor_service.runtime_dir import DEFAULT_POOL_DIR
from compactor_service.servicer import CompactorServicer
from compactor_service.shared_pool import PoolDirectory
from compactor_service.v1 import compactor_pb2 as pb
from compactor_service.wire import layout_to_proto, plan_to_proto
from tests.compactor_process import CompactorProcess, call, make_pool
from tests.test_compactor_service import two_request_plans


@pytest.fixture
def pools():
    made = []
    yield lambda: made.append(make_pool()) or made[-1]
    for shared in made:
        shared.close()


def expected_after(shared, plans) -> list[torch.Tensor]:
    expected = [b.clone() for b in shared.k + shared.v]
    for plan in plans:
        for buffer in expected:
            buffer[plan.dst_slots] = buffer[plan.src_slots]
    return expected


def register(target: str, shared, client_id: str) -> pb.RegisterPoolResponse:
    request = pb.RegisterPoolRequest(layout=layout_to_proto(shared.layout), client_id=client_id)
    code, details, reply = call(target, "RegisterPool", request)
    assert code == grpc.StatusCode.OK, details
    return pb.RegisterPoolResponse.FromString(reply)


def vm_kib(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def test_a_flood_of_empty_plans_is_refused_before_parsing_and_others_are_served(tmp_path, pools):
    process = CompactorProcess(tmp_path).start()
    try:
        attacker, victim = pools(), pools()
        flooded = register(process.target, attacker, "flooder")
        flood = pb.CompactRequest(
            pool_id=flooded.pool_id,
            epoch=flooded.epoch,
            plans=[pb.Plan(rid="r") for _ in range(250_000)],
        ).SerializeToString()
        assert len(flood) > 1_000_000
        peak_before_kib = vm_kib(process.process.pid, "VmHWM")
        with ThreadPoolExecutor(4) as flooders:
            outcomes = list(
                flooders.map(lambda _: call(process.target, "Compact", flood, 1.0), range(4))
            )
        for code, details, _ in outcomes:  # answered, not timed out: refused before work
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
            assert "more than 1024 plans in one request (--max-plans-per-call 1024)" in details
        peak_growth_mib = (vm_kib(process.process.pid, "VmHWM") - peak_before_kib) / 1024
        print(f"\nserver peak RSS growth under the flood: {peak_growth_mib:.0f} MiB")
        assert peak_growth_mib < 256  # 4 messages in flight, walked (never parsed), dropped
        plans = two_request_plans()
        expected = expected_after(victim, plans)
        client = GrpcCompactor(process.target, victim.layout, timeout_s=10)
        try:  # closed before the server stops: no heartbeat thread left to outlive it
            result = client.compact(plans)
        finally:
            client.close()
        assert result.slots_moved == sum(p.num_moves for p in plans)
        assert all(torch.equal(a, b) for a, b in zip(victim.k + victim.v, expected, strict=True))
    finally:
        process.stop()


@pytest.fixture(scope="module")
def tight_compactor(tmp_path_factory):
    """A compactor with small bounds: 1 plan and 3 moves per call, 1 MiB messages,
    3 pools in all and 2 per client, 2-second leases."""
    process = CompactorProcess(
        tmp_path_factory.mktemp("tight"),
        "--max-plans-per-call",
        "1",
        "--max-moves-per-call",
        "3",
        "--max-message-mb",
        "1",
        "--max-pools",
        "3",
        "--max-pools-per-client",
        "2",
        "--pool-lease-s",
        "2",
        "--reap-interval-s",
        "0.1",
    ).start()
    yield process
    process.stop()


def test_batches_over_the_call_bounds_are_refused_and_the_client_splits_them(
    tight_compactor, pools
):
    shared = pools()
    plans = two_request_plans()
    assert all(p.num_moves <= 3 for p in plans) and sum(p.num_moves for p in plans) > 3
    registered = register(tight_compactor.target, shared, "splitter")
    assert registered.limits.max_plans_per_call == 1 and registered.limits.max_moves_per_call == 3
    too_many = pb.CompactRequest(
        pool_id=registered.pool_id,
        epoch=registered.epoch,
        plans=[plan_to_proto(p) for p in plans],
    )
    code, details, _ = call(tight_compactor.target, "Compact", too_many)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-plans-per-call 1" in details
    oversized = pb.CompactRequest(pool_id=registered.pool_id, epoch=registered.epoch)
    oversized.plans.add(new_row_le64=bytes(2 << 20))
    code, _, _ = call(tight_compactor.target, "Compact", oversized)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED  # gRPC's own message-size bound
    call(
        tight_compactor.target,
        "UnregisterPool",
        pb.UnregisterPoolRequest(pool_id=registered.pool_id, epoch=registered.epoch),
    )
    expected = expected_after(shared, plans)
    client = GrpcCompactor(tight_compactor.target, shared.layout, timeout_s=10)
    result = client.compact(plans)  # two calls of one plan each
    assert result.slots_moved == sum(p.num_moves for p in plans)
    assert all(torch.equal(a, b) for a, b in zip(shared.k + shared.v, expected, strict=True))
    client.close()


def test_registrations_are_bounded_per_client_and_in_all(tight_compactor, pools):
    shared = pools()
    held = [register(tight_compactor.target, shared, "a") for _ in range(2)]
    request = pb.RegisterPoolRequest(layout=layout_to_proto(shared.layout), client_id="a")
    code, details, _ = call(tight_compactor.target, "RegisterPool", request)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "client 'a' holds 2 pools (--max-pools-per-client 2)" in details
    held.append(register(tight_compactor.target, shared, "b"))
    request.client_id = "c"
    code, details, _ = call(tight_compactor.target, "RegisterPool", request)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "(--max-pools 3)" in details
    for reply in held:
        unregister = pb.UnregisterPoolRequest(pool_id=reply.pool_id, epoch=reply.epoch)
        assert call(tight_compactor.target, "UnregisterPool", unregister)[0] == grpc.StatusCode.OK


def test_a_silent_registration_expires_whatever_its_client_id_while_a_live_one_stays(
    tight_compactor, pools
):
    shared = pools()
    silent = register(tight_compactor.target, shared, "no host, no pid: \u2603")
    live = GrpcCompactor(tight_compactor.target, shared.layout, timeout_s=10, client_id="live")
    live.register()
    live_epoch = live.epoch
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # watch without renewing: Stats names no pool
        _, _, reply = call(tight_compactor.target, "Stats", pb.StatsRequest())
        if pb.StatsResponse.FromString(reply).pools_expired:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("no registration ever expired")
    heartbeat = pb.HeartbeatRequest(pool_id=silent.pool_id, epoch=silent.epoch)
    code, details, _ = call(tight_compactor.target, "Heartbeat", heartbeat)
    assert code == grpc.StatusCode.NOT_FOUND and "expired" in details
    # The live client's heartbeats kept its pool: a pass goes through on its registration.
    assert live.compact(two_request_plans()).slots_moved > 0
    assert live.epoch == live_epoch
    live.close()


def test_an_engine_registration_lives_one_lease_after_its_last_call():
    now = [0.0]
    engine = CompactorEngine(
        pool_dir=PoolDirectory(DEFAULT_POOL_DIR),
        limits=ServerLimits(pool_lease_s=10.0),
        clock_s=lambda: now[0],
    )
    shared = make_pool()
    try:
        pool_id, epoch = engine.register_pool(shared.layout, "x")
        now[0] = 9.0
        assert engine.heartbeat(pool_id, epoch) == 10.0
        now[0] = 18.0
        assert engine.drop_expired_pools() == []  # renewed at 9 s
        engine.compact(pool_id, epoch, [])  # a call renews too
        now[0] = 27.9
        assert engine.drop_expired_pools() == []
        now[0] = 28.0
        assert engine.drop_expired_pools() == [pool_id]
        with pytest.raises(UnknownPool, match="register the pool again"):
            engine.heartbeat(pool_id, epoch)
    finally:
        shared.close()


class _Context:
    """What the servicer asks of a gRPC context: the caller is still waiting."""

    def time_remaining(self):
        return None

    def is_active(self):
        return True

    def abort(self, code, details):
        raise AssertionError(f"{code}: {details}")


def test_a_pools_passes_in_flight_are_capped_so_others_keep_their_threads():
    """Three passes for one pool while it is busy: two are admitted (one runs, one
    waits), the third is refused at once; a pass of another pool is served meanwhile."""
    engine = CompactorEngine(
        pool_dir=PoolDirectory(DEFAULT_POOL_DIR), limits=ServerLimits(max_inflight_per_pool=2)
    )
    servicer = CompactorServicer(engine)
    busy_pool, other_pool = make_pool(), make_pool()
    try:
        busy_id, busy_epoch = engine.register_pool(busy_pool.layout, "busy")
        other_id, other_epoch = engine.register_pool(other_pool.layout, "other")
        request = pb.CompactRequest(pool_id=busy_id, epoch=busy_epoch)
        engine.pools[busy_id].lock.acquire()  # the pool's pass is "running"
        waiting = [threading.Thread(target=servicer.Compact, args=(request, _Context()))]
        waiting.append(threading.Thread(target=servicer.Compact, args=(request, _Context())))
        for thread in waiting:
            thread.start()
        while sum(servicer.inflight._counts.values()) < 2:
            time.sleep(0.01)
        with pytest.raises(LimitExceeded, match="already has 2 calls in flight"):
            servicer.Compact(request, _Context())
        other = pb.CompactRequest(pool_id=other_id, epoch=other_epoch)
        other.plans.extend(plan_to_proto(p) for p in two_request_plans())
        assert servicer.Compact(other, _Context()).slots_moved > 0
        engine.pools[busy_id].lock.release()
        for thread in waiting:
            thread.join(timeout=60)
        assert engine.stats.passes == 3 and not servicer.inflight._counts
    finally:
        busy_pool.close()
        other_pool.close()


def test_in_flight_counts_are_per_key():
    inflight = InFlight(1, "pool", "--max-inflight-per-pool")
    inflight.enter("a")
    inflight.enter("b")
    with pytest.raises(LimitExceeded, match=r"pool 'a' already has 1 calls in flight"):
        inflight.enter("a")
    inflight.leave("a")
    inflight.enter("a")
