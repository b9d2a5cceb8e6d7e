"""The decode hooks around the batched pass: the order of operations they rely on (run
through SGLang's own ``prepare_for_decode`` and ``alloc_for_decode``), the cadence of a
request whose protected prompt exceeds the budget, and, on a GPU, that the pass never
synchronises the host."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.managers import schedule_batch as schedule_batch_module
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

from sglang_evict.config import EvictionConfig
from sglang_evict.srt.active import Active
from sglang_evict.srt.hooks import (
    _after_forward_batch_init_new,
    _before_prepare_for_decode,
    compact_decode_batch,
)
from sglang_evict.srt.versioned import req_kv
from tests.kernel_device import CPU_TRITON, needs_cpu_triton
from tests.sglang_harness import Engine, finish_decode_step


def policy(page_size: int = 16, **overrides) -> EvictionConfig:
    values = dict(
        kv_budget_tokens=64,
        cadence_tokens=16,
        sink_tokens=4,
        window_tokens=16,
        scorer="knorm",
        page_size=page_size,
    )
    return EvictionConfig(**{**values, **overrides})


@needs_cpu_triton
def test_decode_step_order_the_hooks_rely_on(monkeypatch):
    """SGLang's ``prepare_for_decode`` with the plugin's BEFORE hook applied the way
    ``HookRegistry`` applies it: the pass waits for the forward stream, runs before
    ``alloc_for_decode``, which sees the shrunk lengths and puts the new token right
    after the survivors; SGLang's +1 lands on the shrunk lengths; and the positions
    hook turns them into each token's true position."""
    engine = Engine(page_size=16, config=policy())
    a = engine.add_request("a", list(range(100, 140)))
    b = engine.add_request("b", [1, 2, 3])
    for step in range(40):  # a reaches 80 = budget + cadence tokens: due next step
        engine.decode_batch([a, b], [1000 + step, 2000 + step])
    engine.check()
    assert not engine.pass_log and (req_kv(a).kv_committed_len, req_kv(b).kv_committed_len) == (
        80,
        43,
    )
    manager = engine.cache.evictor
    events = []
    monkeypatch.setattr(manager, "order_after_forward", lambda: events.append("wait-forward"))
    run_batch_pass = manager.run_batch_pass

    def recording_pass(due):
        events.append(("pass", [d.rid for d in due], [d.kv_len for d in due]))
        return run_batch_pass(due)

    monkeypatch.setattr(manager, "run_batch_pass", recording_pass)
    alloc_for_decode = schedule_batch_module.alloc_for_decode

    def recording_alloc(batch, token_per_req):
        events.append(("alloc", batch.seq_lens.tolist(), batch.seq_lens_cpu.tolist()))
        return alloc_for_decode(batch, token_per_req=token_per_req)

    monkeypatch.setattr(schedule_batch_module, "alloc_for_decode", recording_alloc)
    batch = engine.driver.schedule_batch([a, b])
    batch.sampling_info = SimpleNamespace(penalizer_orchestrator=SimpleNamespace(is_required=False))
    in_flight_seq_lens = batch.seq_lens  # what the overlapped forward still reads
    prepare = _wrap_fn(
        ScheduleBatch.prepare_for_decode, _before_prepare_for_decode, HookType.BEFORE
    )
    prepare(batch)

    assert events == ["wait-forward", ("pass", ["a"], [80]), ("alloc", [64, 43], [64, 43])]
    assert in_flight_seq_lens.tolist() == [80, 43]  # replaced, never edited in place
    assert batch.seq_lens.tolist() == [65, 44] == batch.seq_lens_cpu.tolist()
    assert (req_kv(a).kv_committed_len, req_kv(a).kv_allocated_len) == (65, 65)
    assert int(engine.row(a)[64]) == int(batch.out_cache_loc[0])  # right after survivors
    # ForwardBatch.init_new copies these tensors; the AFTER hook adds the offsets.
    monkeypatch.setattr(Active, "manager", manager)
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=2,
        input_ids=torch.zeros(2, dtype=torch.int64),
        req_pool_indices=batch.req_pool_indices,
        seq_lens=batch.seq_lens,
        out_cache_loc=batch.out_cache_loc,
        seq_lens_sum=int(batch.seq_lens.sum()),
        positions=batch.seq_lens - 1,
    )
    _after_forward_batch_init_new(forward_batch)
    assert forward_batch.positions.tolist() == [80, 43]  # 40 + 40 and 3 + 40
    for req, token, position, slot in zip(
        (a, b), (7, 8), forward_batch.positions.tolist(), batch.out_cache_loc.tolist(), strict=True
    ):
        engine._write_kv(slot, token, position)
        req.output_ids.append(token)
    engine.check()  # SGLang's checker, the cache's and each row's KV


@pytest.mark.parametrize("page_size", [1, pytest.param(16, marks=needs_cpu_triton)])
def test_a_prompt_longer_than_the_budget_runs_one_pass_per_cadence(page_size):
    """120 protected prompt tokens, budget 80, cadence 16: a request runs at most one
    pass per 16 tokens it generates, each evicting 16 tokens (a page at page size 16),
    never a pass per step evicting one."""
    engine = Engine(page_size=page_size, config=policy(page_size, kv_budget_tokens=80))
    req = engine.add_request("a", [(7 * i + 3) % 500 for i in range(120)])
    steps_with_a_pass = []
    for step in range(80):
        passes = engine.decode_batch([req], [1000 + step])
        if passes[0] is not None:
            steps_with_a_pass.append(step)
        engine.check()
    assert len(steps_with_a_pass) == len(engine.pass_log) >= 3
    assert all(later - earlier >= 16 for earlier, later in itertools.pairwise(steps_with_a_pass))
    for _, result in engine.pass_log:
        assert result.protected_over_budget and result.tokens_evicted == 16
        assert result.tokens_after == 136 and result.pages_freed == 16 // page_size


def test_grouped_passes_run_on_every_nth_step_and_serve_every_request_due_since():
    """``pass_group_steps`` 8: passes run on every 8th decode step only, one pass for
    the requests that fell due since the last (their prompts differ, so they fall due
    at different steps), and no request holds more than budget + cadence + 7 tokens."""
    config = policy(1, pass_group_steps=8)
    engine = Engine(page_size=1, config=config)
    reqs = [
        engine.add_request(f"r{i}", [(5 * i + 7 * j) % 500 + 1 for j in range(20 + 3 * i)])
        for i in range(4)
    ]
    manager = engine.cache.evictor
    steps_with_passes, peak = {}, 0
    for step in range(120):
        passes = engine.decode_batch(reqs, [1000 + step] * len(reqs))
        done = [p for p in passes if p is not None]
        if done:
            steps_with_passes[manager.decode_steps] = len(done)
        peak = max(peak, *(req_kv(r).kv_committed_len for r in reqs))
        engine.check()
    assert steps_with_passes and all(step % 8 == 0 for step in steps_with_passes)
    assert max(steps_with_passes.values()) >= 2  # requests due at different steps, one pass
    limit = config.kv_budget_tokens + config.cadence_tokens + 8 - 1
    assert limit - 8 < peak <= limit  # the group's wait is used, and bounded


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device: not synchronising the host is a property of GPU execution",
)
@pytest.mark.parametrize("compaction", ["hole_fill", "repack"])
@pytest.mark.parametrize("scorer", ["knorm", "streaming"])
def test_the_pass_never_synchronises_the_host_on_a_gpu(compaction, scorer):
    """The whole decode hook, on CUDA tensors under ``set_sync_debug_mode("error")``:
    any host wait (``.item()``, ``.tolist()``, a pageable copy, ``nonzero``, a
    synchronising ``free``) raises. The survivors equal the CPU run's for
    ``streaming`` (scores are exact); ``knorm`` runs its pool kernel there. (The CPU
    run needs Triton's interpreter for SGLang's paged allocator: where the process has
    it off, only the CUDA run and its invariants are checked.)"""
    from sglang_evict.srt.cpu_driver import MemoryDriver

    kept = {}
    for device in ("cpu", "cuda") if CPU_TRITON else ("cuda",):
        config = policy(compaction=compaction, scorer=scorer)
        driver = MemoryDriver(
            page_size=16,
            num_tokens=4096,
            num_layers=2,
            num_kv_heads=2,
            head_dim=64,
            config=config,
            device=device,
        )
        generator = torch.Generator().manual_seed(0)
        for buffer in (*driver.kv_pool.k_buffer, *driver.kv_pool.v_buffer):
            buffer.copy_(torch.randn(buffer.shape, generator=generator).to(buffer))
        reqs = []
        for i, length in enumerate((40, 56, 70)):
            req, _, _ = driver.admit(f"r{i}", list(range(i, i + length)))
            driver.prefill_done(req)
            reqs.append(req)
        manager = driver.evictor
        results = []
        for _ in range(40):
            batch = driver.schedule_batch(reqs)
            if device == "cuda":
                manager.forward_stream = torch.cuda.Stream()
                with torch.cuda.stream(manager.forward_stream):  # an in-flight "forward"
                    torch.randn(2048, 2048, device="cuda").matmul(
                        torch.randn(2048, 2048, device="cuda")
                    )
                torch.cuda.set_sync_debug_mode("error")
            try:
                results += compact_decode_batch(manager, batch)
            finally:
                if device == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
            finish_decode_step(batch, reqs)
        assert results, "no pass ran"
        for req in reqs:
            manager.check_request(req.rid, req_kv(req).kv_committed_len)
        kept[device] = [sorted(driver.positions(r).tolist()) for r in reqs]
    if scorer == "streaming" and "cpu" in kept:
        assert kept["cuda"] == kept["cpu"]
