"""The lease-store contract: the in-process store and the Redis store (against a real
redis-server on a loopback port) run this same suite."""

from __future__ import annotations

import itertools
import threading
import time
import uuid

import pytest

from compactor_service.leases import InProcessLeaseStore
from compactor_service.redis_leases import LeaseStoreUnavailable, RedisLeaseStore
from tests.redis_server import RedisServer

TTL_MS = 1_000


class FakeClock:
    """A settable millisecond clock for the in-process store."""

    def __init__(self) -> None:
        self.now_ms = 1_000

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: int) -> None:
        self.now_ms += ms


class WallClock:
    """Redis expires keys on its own clock: advancing means waiting."""

    def advance(self, ms: int) -> None:
        time.sleep(ms / 1000 + 0.05)


@pytest.fixture(params=["in-process", "redis"])
def store_and_clock(request):
    if request.param == "in-process":
        clock = FakeClock()
        return InProcessLeaseStore(clock_ms=clock), clock
    server = request.getfixturevalue("redis_server")
    return RedisLeaseStore(server.url, namespace=uuid.uuid4().hex), WallClock()


def test_exclusive_lease_and_strictly_increasing_fencing_tokens(store_and_clock):
    store, _ = store_and_clock
    first = store.acquire("pool:1:req:a", "compactor-1", ttl_ms=TTL_MS)
    assert first is not None
    assert store.acquire("pool:1:req:a", "compactor-2", ttl_ms=TTL_MS) is None
    other = store.acquire("pool:1:req:b", "compactor-2", ttl_ms=TTL_MS)
    assert other.token > first.token
    assert store.release(first)
    again = store.acquire("pool:1:req:a", "compactor-2", ttl_ms=TTL_MS)
    assert again.token > other.token


def test_expired_lease_is_superseded_and_its_token_refused(store_and_clock):
    store, clock = store_and_clock
    stale = store.acquire("r", "compactor-1", ttl_ms=TTL_MS)
    assert store.is_current("r", stale.token)
    clock.advance(TTL_MS)  # TTL elapsed: a stalled pass loses its lease
    assert not store.is_current("r", stale.token)
    fresh = store.acquire("r", "compactor-2", ttl_ms=TTL_MS)
    assert fresh is not None and fresh.token > stale.token
    assert not store.is_current("r", stale.token)  # a late commit of the old pass is refused
    assert store.renew(stale, ttl_ms=TTL_MS) is None and not store.release(stale)
    assert store.is_current("r", fresh.token)


def test_renew_extends_only_the_current_grant(store_and_clock):
    store, clock = store_and_clock
    lease = store.acquire("r", "c", ttl_ms=TTL_MS)
    clock.advance(600)
    renewed = store.renew(lease, ttl_ms=TTL_MS)
    assert renewed.token == lease.token and renewed.expires_at_ms > lease.expires_at_ms
    clock.advance(600)  # past the first TTL, inside the renewed one
    assert store.is_current("r", lease.token)
    impostor = type(lease)("r", "someone-else", lease.token, lease.expires_at_ms)
    assert store.renew(impostor, ttl_ms=TTL_MS) is None and not store.release(impostor)


@pytest.mark.parametrize("ttl_ms", [0, -5, 1.5, True])
def test_bad_ttl_is_refused(store_and_clock, ttl_ms):
    store, _ = store_and_clock
    with pytest.raises(ValueError, match="ttl_ms"):
        store.acquire("r", "c", ttl_ms=ttl_ms)


def test_pins_are_refcounted_per_holder_and_never_negative(store_and_clock):
    store, _ = store_and_clock
    store.pin([10, 11], "req-a")
    store.pin([11], "req-b")
    store.pin([11], "req-b")
    assert store.pinned_by_others([10, 11, 12], "req-a") == [11]
    assert store.pinned_by_others([10, 11, 12], "req-b") == [10, 11]  # 11: req-a too
    store.unpin([11], "req-b")
    assert store.pinned_by_others([11], "req-a") == [11]  # req-b still holds one pin
    with pytest.raises(ValueError, match="does not pin"):
        store.unpin([10, 10], "req-a")  # pinned once, unpinned twice: refused whole
    assert store.pinned_by_others([10], "req-b") == [10]  # and nothing changed
    store.unpin([11], "req-b")
    store.unpin([10, 11], "req-a")
    assert store.pinned_by_others([10, 11], "anyone") == []


def test_contention_from_threads_grants_one_holder_at_a_time(store_and_clock):
    store, _ = store_and_clock
    winners = []

    def contend(name: str) -> None:
        for _ in range(200):
            lease = store.acquire("hot", name, ttl_ms=10_000)
            if lease is not None:
                winners.append(lease)
                assert store.release(lease)

    threads = [threading.Thread(target=contend, args=(f"t{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tokens = [lease.token for lease in winners]
    assert tokens and len(set(tokens)) == len(tokens)  # every grant got its own token


def test_redis_outage_refuses_leases_and_restart_keeps_tokens_growing(tmp_path):
    server = RedisServer(tmp_path).start()
    store = RedisLeaseStore(server.url, namespace="outage", timeout_s=0.5)
    before = store.acquire("r", "compactor-1", ttl_ms=TTL_MS)
    server.stop()  # Redis goes away mid-run: nothing may be granted or checked
    with pytest.raises(LeaseStoreUnavailable, match=r"unreachable.*no compaction may move KV"):
        store.acquire("r2", "compactor-1", ttl_ms=TTL_MS)
    with pytest.raises(LeaseStoreUnavailable):
        store.is_current("r", before.token)
    restarted = RedisServer(tmp_path, port=server.port).start()  # empty: no persistence
    try:
        after = store.acquire("r", "compactor-2", ttl_ms=TTL_MS)
        assert after is not None and after.token > before.token  # fencing survives restarts
        assert not store.is_current("r", before.token)
    finally:
        restarted.stop()


CONTENDER = """
import sys, time
from compactor_service.redis_leases import RedisLeaseStore
url, namespace, name = sys.argv[1:4]
store = RedisLeaseStore(url, namespace=namespace)
for _ in range(60):
    lease = store.acquire("hot", name, ttl_ms=10_000)
    if lease is None:
        continue
    start = time.time_ns()
    time.sleep(0.002)  # hold it: another process must not get it meanwhile
    print(lease.token, start, time.time_ns(), flush=True)
    assert store.release(lease)
"""


def test_contention_from_processes_on_redis_never_overlaps_holders(redis_server):
    """Four real processes race for one lease: holding intervals never overlap and
    every grant carries a larger fencing token than the one before it."""
    import subprocess
    import sys
    from pathlib import Path

    namespace = uuid.uuid4().hex
    root = Path(__file__).resolve().parents[1]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONTENDER, redis_server.url, namespace, f"p{i}"],
            stdout=subprocess.PIPE,
            text=True,
            cwd=root,
        )
        for i in range(4)
    ]
    grants = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        grants += [tuple(map(int, line.split())) for line in out.splitlines()]
    grants.sort(key=lambda g: g[1])
    assert len(grants) >= 4
    for (token_a, _, end_a), (token_b, start_b, _) in itertools.pairwise(grants):
        assert end_a <= start_b, "two processes held the lease at once"
        assert token_b > token_a
