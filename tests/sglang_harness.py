"""Synthetic-KV engine over ``MemoryDriver`` (SGLang's real memory classes on CPU,
driven through the calls its scheduler makes, with the plugin's pass in between).

The K/V rows written for a token encode (token id, logical position), so every slot a
request reads can be checked against the token and position it must hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler_components.invariant_checker import (
    SchedulerInvariantChecker,
)
from sglang.srt.managers.scheduler_components.pool_stats_observer import (
    SchedulerPoolStatsObserver,
)
from sglang.srt.runtime_context import get_server_args
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from sglang_evict.config import EvictionConfig
from sglang_evict.srt.backend import EvictingRadixCache
from sglang_evict.srt.cpu_driver import MemoryDriver
from sglang_evict.srt.pools import free_slots
from sglang_evict.srt.versioned import advance_after_decode_alloc, req_kv

NUM_LAYERS, NUM_HEADS, HEAD_DIM = 2, 2, 8


def kv_rows(token_id: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[layers, heads, dim] K and V for a token at a position (deterministic)."""
    generator = torch.Generator().manual_seed(token_id * 100_003 + 7)
    k = torch.randn(NUM_LAYERS, NUM_HEADS, HEAD_DIM, generator=generator)
    k[:, :, 0] = position  # channel 0: position; channel 1: token id
    k[:, :, 1] = token_id
    v = torch.randn(NUM_LAYERS, NUM_HEADS, HEAD_DIM, generator=generator)
    v[:, :, 0] = position
    return k, v


def finish_decode_step(batch, reqs: list) -> None:
    """What ``prepare_for_decode`` does after the plugin's pass: allocate the decode
    slots, then advance the counters (``MemoryDriver.prepare_decode`` in pieces, for
    tests that watch the pass alone)."""
    from sglang.srt.mem_cache.allocation import alloc_for_decode

    alloc_for_decode(batch, token_per_req=1)
    advance_after_decode_alloc(reqs)


def sglang_checker(driver: MemoryDriver) -> SchedulerInvariantChecker:
    """SGLang's own scheduler invariant checker over a driver's real components; its
    'last batch' is a ScheduleBatch of the running requests (after a decode step the
    scheduler's last and running batch are one object)."""
    reqs = list(driver.running.values())
    batch = None
    if reqs:
        batch = ScheduleBatch.init_new(
            reqs,
            driver.req_to_token_pool,
            driver.allocator,
            driver.cache,
            SimpleNamespace(vocab_size=1 << 20, is_encoder_decoder=False),
            enable_overlap=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        )

    def running_batch():
        return batch

    common = dict(
        tree_cache=driver.cache,
        token_to_kv_pool_allocator=driver.allocator,
        req_to_token_pool=driver.req_to_token_pool,
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        full_tokens_per_layer=None,
        swa_tokens_per_layer=None,
        max_total_num_tokens=driver.num_tokens,
        get_last_batch=running_batch,
        get_running_batch=running_batch,
    )
    observer = build_component(
        SchedulerPoolStatsObserver,
        session_controller=None,
        hisparse_coordinator=None,
        enable_hisparse=False,
        **common,
    )
    return build_component(
        SchedulerInvariantChecker,
        disaggregation_mode=DisaggregationMode.NULL,
        page_size=driver.page_size,
        server_args=get_server_args(),
        pool_stats_observer=observer,
        scheduler_stage_metrics=None,  # 0.5.23; the busy and idle checks do not read it
        **common,
    )


def build_component(cls, **fields):
    """A scheduler component (a dataclass) from the fields its release declares: 0.5.17
    and 0.5.23 differ in a few (``versioned`` lists the plugin's own differences)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{name: value for name, value in fields.items() if name in names})


@dataclass
class Engine:
    page_size: int
    config: EvictionConfig | None = None
    num_tokens: int = 8192
    pass_log: list = field(default_factory=list)  # (rid, PassResult)
    # (tokens the plans freed, tokens the allocator gained) per decode batch with passes
    free_log: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.driver = MemoryDriver(
            page_size=self.page_size,
            num_tokens=self.num_tokens,
            num_layers=NUM_LAYERS,
            num_kv_heads=NUM_HEADS,
            head_dim=HEAD_DIM,
            config=self.config,
            max_context=2048,
        )
        self.kv = self.driver.kv_pool
        self.allocator = self.driver.allocator
        self.cache = self.driver.cache
        self.cache_params = self.driver.cache_params
        self.running = self.driver.running

    def add_request(
        self,
        rid: str,
        prompt: list[int],
        extra_key: str | None = None,
        custom_params: dict | None = None,
    ):
        req, prefix_len, slots = self.driver.admit(rid, prompt, extra_key, custom_params)
        for position, slot in zip(range(prefix_len, len(prompt)), slots.tolist(), strict=True):
            self._write_kv(slot, prompt[position], position)
        self.driver.prefill_done(req)
        return req

    def decode_step(self, req, token_id: int):
        return self.decode_batch([req], [token_id])[0]

    def decode_batch(self, reqs: list, token_ids: list[int]) -> list:
        free_before = self.free_token_count()
        slots, positions, passes = self.driver.prepare_decode(reqs)
        planned = sum(r.pages_freed for r in passes if r is not None) * self.page_size
        if planned:
            # The allocator's gain before this step's own decode slots were taken.
            new_pages = self._decode_pages_taken(reqs, slots)
            self.free_log.append((planned, self.free_token_count() - free_before + new_pages))
        for req, result in zip(reqs, passes, strict=True):
            if result is not None:
                self.pass_log.append((req.rid, result))
        for slot, token_id, position, req in zip(
            slots.tolist(), token_ids, positions.tolist(), reqs, strict=True
        ):
            self._write_kv(slot, token_id, position)
            req.output_ids.append(token_id)
        return passes

    def finish(self, req) -> None:
        self.driver.finish(req)

    def match(self, tokens: list[int], extra_key: str | None = None):
        return self.driver.match(tokens, extra_key)

    def position_offset(self, req) -> int:
        manager = self.driver.evictor
        return 0 if manager is None else manager.position_offset(req.rid)

    def row(self, req) -> torch.Tensor:
        return self.driver.row(req)

    def free_token_count(self) -> int:
        return self.driver.free_tokens()

    def check(self) -> None:
        """Every invariant, after every operation: SGLang's own busy-time memory check
        and KV page check, the cache's, each request's state, the KV each request reads,
        and global slot accounting (nothing leaked or shared)."""
        sglang_checker(self.driver).self_check_during_busy()
        p = self.page_size
        if isinstance(self.cache, EvictingRadixCache):
            self.cache.check_invariants()
        owned = [free_slots(self.allocator)]
        tree = [self.cache.all_values_flatten().long()] if self.cache.total_size() else []
        owned += tree
        tree_set = set(torch.cat(tree).tolist()) if tree else set()
        for req in self.running.values():
            if isinstance(self.cache, EvictingRadixCache):
                self.cache.evictor.check_request(req.rid, req_kv(req).kv_committed_len)
            row = self.row(req)
            tokens = list(req.origin_input_ids) + list(req.output_ids)
            positions = self.driver.positions(req)
            expected_token = torch.tensor([tokens[int(q)] for q in positions], dtype=torch.float32)
            k0 = self.kv.k_buffer[0][row]
            assert torch.equal(k0[:, 0, 0], positions.float()), f"{req.rid}: KV position mismatch"
            assert torch.equal(k0[:, 0, 1], expected_token), f"{req.rid}: KV token mismatch"
            private = row[req_kv(req).cache_protected_len :]
            if p > 1 and row.numel():  # the request owns whole pages from its private start
                pages = torch.unique(private // p)
                private = (pages[:, None] * p + torch.arange(p)).reshape(-1)
            assert not (set(private.tolist()) & tree_set), f"{req.rid}: private slot in tree"
            owned.append(private)
        every = torch.cat(owned) if owned else torch.zeros(0, dtype=torch.int64)
        assert torch.unique(every).numel() == every.numel(), "a slot is owned twice"
        assert every.numel() == self.num_tokens, (
            f"leak: {self.num_tokens - every.numel()} slots neither free, cached nor held"
        )

    def _decode_pages_taken(self, reqs, slots: torch.Tensor) -> int:
        """Tokens the decode allocation took from the free list this step."""
        if self.page_size == 1:
            return len(reqs)
        return int((slots % self.page_size == 0).sum()) * self.page_size

    def _write_kv(self, slot: int, token_id: int, position: int) -> None:
        k, v = kv_rows(token_id, position)
        for layer in range(NUM_LAYERS):
            self.kv.k_buffer[layer][slot] = k[layer]
            self.kv.v_buffer[layer][slot] = v[layer]
