"""The eviction mechanism on SGLang's real memory classes (CPU tensors): passes free
exactly the planned pages, survivors' KV stays bit-identical at its logical position,
shared prefixes are untouched, compacted KV is never offered as a prefix, nothing leaks.
"""

from __future__ import annotations

import random

import pytest
import torch

from sglang_evict.config import EvictionConfig
from sglang_evict.srt.versioned import req_kv
from tests.sglang_harness import Engine

MATRIX = [(p, s) for p in (1, 16) for s in ("repack", "hole_fill")]


def evicting(page_size, strategy="hole_fill", budget=64, **overrides):
    config = EvictionConfig(
        kv_budget_tokens=budget,
        cadence_tokens=16,
        sink_tokens=4,
        window_tokens=16,
        scorer="knorm",
        compaction=strategy,
        page_size=page_size,
        **overrides,
    )
    return Engine(page_size=page_size, config=config)


@pytest.mark.parametrize(("page_size", "strategy"), MATRIX)
def test_passes_free_exactly_the_planned_pages_and_keep_survivors_bit_identical(
    page_size, strategy
):
    engine = evicting(page_size, strategy)
    req = engine.add_request("a", list(range(100, 140)))
    engine.check()
    for step in range(300):
        engine.decode_step(req, 1000 + step)
        engine.check()  # KV of every row entry matches its token and logical position
        assert req_kv(req).kv_committed_len <= 64 + 16
    assert len(engine.pass_log) >= 10
    for _, result in engine.pass_log:
        assert result.pages_freed > 0 and result.tokens_after == 64
    # The allocator's free count rose by exactly the pages each plan freed.
    assert len(engine.free_log) == len(engine.pass_log)
    for planned, observed in engine.free_log:
        assert observed == planned
    if page_size == 1:
        assert all(r.slot_copies == 0 for _, r in engine.pass_log)
    # The next token is generated at its true position: 40 prompt + 300 decoded.
    assert req_kv(req).kv_committed_len + engine.position_offset(req) == 340
    engine.finish(req)
    engine.check()


@pytest.mark.parametrize("page_size", [1, 16])
def test_budget_larger_than_any_request_is_a_no_op(page_size):
    plain = Engine(page_size=page_size)
    off = evicting(page_size, budget=4000)
    for engine in (plain, off):
        reqs = [engine.add_request(f"r{i}", [7, 8, 9] * 10 + [i] * 5) for i in range(3)]
        for step in range(120):
            for req in reqs:
                engine.decode_step(req, step % 50)
        rows = [engine.row(r).clone() for r in reqs]
        engine.rows_seen = rows
    assert not off.pass_log
    for a, b in zip(plain.rows_seen, off.rows_seen, strict=True):
        assert torch.equal(a, b)
    for layer in range(2):
        assert torch.equal(plain.kv.k_buffer[layer], off.kv.k_buffer[layer])
    assert plain.free_token_count() == off.free_token_count()


def finish_system_prompt(engine, system):
    """A request carrying only the system prompt finishes: its KV enters the tree."""
    req = engine.add_request("system", system)
    engine.decode_step(req, 77_777)  # a token no later prompt continues with
    engine.finish(req)


@pytest.mark.parametrize(("page_size", "strategy"), MATRIX)
def test_shared_system_prompt_pages_are_untouched_by_a_heavily_evicting_request(
    page_size, strategy
):
    engine = evicting(page_size, strategy, budget=40)
    system = list(range(500, 532))  # 32 tokens: two 16-token pages
    finish_system_prompt(engine, system)
    a = engine.add_request("a", [*system, 1, 2, 3])
    b = engine.add_request("b", [*system, 4, 5])
    # Both hit the system prompt; after prefill each prompt's pages are tree-owned too.
    assert req_kv(a).cache_protected_len >= 32 and req_kv(b).cache_protected_len >= 32
    shared_slots = engine.row(a)[:32].clone()
    assert torch.equal(shared_slots, engine.row(b)[:32])
    shared_kv = [buf[shared_slots].clone() for buf in engine.kv.k_buffer + engine.kv.v_buffer]
    for step in range(200):
        engine.decode_step(a, 2000 + step)  # a evicts heavily
        if step < 20:
            engine.decode_step(b, 3000 + step)  # b stays under its trigger
        engine.check()
    assert engine.pass_log and all(rid == "a" for rid, _ in engine.pass_log)
    assert torch.equal(engine.row(a)[:32], shared_slots)
    for before, buf in zip(shared_kv, engine.kv.k_buffer + engine.kv.v_buffer, strict=True):
        assert torch.equal(buf[shared_slots], before)
    # A third request still hits the shared prefix.
    match = engine.match([*system, 9, 9])
    assert torch.equal(match.indices, shared_slots)
    for req in (a, b):
        engine.finish(req)
    engine.check()


@pytest.mark.parametrize(("page_size", "strategy"), MATRIX)
def test_compacted_kv_is_never_offered_as_a_prefix(page_size, strategy):
    engine = evicting(page_size, strategy, budget=40)
    prompt = list(range(10, 42))
    req = engine.add_request("a", prompt)
    for step in range(120):
        engine.decode_step(req, 300 + step)
    assert engine.pass_log
    first_evicted = engine.cache.evictor.first_evicted_position("a", req_kv(req).kv_committed_len)
    tokens = prompt + list(req.output_ids)
    engine.finish(req)
    engine.check()
    # A later request with the same prompt + output matches at most the intact prefix,
    # and every matched slot holds the KV of exactly its token at its position.
    match = engine.match([*tokens, 1])
    matched = match.indices
    assert len(matched) <= first_evicted
    assert len(matched) >= (32 // page_size) * page_size  # the prompt itself is cached
    k0 = engine.kv.k_buffer[0][matched]
    assert torch.equal(k0[:, 0, 0], torch.arange(len(matched), dtype=torch.float32))
    assert torch.equal(k0[:, 0, 1], torch.tensor(tokens[: len(matched)], dtype=torch.float32))


@pytest.mark.parametrize(("page_size", "strategy"), MATRIX)
def test_two_hundred_mixed_requests_leak_nothing(page_size, strategy):
    rng = random.Random(page_size * 7 + len(strategy))
    engine = evicting(page_size, strategy, budget=48)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([16, 32, 40]))] for _ in range(5)]
    started = 0
    while started < 200 or engine.running:
        while started < 200 and len(engine.running) < 24:
            prompt = rng.choice(prefixes) + [
                rng.randrange(1000) for _ in range(rng.randrange(1, 20))
            ]
            req = engine.add_request(f"r{started}", prompt)
            req.budget_left = rng.randrange(1, 150)
            started += 1
        batch = list(engine.running.values())
        engine.decode_batch(batch, [rng.randrange(1000) for _ in batch])
        for req in batch:
            req.budget_left -= 1
            if req.budget_left == 0:
                engine.finish(req)
        engine.check()
    assert engine.pass_log
    assert all(planned == observed for planned, observed in engine.free_log)
    # Nothing leaked: every slot is free or held (unlocked, evictable) by the tree.
    total = engine.free_token_count() + engine.cache.evictable_size()
    assert engine.cache.protected_size() == 0
    assert total == engine.num_tokens


@pytest.mark.parametrize("page_size", [1, 16])
def test_retracted_evicted_request_is_forgotten_and_re_prefills_at_regular_positions(page_size):
    engine = evicting(page_size)
    req = engine.add_request("a", list(range(100, 140)))
    for step in range(120):
        engine.decode_step(req, 1000 + step)
    manager = engine.cache.evictor
    assert "a" in manager.states and manager.position_offset("a") > 0
    row = req_kv(req).req_pool_idx
    tokens = list(req.origin_input_ids) + list(req.output_ids)
    engine.driver.retract(req)
    engine.check()
    assert "a" not in manager.states and manager.offsets_by_row[row] == 0
    # Nothing of the compacted request entered the tree; all its private KV is free.
    assert engine.free_token_count() + engine.cache.evictable_size() == engine.num_tokens
    # Re-prefilled from its tokens, it holds regular KV and evicts again later.
    again = engine.add_request("a", tokens)
    assert engine.position_offset(again) == 0
    for step in range(80):
        engine.decode_step(again, 5000 + step)
        engine.check()
    assert engine.position_offset(again) > 0
    engine.finish(again)
    engine.check()
