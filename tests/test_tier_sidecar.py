"""The quantized tier with the compactor as a real sidecar process: a pass's demotions
quantized by the sidecar into the arena shared with it (``compactor_service.demotion``),
then its moves, through SGLang's memory classes (``MemoryDriver``) — and through its
faults: SIGKILLs at every point of a pass, stalls past the deadline, a Redis outage.
After each: outputs equal the in-process tier's, no group is attended before its write
was confirmed (every tier forward is checked against the dequantized reference), and
the arena, the pool and the radix cache hold nothing at the end."""

from __future__ import annotations

import pytest
import torch

from sglang_evict.models.reference_loop import GenerationRequest, generate
from sglang_evict.models.reference_model import PagedLlama, build_tiny_llama
from tests.compactor_process import CompactorProcess
from tests.fault_driver import step_checks
from tests.test_tier_mechanism import ReferenceChecking, driver_for, tier_config

PAGE = 16


@pytest.fixture(scope="module")
def model():
    return PagedLlama(build_tiny_llama(seed=3, hidden_size=256, num_heads=4, num_kv_heads=2))


def work(num_requests: int = 3, new_tokens: int = 150) -> list[GenerationRequest]:
    generator = torch.Generator().manual_seed(7)
    return [
        GenerationRequest(
            f"r{i}", torch.randint(256, (40,), generator=generator).tolist(), new_tokens, 2 * i
        )
        for i in range(num_requests)
    ]


def assert_idle_clean(driver) -> None:
    arena = driver.tier_arena
    assert arena.free_groups == arena.num_groups and not arena.owned
    arena.check()
    assert driver.cache.protected_size() == 0
    assert driver.free_tokens() + driver.cache.evictable_size() == driver.num_tokens
    driver.cache.check_invariants()
    assert driver.evictor.num_tracked_requests() == 0


def test_the_sidecar_demotes_and_outputs_equal_the_in_process_tier(tmp_path, model):
    reference = generate(driver_for(model, PAGE, tier_config(PAGE)), model, work())
    process = CompactorProcess(tmp_path).start()
    config = tier_config(PAGE, compactor="grpc", compactor_socket=str(process.socket))
    driver = driver_for(model, PAGE, config)
    checking = ReferenceChecking(model)
    result = generate(driver, checking, work())
    compactor = driver.evictor.compactor
    stats = process.stats()
    process.stop()
    assert result.outputs == reference.outputs
    assert [(r, p.tokens_demoted, p.tokens_dropped) for r, _, p in result.passes] == [
        (r, p.tokens_demoted, p.tokens_dropped) for r, _, p in reference.passes
    ]
    assert sum(p.tokens_demoted for _, _, p in result.passes) > 0
    assert any(p.tokens_dropped for _, _, p in result.passes)  # swaps ran
    assert compactor.sidecar_passes > 0 and compactor.fallback_demotions == 0
    assert not driver.evictor.tier_fallbacks
    assert stats["groups_demoted"] > 0, stats
    assert checking.checked > 100 and checking.max_error < 1e-4, checking.max_error
    assert_idle_clean(driver)


def sidecar_driver(model, process, **fields):
    config = tier_config(PAGE, compactor="grpc", compactor_socket=str(process.socket), **fields)
    driver = driver_for(model, PAGE, config)
    driver.evictor.compactor.retry_interval_s = 0.0  # probe the sidecar at the next pass
    return driver


def test_a_sidecar_sigkilled_at_every_point_of_demoting_passes_loses_nothing(tmp_path, model):
    reference = generate(driver_for(model, PAGE, tier_config(PAGE)), model, work())
    process = CompactorProcess(tmp_path, "--supervise", "--fault-injection", "13:0.3").start()
    driver = sidecar_driver(model, process)
    sidecar = driver.evictor.compactor
    checks = step_checks(driver)

    def on_step(*args):
        checks(*args)
        if not sidecar.sidecar_up:  # killed: continue once the supervisor restarted it
            process.wait_healthy()

    result = generate(driver, ReferenceChecking(model), work(), on_step=on_step)
    process.stop()
    kills = sum(e["msg"] == "compactor process died; restarting" for e in process.log_entries())
    print(
        f"\n{kills} SIGKILLs; sidecar calls {sidecar.sidecar_passes}, demotions in-process "
        f"{sidecar.fallback_demotions}, passes in-process {sidecar.fallback_passes}, "
        f"groups checked {checks.tier.groups_checked}, by cause {dict(sidecar.fallbacks_by_cause)}"
    )
    assert kills >= 8, f"only {kills} SIGKILLs landed"
    assert sidecar.fallback_demotions >= 1 and sidecar.sidecar_passes > 0
    assert checks.tier.groups_checked > 100
    assert result.outputs == reference.outputs  # every pass completed: the same decisions
    assert_idle_clean(driver)


def test_a_sidecar_stalled_past_its_deadline_in_a_demotion_is_fenced(tmp_path, model):
    from tests.test_pass_fence import Continuer

    reference = generate(driver_for(model, PAGE, tier_config(PAGE)), model, work())
    timeout_ms = 300
    process = CompactorProcess(tmp_path, "--fault-injection", "9:0.35:stop").start()
    continuer = Continuer(process.process.pid, delay_s=2 * timeout_ms / 1000)
    try:
        driver = sidecar_driver(model, process, compactor_timeout_ms=timeout_ms)
        sidecar = driver.evictor.compactor
        checks = step_checks(driver)
        result = generate(driver, ReferenceChecking(model), work(), on_step=checks)
    finally:
        if process.process.poll() is None:
            process.kill()  # a stopped process too (see test_pass_fence)
        continuer.stop()
    print(
        f"\ncontinued {continuer.continues} times; fence waits {sidecar.primary.fence.waits}; "
        f"demotions in-process {sidecar.fallback_demotions}, passes in-process "
        f"{sidecar.fallback_passes}, forced {driver.evictor.forced_completions}"
    )
    assert continuer.continues >= 4 and sidecar.fallback_demotions >= 1
    assert result.outputs == reference.outputs
    assert_idle_clean(driver)


def test_redis_killed_around_demoting_passes_attends_no_half_written_group(tmp_path, model):
    import random

    from tests.redis_server import RedisServer
    from tests.test_pass_faults import KILL_MOMENTS, RedisChaos

    (tmp_path / "redis").mkdir()
    redis = RedisServer(tmp_path / "redis").start()
    process = CompactorProcess(tmp_path, env={"SGLANG_EVICT_REDIS_URL": redis.url}).start()
    try:
        driver = sidecar_driver(model, process, lease_store="redis", redis_url=redis.url)
        manager = driver.evictor
        manager.lease.retry_interval_s = 0.0
        sidecar = manager.compactor
        chaos = RedisChaos(redis, random.Random(3), probability=0.4)
        sidecar.compact = chaos.around(sidecar.compact)
        checks = step_checks(driver)

        def on_step(*args):
            checks(*args)
            chaos.between_steps()

        result = generate(driver, ReferenceChecking(model), work(), on_step=on_step)
    finally:
        process.stop()
        redis.stop()
    demoted = sum(p.tokens_demoted for _, _, p in result.passes)
    print(
        f"\nRedis kills {dict(chaos.kills)}; passes {len(result.passes)} ({demoted} tokens "
        f"demoted); failures {dict(manager.failures.counts)}; groups checked "
        f"{checks.tier.groups_checked}"
    )
    assert sum(chaos.kills[m] for m in KILL_MOMENTS) >= 4, chaos.kills
    assert demoted > 0 and checks.tier.groups_checked > 50
    assert_idle_clean(driver)
