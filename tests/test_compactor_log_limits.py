"""Refusal log lines are rate-limited per client and cause (``logs.LogRateLimiter``): a
flood of refused calls costs a few lines and a count of the rest, and every refusal is
either logged or counted exactly once.

Measured on a real compactor (the last test): 2,020 refused calls of two causes wrote
2,020 lines (518 KB) before; 5 lines and one count per cause after (4 KB with the
start-up and shutdown lines).
"""

from __future__ import annotations

import bisect
import logging
import random
import time

import grpc
import pytest

from compactor_service.engine import CompactorEngine
from compactor_service.logs import LogRateLimiter, Suppressed
from compactor_service.runtime_dir import DEFAULT_POOL_DIR
from compactor_service.servicer import CompactorServicer, peer_host
from compactor_service.shared_pool import PoolDirectory
from compactor_service.tls import open_channel
from compactor_service.v1 import compactor_pb2 as pb
from tests.compactor_process import SERVICE, CompactorProcess


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_key_logs_its_first_lines_then_counts_the_rest_until_its_window_ends():
    clock = Clock()
    limiter = LogRateLimiter(per_key=5, in_all=100, interval_s=10, max_keys=8, clock=clock)
    decisions = [limiter.admit("a") for _ in range(50)]
    assert [log for log, _ in decisions] == [True] * 5 + [False] * 45
    assert all(due == [] for _, due in decisions)
    assert limiter.admit("b") == (True, [])  # another key has its own lines
    clock.now += 9.9
    assert limiter.expired() == []
    clock.now += 0.1  # a's window ends: its count is due at its next event
    assert limiter.admit("a") == (True, [Suppressed("a", 45, 10.0)])
    clock.now += 10
    assert limiter.expired() == []  # b suppressed nothing; a's new window neither
    for _ in range(7):
        limiter.admit("c")
    clock.now += 3
    assert limiter.drain() == [Suppressed("c", 2, 3.0)]  # shutdown: whatever is pending
    assert limiter.drain() == []


def test_expired_reports_windows_that_ended_without_a_later_event():
    clock = Clock()
    limiter = LogRateLimiter(per_key=1, in_all=100, interval_s=10, max_keys=8, clock=clock)
    for key in ("a", "a", "a", "b"):
        limiter.admit(key)
    clock.now += 10
    assert limiter.expired() == [Suppressed("a", 2, 10.0)]
    assert limiter.drain() == []


def test_lines_in_all_are_capped_and_the_rest_summarised_once_per_window():
    clock = Clock()
    limiter = LogRateLimiter(per_key=1, in_all=3, interval_s=10, max_keys=8, clock=clock)
    logged = [limiter.admit(key)[0] for key in ("a", "b", "c", "d") * 2]
    assert logged == [True, True, True, False] + [False] * 4  # d: over the lines in all
    clock.now += 10  # a new window of 3 lines: a, b and c's counts fit, d's does not...
    assert limiter.expired() == [
        Suppressed("a", 1, 10.0),
        Suppressed("b", 1, 10.0),
        Suppressed("c", 1, 10.0),
    ]
    assert limiter.admit("e") == (False, [])  # ... and nor does a new key's line
    clock.now += 10  # d's count is summarised when that window ends; e's fits the next
    assert limiter.expired() == [Suppressed(None, 2, 10.0, kinds=1), Suppressed("e", 1, 10.0)]


def test_keys_beyond_max_keys_drop_the_least_recently_used_into_the_summary():
    clock = Clock()
    limiter = LogRateLimiter(per_key=1, in_all=100, interval_s=10, max_keys=2, clock=clock)
    for key in ("a", "a", "b", "a", "c"):  # c evicts b (a was used after b)
        limiter.admit(key)
    assert list(limiter._windows) == ["a", "c"]
    limiter.admit("b")  # evicts a, with its 2 suppressed
    assert limiter.drain() == [Suppressed(None, 2, 0.0, kinds=1)]


def test_every_event_is_logged_or_counted_once_and_lines_stay_bounded():
    """Random floods over many keys (more than it tracks) and 100 s: lines + counts ==
    events, and any 10 s holds at most two windows' worth of lines (``in_all`` and the
    window's summary, twice) until the shutdown's drain."""
    rng = random.Random(7)
    clock = Clock()
    limiter = LogRateLimiter(per_key=3, in_all=20, interval_s=10, max_keys=16, clock=clock)
    events = logged = counted = 0
    lines: list[float] = []

    def report(due: list[Suppressed]) -> None:
        nonlocal counted
        counted += sum(s.count for s in due)
        lines.extend([clock.now] * len(due))

    for _ in range(20_000):
        clock.now += rng.expovariate(200)
        log, due = limiter.admit(rng.randrange(rng.choice([2, 40])))
        events += 1
        logged += log
        lines.extend([clock.now] * log)
        report(due)
        if rng.random() < 0.01:
            report(limiter.expired())
    for index, start in enumerate(lines):
        assert bisect.bisect_left(lines, start + 10) - index <= 2 * (20 + 1)
    report(limiter.drain())
    assert logged + counted == events
    assert logged < events / 10


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:127.0.0.1:54321", "ipv4:127.0.0.1"),
        ("ipv6:[::1]:54321", "ipv6:[::1]"),
        ("unix:", "unix:"),
        ("unix:/run/x.sock", "unix:/run/x.sock"),
        ("ipv4:" + "9" * 500, "ipv4:" + "9" * 75),
    ],
)
def test_a_peer_is_its_address_without_the_port(peer, host):
    assert peer_host(peer) == host


class _Context:
    def __init__(self, port: int) -> None:
        self.port = port

    def peer(self):
        return f"ipv4:127.0.0.1:{self.port}"

    def set_trailing_metadata(self, metadata):
        pass

    def abort(self, code, details):
        raise grpc.RpcError(code)


def test_the_servicer_logs_a_few_refusals_per_cause_and_counts_the_rest():
    clock = Clock()
    engine = CompactorEngine(pool_dir=PoolDirectory(DEFAULT_POOL_DIR))
    servicer = CompactorServicer(engine, refusal_log=LogRateLimiter(clock=clock))
    heartbeat = servicer._guarded(
        "Heartbeat", pb.HeartbeatRequest, servicer.bounds["Heartbeat"], servicer.Heartbeat
    )
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("sglang_evict.compactor")
    logger.addHandler(handler)
    try:
        unknown = pb.HeartbeatRequest(pool_id="gone", epoch=1).SerializeToString()
        for port in range(40_000, 40_100):  # a new connection each time: still one client
            with pytest.raises(grpc.RpcError):
                heartbeat(unknown, _Context(port))
        for _ in range(3):
            with pytest.raises(grpc.RpcError):
                heartbeat(b"\x27", _Context(1))  # malformed: another cause
        clock.now += 10
        servicer.log_suppressed()  # what the reaper does every sweep
    finally:
        logger.removeHandler(handler)
    messages = [r.getMessage() for r in records]
    assert messages.count("Heartbeat refused") == 8
    assert [m for m in messages if "suppressed" in m] == [
        "Heartbeat refused: 95 more refusals of this kind suppressed in the last 10 s"
    ]
    assert {r.peer for r in records} == {"ipv4:127.0.0.1"}


# --- a real compactor --------------------------------------------------------------------


def test_a_flood_of_refusals_writes_a_few_lines_and_a_count(tmp_path):
    process = CompactorProcess(tmp_path).start()
    calls = {"Heartbeat": 2000, "Compact": 20}
    requests = {
        "Heartbeat": pb.HeartbeatRequest(pool_id="gone", epoch=1).SerializeToString(),
        "Compact": b"\x27",  # malformed
    }
    try:
        start = time.monotonic()
        with open_channel(process.target, None) as channel:
            for method, count in calls.items():
                stub = channel.unary_unary(SERVICE + method)
                for _ in range(count):
                    with pytest.raises(grpc.RpcError):
                        stub(requests[method], timeout=10)
        flood_s = time.monotonic() - start
    finally:
        stopped = process.stop()
    assert stopped == 0  # the counts of windows still open are logged at the stop
    entries = process.log_entries()
    print(f"\n{sum(calls.values())} refusals in {flood_s:.1f} s: {process.log.stat().st_size} B")
    for method, count in calls.items():
        refusals = [e for e in entries if e["msg"] == f"{method} refused"]
        summaries = [e for e in entries if e["msg"].startswith(f"{method} refused: ")]
        assert len(refusals) <= 5 * (int(flood_s // 10) + 1), method
        assert summaries and all("more refusals of this kind" in e["msg"] for e in summaries)
        assert len(refusals) + sum(e["suppressed"] for e in summaries) == count, method
