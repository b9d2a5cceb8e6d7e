"""The compactor checks leases before any byte moves (in-process and Redis stores)."""

from __future__ import annotations

import re
import uuid

import pytest
import torch

from compactor_service.compactor import InProcessCompactor, LeaseClaim, LeaseRefused
from compactor_service.leases import InProcessLeaseStore
from compactor_service.redis_leases import RedisLeaseStore
from sglang_evict.passes.planner import plan_compaction
from tests.test_leases import FakeClock


@pytest.fixture(params=["in-process", "redis"])
def leases(request):
    if request.param == "in-process":
        return InProcessLeaseStore(clock_ms=FakeClock())
    return RedisLeaseStore(request.getfixturevalue("redis_server").url, uuid.uuid4().hex)


def setup(leases):
    k = [torch.randn(64, 2, 8) for _ in range(2)]
    v = [torch.randn(64, 2, 8) for _ in range(2)]
    compactor = InProcessCompactor(k, v, leases=leases, page_size=4)
    row = torch.arange(32, dtype=torch.int64)
    plan = plan_compaction(row, torch.tensor([0, 1, 2, 3, 9, 18, 27]), page_size=4)
    assert plan.num_moves > 0
    return compactor, plan, [b.clone() for b in (*k, *v)], (*k, *v)


def unchanged(before, buffers) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, buffers, strict=True))


def test_current_lease_compacts(leases):
    compactor, plan, before, buffers = setup(leases)
    lease = leases.acquire("pool:1:req:a", "scheduler", ttl_ms=10_000)
    result = compactor.compact([plan], LeaseClaim(lease.resource, lease.token, "req:a"))
    assert result.slots_moved == plan.num_moves and not unchanged(before, buffers)


def test_missing_stale_or_superseded_lease_moves_nothing(leases):
    compactor, plan, before, buffers = setup(leases)
    with pytest.raises(LeaseRefused, match="must present its lease"):
        compactor.compact([plan])
    old = leases.acquire("pool:1:req:a", "compactor-1", ttl_ms=10_000)
    assert leases.release(old)
    leases.acquire("pool:1:req:a", "compactor-2", ttl_ms=10_000)  # a newer holder
    with pytest.raises(LeaseRefused, match="not the current lease"):
        compactor.compact([plan], LeaseClaim(old.resource, old.token, "req:a"))
    assert unchanged(before, buffers)


@pytest.mark.parametrize("pinning_holder", ["req:b", "req:a"])
def test_plan_touching_a_pinned_page_moves_nothing_whoever_pins_it(leases, pinning_holder):
    """Pins mark shared prefixes, which no pass may move; the claim's holder name is the
    caller's word, so naming the pinning holder gets no plan past a pin."""
    compactor, plan, before, buffers = setup(leases)
    touched_page = int(plan.dst_slots[0]) // 4
    leases.pin([touched_page], pinning_holder)  # e.g. a radix node a request has locked
    lease = leases.acquire("pool:1:req:a", "scheduler", ttl_ms=10_000)
    with pytest.raises(LeaseRefused, match=re.escape(f"pages [{touched_page}] are pinned")):
        compactor.compact([plan], LeaseClaim(lease.resource, lease.token, pinning_holder))
    assert unchanged(before, buffers)
    leases.unpin([touched_page], pinning_holder)
    compactor.compact([plan], LeaseClaim(lease.resource, lease.token, "req:a"))
    assert not unchanged(before, buffers)


def test_pinned_lists_pages_anyone_pins(leases):
    leases.pin([3, 4], "req:a")
    leases.pin([4, 5], "req:b")
    assert leases.pinned([2, 3, 4, 5, 6]) == [3, 4, 5]
    leases.unpin([3, 4], "req:a")
    assert leases.pinned([3, 4, 5]) == [4, 5]
