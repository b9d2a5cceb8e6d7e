"""A real redis-server SIGKILLed around passes' ``Compact`` calls at random moments over
a generation (before a pass, right before the RPC, while it is in flight, right after
it returns), alone and together with SIGKILLs of a real compactor sidecar, through
SGLang's memory classes (``MemoryDriver``) with the Redis lease store on both sides.

After every step: SGLang's own busy-time memory check (free + cached + held = the pool;
its KV page check: no page both free and owned, none freed twice), the radix cache's
invariants, each request's eviction state, and every survivor's K/V bit for bit as it
was written. At the end: nothing leaked, and the outputs equal a full-cache replay
masked to the positions each step attended to.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest
import torch

from sglang_evict.models.reference_loop import GenerationRequest, generate
from tests.compactor_process import CompactorProcess
from tests.fault_driver import assert_nothing_lost, fault_model, make_driver, step_checks
from tests.redis_server import RedisServer

KILL_MOMENTS = ("before-rpc", "during-rpc", "after-rpc")


@pytest.fixture(scope="module")
def model():
    return fault_model()


def requests() -> list[GenerationRequest]:
    generator = torch.Generator().manual_seed(11)
    shared = torch.randint(256, (8,), generator=generator).tolist()
    return [
        GenerationRequest(
            f"r{i}",
            shared + torch.randint(256, (12,), generator=generator).tolist(),
            150,
            arrival_step=4 * i,
        )
        for i in range(3)
    ]


class RedisChaos:
    """Kills the redis-server at random passes, at each moment around the RPC in turn
    (and now and then between steps), and restarts it (same port, empty: no
    persistence, as after a crash) one or two decode steps later."""

    def __init__(self, redis: RedisServer, rng: random.Random, probability: float) -> None:
        self.redis, self.rng, self.probability = redis, rng, probability
        self.kills: Counter = Counter()
        self.steps_down = 0
        self.rpc_s = 0.002  # the last Compact call's duration: when "during" strikes

    def kill(self, moment: str) -> None:
        process = self.redis.process
        if process is None:
            return
        process.kill()
        process.wait(10)
        self.redis.process = None
        self.steps_down = self.rng.randint(1, 2)
        self.kills[moment] += 1

    def between_steps(self) -> None:
        if self.redis.process is None:
            self.steps_down -= 1
            if self.steps_down <= 0:
                self.redis.start()
        elif self.rng.random() < self.probability / 4:
            self.kill("between-steps")

    def around(self, compact):
        """``compact`` with a kill, now and then, before, during or right after it."""

        def compact_with_faults(plans, claim=None):
            moment = None
            if self.redis.process is not None and self.rng.random() < self.probability:
                moment = KILL_MOMENTS[sum(self.kills[m] for m in KILL_MOMENTS) % 3]
            timer = None
            if moment == "before-rpc":
                self.kill(moment)
            elif moment == "during-rpc":
                delay_s = self.rng.uniform(0.0, self.rpc_s)
                timer = threading.Timer(delay_s, self.kill, args=(moment,))
                timer.start()
            start = time.perf_counter()
            try:
                return compact(plans, claim)
            finally:
                self.rpc_s = time.perf_counter() - start
                if timer is not None:
                    timer.join()
                if moment == "after-rpc":
                    self.kill(moment)

        return compact_with_faults


@pytest.mark.parametrize("compactor_kills", [False, True], ids=["redis", "redis+compactor"])
def test_redis_killed_around_passes_corrupts_nothing_and_frees_no_page_twice(
    tmp_path, model, compactor_kills
):
    rng = random.Random(7 + compactor_kills)
    (tmp_path / "redis").mkdir()
    redis = RedisServer(tmp_path / "redis").start()
    extra = ("--supervise", "--fault-injection", "5:0.15") if compactor_kills else ()
    process = CompactorProcess(tmp_path, *extra, env={"SGLANG_EVICT_REDIS_URL": redis.url}).start()
    try:
        driver = make_driver(
            model,
            compactor="grpc",
            compactor_socket=str(process.socket),
            lease_store="redis",
            redis_url=redis.url,
        )
        manager = driver.evictor
        manager.lease.retry_interval_s = 0.0  # reach for Redis at every step
        sidecar = manager.compactor
        sidecar.retry_interval_s = 0.0  # probe a restarted sidecar at the next pass
        chaos = RedisChaos(redis, rng, probability=0.3)
        sidecar.compact = chaos.around(sidecar.compact)
        checks = step_checks(driver)

        def on_step(*args):
            checks(*args)
            if compactor_kills and not sidecar.sidecar_up:
                process.wait_healthy()
            chaos.between_steps()

        work = requests()
        result = generate(driver, model, work, on_step=on_step)
    finally:
        process.stop()
        redis.stop()
    print(
        f"\nRedis kills {dict(chaos.kills)}; passes {len(result.passes)}; lease releases "
        f"failed {manager.lease.release_failures}; passes completed in-process after a "
        f"failed call {manager.forced_completions}; sidecar {sidecar.sidecar_passes}, "
        f"fallback {sidecar.fallback_passes}"
    )
    assert all(chaos.kills[moment] >= 4 for moment in KILL_MOMENTS), chaos.kills
    assert manager.lease.release_failures >= 1  # Redis gone after a pass's copy
    assert len(result.passes) >= 40
    assert_nothing_lost(driver, model, work, result)
