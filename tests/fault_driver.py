"""The small evicting setup the fault tests drive through SGLang's memory classes: a
tiny paged Llama and a ``MemoryDriver`` whose policy runs a pass every other token."""

from __future__ import annotations

import torch

from sglang_evict.config import EvictionConfig
from sglang_evict.models.reference_model import PagedLlama, build_tiny_llama
from sglang_evict.srt.cpu_driver import MemoryDriver

PAGE = 4
POOL_TOKENS = 2048
MAX_CONTEXT = 512


def fault_model() -> PagedLlama:
    return PagedLlama(build_tiny_llama(seed=3))


def make_driver(model: PagedLlama, **fields) -> MemoryDriver:
    """Budget 32, cadence 2, 2 sinks, window 8, page size 4; ``fields`` adds the
    compactor and lease-store settings under test."""
    config = EvictionConfig(
        kv_budget_tokens=32,
        cadence_tokens=2,
        sink_tokens=2,
        window_tokens=8,
        page_size=PAGE,
        **fields,
    )
    return MemoryDriver.for_model(
        model, page_size=PAGE, num_tokens=POOL_TOKENS, config=config, max_context=MAX_CONTEXT
    )


def plain_driver(model: PagedLlama) -> MemoryDriver:
    """The same pool without eviction (the full-cache reference)."""
    return MemoryDriver.for_model(
        model, page_size=PAGE, num_tokens=POOL_TOKENS, max_context=MAX_CONTEXT
    )


class KVWitness:
    """The K/V of every (request, position) as first seen right after it was written;
    every later step, each row entry must still hold exactly those bits."""

    def __init__(self, driver: MemoryDriver) -> None:
        self.driver = driver
        self.seen: dict[tuple[str, int], list[torch.Tensor]] = {}

    def check(self) -> None:
        buffers = (*self.driver.kv_pool.k_buffer, *self.driver.kv_pool.v_buffer)
        for rid, req in self.driver.running.items():
            row, positions = self.driver.row(req), self.driver.positions(req)
            for slot, position in zip(row.tolist(), positions.tolist(), strict=True):
                now = [buf[slot].clone() for buf in buffers]
                expected = self.seen.setdefault((rid, position), now)
                assert all(torch.equal(a, b) for a, b in zip(now, expected, strict=True)), (
                    f"{rid}: the K/V at position {position} (slot {slot}) changed"
                )


def step_checks(driver: MemoryDriver, witness: KVWitness | None = None):
    """An ``on_step`` for ``generate`` checking, after every step, SGLang's busy-time
    memory check, the radix cache's invariants, each request's eviction state and every
    survivor's K/V bit for bit (``witness``)."""
    from sglang_evict.srt.versioned import req_kv
    from tests.sglang_harness import sglang_checker

    manager, witness = driver.evictor, witness or KVWitness(driver)

    def check(*_):
        sglang_checker(driver).self_check_during_busy()
        driver.cache.check_invariants()
        for req in driver.running.values():
            manager.check_request(req.rid, req_kv(req).kv_committed_len)
        witness.check()

    return check


def assert_nothing_lost(driver: MemoryDriver, model: PagedLlama, work, result) -> None:
    """Nothing leaked or freed twice (every slot is free or the tree's), and the outputs
    equal a full-cache replay masked to what each step attended to."""
    from sglang_evict.models.reference_loop import generate

    assert driver.cache.protected_size() == 0
    assert driver.free_tokens() + driver.cache.evictable_size() == driver.num_tokens
    replay = generate(plain_driver(model), model, work, attend_masks=result.attended)
    assert replay.outputs == result.outputs
