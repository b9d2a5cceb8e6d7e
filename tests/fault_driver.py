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


class TierWitness:
    """Every group a request's tier holds, every step: its stored bytes equal the
    reference quantizer's bytes of the K/V its tokens had when first written (a
    ``KVWitness``'s record), so a group attended is always whole and right."""

    def __init__(self, driver: MemoryDriver, kv: KVWitness) -> None:
        self.driver, self.kv = driver, kv
        self.groups_checked = 0

    def check(self) -> None:
        from sglang_evict_kernels.tier_format import quantize_groups_reference

        arena = self.driver.tier_arena
        layers = len(self.driver.kv_pool.k_buffer)
        for rid, slots in arena.owned.items():
            for slot, positions in zip(slots, arena.positions_of(rid), strict=True):
                rows = [self.kv.seen[(rid, p)] for p in positions]
                for layer, store in enumerate(arena.stores):
                    keys = torch.stack([r[layer] for r in rows]).unsqueeze(0)
                    values = torch.stack([r[layers + layer] for r in rows]).unsqueeze(0)
                    want = quantize_groups_reference(
                        keys, values, arena.fmt, arena.fmt.outliers_for_layer(layer)
                    )
                    got = store.take(torch.tensor([slot]))
                    for name, tensor in want.tensors().items():
                        assert torch.equal(getattr(got, name), tensor), (
                            f"{rid}: tier slot {slot} ({name}, layer {layer}) differs from "
                            f"its tokens' quantized K/V"
                        )
                self.groups_checked += 1


def step_checks(driver: MemoryDriver, witness: KVWitness | None = None):
    """An ``on_step`` for ``generate`` checking, after every step, SGLang's busy-time
    memory check, the radix cache's invariants, each request's eviction state, every
    survivor's K/V bit for bit (``witness``) and, with a tier, the arena's invariants
    and every held group's bytes (``TierWitness``)."""
    from sglang_evict.srt.versioned import req_kv
    from tests.sglang_harness import sglang_checker

    manager, witness = driver.evictor, witness or KVWitness(driver)
    tier = TierWitness(driver, witness) if driver.tier_arena is not None else None
    check_tier = tier.check if tier is not None else lambda: None

    def check(*_):
        sglang_checker(driver).self_check_during_busy()
        driver.cache.check_invariants()
        for req in driver.running.values():
            manager.check_request(req.rid, req_kv(req).kv_committed_len)
        witness.check()
        if driver.tier_arena is not None:
            driver.tier_arena.check()
        check_tier()

    check.tier = tier

    return check


def assert_nothing_lost(driver: MemoryDriver, model: PagedLlama, work, result) -> None:
    """Nothing leaked or freed twice (every slot is free or the tree's), and the outputs
    equal a full-cache replay masked to what each step attended to."""
    from sglang_evict.models.reference_loop import generate

    assert driver.cache.protected_size() == 0
    assert driver.free_tokens() + driver.cache.evictable_size() == driver.num_tokens
    replay = generate(plain_driver(model), model, work, attend_masks=result.attended)
    assert replay.outputs == result.outputs
