"""Passes and their leases through SGLang's memory classes (``MemoryDriver``), with a real
compactor and a real redis-server where the point needs them:

* a pass slower than its lease still commits (the lease is taken around the moves);
* a pass that keeps failing backs its requests off, says so once with the knob, and
  counts by cause (metrics, server report);
* a pass split over several ``Compact`` calls whose later call is refused (the lease
  expired between calls, or an invalid plan) is completed in-process, never abandoned
  after a partial copy;
* the compactor's lease store going down is told apart from the compactor going down:
  the pass fails before anything moves, no in-process completion without a lease.

Each run checks every survivor's K/V bit for bit after every step and the outputs
against a full-cache replay masked to what each step attended to.
"""

from __future__ import annotations

import logging
import time

import pytest

from compactor_service.redis_leases import LeaseStoreUnavailable
from compactor_service.v1 import compactor_pb2 as pb
from sglang_evict.models.reference_loop import generate
from sglang_evict.passes.failures import MAX_BACKOFF_STEPS
from tests.compactor_process import CompactorProcess
from tests.fault_driver import assert_nothing_lost, fault_model, make_driver, step_checks
from tests.redis_server import RedisServer
from tests.test_pass_faults import requests


@pytest.fixture(scope="module")
def model():
    return fault_model()


def checked_generate(driver, model, work=None):
    """``generate`` with every check after every step (``fault_driver.step_checks``),
    then nothing lost and the outputs against the masked full-cache replay."""
    work = work or requests()
    result = generate(driver, model, work, on_step=step_checks(driver))
    assert_nothing_lost(driver, model, work, result)
    return result


def leased_sidecar(tmp_path, redis_url: str, *extra: str):
    """A real compactor checking leases in ``redis_url`` under a fresh namespace, and
    the settings of a driver using it with the same store: ``(process, fields)``."""
    import uuid

    namespace = uuid.uuid4().hex
    process = CompactorProcess(
        tmp_path, "--lease-namespace", namespace, *extra, env={"SGLANG_EVICT_REDIS_URL": redis_url}
    ).start()
    fields = dict(
        compactor="grpc",
        compactor_socket=str(process.socket),
        lease_store="redis",
        redis_url=redis_url,
        lease_namespace=namespace,
    )
    return process, fields


def slow_scoring(manager, delay_s: float) -> None:
    """Every scorer of ``manager`` takes ``delay_s`` longer (a large pass on a busy
    host): wraps the batched scoring the pass calls."""
    import sglang_evict.passes.device_work as pass_device

    original = pass_device.score_rows_or_fall_back

    def slow(*args, **kwargs):
        time.sleep(delay_s)
        return original(*args, **kwargs)

    manager._slow_scoring = (pass_device, original)
    pass_device.score_rows_or_fall_back = slow


@pytest.fixture
def restore_scoring():
    import sglang_evict.passes.device_work as pass_device

    original = pass_device.score_rows_or_fall_back
    yield
    pass_device.score_rows_or_fall_back = original


def test_a_pass_slower_than_its_lease_commits_in_process(model, restore_scoring):
    driver = make_driver(model, lease_ttl_ms=1)
    slow_scoring(driver.evictor, 0.005)  # every pass outlasts its 1 ms lease 5 times
    result = checked_generate(driver, model)
    assert len(result.passes) >= 40
    assert driver.evictor.failures.counts == {}
    assert min(p.duration_s for _, _, p in result.passes) > 0.001


def test_a_pass_slower_than_its_lease_commits_through_the_sidecar(
    model, redis_server, tmp_path, restore_scoring
):
    """Scheduler and compactor check the same Redis: the compactor would refuse a
    token its grant outlived."""
    process, fields = leased_sidecar(tmp_path, redis_server.url)
    try:
        driver = make_driver(model, **fields, lease_ttl_ms=1)
        slow_scoring(driver.evictor, 0.02)
        result = checked_generate(driver, model)
    finally:
        process.stop()
    sidecar = driver.evictor.compactor
    assert len(result.passes) >= 40
    assert driver.evictor.failures.counts == {}
    assert sidecar.sidecar_passes == len({step for _, step, _ in result.passes})
    assert sidecar.fallback_passes == 0


def test_a_pass_that_keeps_failing_backs_off_says_so_once_and_is_counted(model, caplog):
    from prometheus_client import CollectorRegistry

    from sglang_evict.metrics import EvictionMetrics
    from sglang_evict.srt.active import Active, PassTotals
    from sglang_evict.srt.introspection import plugin_report

    driver = make_driver(model)
    manager = driver.evictor
    # Another grant holds this scheduler's pass lease for good: every pass is refused.
    assert manager.leases.acquire(manager.lease.resource, "someone-else", 10**9)
    registry = CollectorRegistry()
    totals, metrics = PassTotals(), EvictionMetrics.create("streaming", registry)
    saved = (Active.totals, Active.metrics)
    Active.totals, Active.metrics = totals, metrics
    attempts_by_step = []
    try:
        with caplog.at_level(logging.DEBUG, logger="sglang_evict"):
            result = generate(
                driver,
                model,
                requests(),
                on_step=lambda *_: attempts_by_step.append(manager.failures.counts["lease-busy"]),
            )
    finally:
        Active.totals, Active.metrics = saved
    assert result.passes == []  # nothing ever committed: every request kept its KV
    steps, attempts = len(attempts_by_step), attempts_by_step[-1]
    # Backoff: 3 requests over ~150 due steps each try a few times, not at every step.
    assert 3 <= attempts <= 3 * 12, (attempts, steps)
    assert steps > 3 * attempts
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    message = errors[0].getMessage()
    assert "lease-busy" in message and "--kv-lease-namespace" in message
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
    }
    failures = [
        v
        for (name, labels), v in samples.items()
        if name == "sglang_evict:pass_failures_total" and ("cause", "lease-busy") in labels
    ]
    assert failures == [attempts]
    assert samples[("sglang_evict:pass_failure_streak", ())] == attempts
    report = plugin_report(manager, totals)
    assert report["pass_failure_causes"] == {"lease-busy": attempts}
    assert report["pass_failure_streak"] == attempts
    assert MAX_BACKOFF_STEPS >= 2


class SplitPassFaults:
    """Around ``GrpcCompactor._compact_call``: in the passes sent in several calls,
    after the first call, in turn: let the lease expire and skip its renewal (the
    compactor refuses call 2: ABORTED), let it expire with renewal (the client cannot
    renew: refused before call 2), or send an invalid plan (INVALID_ARGUMENT)."""

    KINDS = ("expired-not-renewed", "expired-renewal-fails", "invalid-plan")

    def __init__(self, client, ttl_s: float) -> None:
        self.client, self.ttl_s = client, ttl_s
        self.calls_in_pass = 0
        self.split_passes = 0
        self.struck: dict[str, int] = dict.fromkeys(self.KINDS, 0)
        self._call = client._compact_call
        self._compact = client.compact
        client._compact_call = self.compact_call
        client.compact = self.compact

    def compact(self, plans, claim=None):
        self.calls_in_pass = 0
        self.kind = None
        if len(plans) > 1:
            self.kind = self.KINDS[self.split_passes % len(self.KINDS)]
            self.split_passes += 1
            self.struck[self.kind] += 1
            if self.kind == "expired-not-renewed" and claim is not None:
                claim = type(claim)(claim.resource, claim.token, claim.holder)  # no renew
        return self._compact(plans, claim)

    def compact_call(self, plans, claim):
        self.calls_in_pass += 1
        if self.calls_in_pass == 2 and self.kind is not None:
            if self.kind == "invalid-plan":
                bad = pb.Plan()
                bad.CopyFrom(plans[0])
                bad.page_size = 0
                plans = [bad]
        result = self._call(plans, claim)
        if self.calls_in_pass == 1 and self.kind in self.KINDS[:2]:
            time.sleep(2 * self.ttl_s)  # the lease expires between the calls
        return result


def test_a_split_pass_refused_after_its_first_call_is_completed_in_process(
    model, redis_server, tmp_path
):
    process, fields = leased_sidecar(tmp_path, redis_server.url, "--max-plans-per-call", "1")
    ttl_ms = 150
    try:
        driver = make_driver(
            model,
            **fields,
            compactor_timeout_ms=50,  # the lease lives max(150, 2 x 50) ms
            lease_ttl_ms=ttl_ms,
        )
        manager = driver.evictor
        faults = SplitPassFaults(manager.compactor.primary, ttl_ms / 1000)
        result = checked_generate(driver, model)
    finally:
        process.stop()
    print(f"\nsplit passes {faults.split_passes}, struck {faults.struck}")
    assert all(n >= 3 for n in faults.struck.values()), faults.struck
    assert manager.forced_completions >= sum(faults.struck.values())
    assert len(result.passes) >= 40


def test_the_compactors_lease_store_down_fails_the_pass_before_anything_moves(model, tmp_path):
    """Redis dies between the scheduler's grant and the compactor's check: the
    compactor says its lease store is down (not that it is), so the client neither
    marks it down nor completes the pass in-process without a lease."""
    (tmp_path / "redis").mkdir()
    redis = RedisServer(tmp_path / "redis").start()
    process, fields = leased_sidecar(tmp_path, redis.url)
    try:
        driver = make_driver(model, **fields)
        manager = driver.evictor
        sidecar = manager.compactor
        compact = sidecar.compact
        outcomes = []

        def compact_with_redis_dying(plans, claim=None):
            if len(outcomes) == 5 and redis.process is not None:
                redis.stop()  # after the scheduler's grant, before the compactor's check
            try:
                result = compact(plans, claim)
            except LeaseStoreUnavailable:
                outcomes.append("lease-store-unavailable")
                raise
            outcomes.append("moved")
            return result

        sidecar.compact = compact_with_redis_dying
        result = checked_generate(driver, model)
    finally:
        process.stop()
        redis.stop()
    assert outcomes[:5] == ["moved"] * 5
    assert outcomes[5] == "lease-store-unavailable"
    assert manager.forced_completions == 0  # nothing was completed without a lease
    assert sidecar.fallback_passes == 0 and sidecar.sidecar_up
    assert manager.failures.counts["lease-store-unavailable"] >= 1
    assert len(result.passes) >= 5
