"""Mechanism state kept by the evictor: what a query-reading scorer needs, and the
per-request state's life cycle (the query ring itself: ``test_query_capture``)."""

from __future__ import annotations

import pytest
import torch

from sglang_evict.config import EvictionConfig
from sglang_evict.passes.manager import DueRequest
from sglang_evict.srt.versioned import req_kv
from tests.sglang_harness import Engine


def test_query_reading_scorer_without_a_query_ring_fails_clearly_and_changes_nothing():
    config = EvictionConfig(
        kv_budget_tokens=48, cadence_tokens=16, window_tokens=16, scorer="window", page_size=16
    )
    engine = Engine(page_size=16, config=config)
    req = engine.add_request("a", list(range(8)))
    manager = engine.cache.evictor  # a driver without the model's query heads: no ring
    for step in range(60):  # every due pass fails before anything moves; decoding goes on
        engine.decode_step(req, step)
        engine.check()
    assert not engine.pass_log and req_kv(req).kv_committed_len == 68
    free_before = engine.free_token_count()
    due = DueRequest(
        "a", req_kv(req).req_pool_idx, 68, num_shared=req_kv(req).cache_protected_len, prompt_len=8
    )
    with pytest.raises(ValueError, match="needs the requests' captured queries, but no query ring"):
        manager.run_batch_pass([due])
    assert engine.free_token_count() == free_before and "a" not in manager.states
    engine.check()


def test_forget_drops_state_and_position_offset():
    config = EvictionConfig(
        kv_budget_tokens=48, cadence_tokens=16, window_tokens=16, scorer="streaming", page_size=1
    )
    engine = Engine(page_size=1, config=config)
    req = engine.add_request("a", list(range(40)))
    for step in range(40):
        engine.decode_step(req, step)
    manager = engine.cache.evictor
    assert manager.position_offset("a") > 0 and manager.offsets_by_row[req_kv(req).req_pool_idx] > 0
    row = req_kv(req).req_pool_idx
    engine.finish(req)  # finishing goes through the cache, which forgets the request
    assert "a" not in manager.states
    assert manager.offsets_by_row[row] == 0


@pytest.mark.parametrize("scorer", ["knorm", "triattention"])
def test_pool_kernel_scoring_keeps_the_same_survivors_as_the_torch_path(scorer, tmp_path):
    from sglang_evict.scorers.triattention_stats import TriAttentionStats, save_stats

    params = {}
    if scorer == "triattention":
        g = torch.Generator().manual_seed(0)
        shape = (2, 2, 4)  # harness model: 2 layers, 2 heads, head_dim 8
        stats = TriAttentionStats(
            q_mean_real=torch.randn(shape, generator=g),
            q_mean_imag=torch.randn(shape, generator=g),
            q_abs_mean=torch.rand(shape, generator=g) + 2,
            freq_scale=torch.ones(4),
            rope_style="half",
            rope_theta=10000.0,
            head_dim=8,
        )
        save_stats(stats, tmp_path / "stats.safetensors")
        params = {"stats_path": str(tmp_path / "stats.safetensors")}
    kept = []
    for use_kernels in (False, True):
        config = EvictionConfig(
            kv_budget_tokens=48,
            cadence_tokens=16,
            window_tokens=8,
            scorer=scorer,
            scorer_params=params,
            page_size=16,
        )
        engine = Engine(page_size=16, config=config)
        engine.cache.evictor.use_pool_kernels = use_kernels
        req = engine.add_request("a", list(range(8)))
        for step in range(120):
            engine.decode_step(req, 1000 + step)
        kept.append(
            [r.tokens_after for _, r in engine.pass_log] + engine.driver.positions(req).tolist()
        )
        assert len(engine.pass_log) >= 4
    assert kept[0] == kept[1]


def test_a_scoring_kernel_that_fails_on_the_gpu_falls_back_to_the_torch_forms(monkeypatch, caplog):
    """A pool-reading kernel that raises (as a Triton kernel that does not compile for a
    GPU would, on the host before any device work) costs one error line: that pass and
    every later one score with the torch forms and keep the same survivors as a run
    that never asked for the kernels."""
    from sglang_evict.scorers import base

    calls = []

    def broken_kernel(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("triton: out of resources (simulated)")

    kept = []
    for use_kernels in (False, True):
        config = EvictionConfig(
            kv_budget_tokens=48, cadence_tokens=16, window_tokens=8, scorer="knorm", page_size=16
        )
        engine = Engine(page_size=16, config=config)
        manager = engine.cache.evictor
        manager.use_pool_kernels = use_kernels
        if use_kernels:
            monkeypatch.setattr(base, "zscore_reduce_triton", broken_kernel)
        req = engine.add_request("a", list(range(8)))
        with caplog.at_level("ERROR", logger="sglang_evict.passes.batch.scoring"):
            for step in range(120):
                engine.decode_step(req, 1000 + step)
        kept.append(
            [r.tokens_after for _, r in engine.pass_log] + engine.driver.positions(req).tolist()
        )
        assert len(engine.pass_log) >= 4
    assert kept[0] == kept[1]
    assert len(calls) == 1 and manager.use_pool_kernels is False
    failures = [r for r in caplog.records if "scoring kernel failed" in r.getMessage()]
    assert len(failures) == 1 and "out of resources" in failures[0].getMessage()
