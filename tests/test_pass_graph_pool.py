"""The pass CUDA graphs' memory pool counted against SGLang's KV pool
(``sglang_evict.srt.graph_pool``, ``--kv-pass-graph-pool-mib``): the flag, the
reservation's arithmetic and refusal, which servers reserve, the hook on SGLang's pool
sizing, and the emulated pool's allocation tally. The limit's effect on captures is in
``tests/test_static_shape_pass.py``, the flag in ``tests/test_pass_grouping.py``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from sglang_evict.config import DEFAULT_PASS_GRAPH_POOL_MIB, EvictionConfig
from sglang_evict.passes.graphs import AllocationTally
from sglang_evict.srt import graph_pool
from sglang_evict.srt.graph_pool import pass_graphs_on, plan_graph_pool
from sglang_evict.srt.server_args import BACKEND_NAME, CONFIG_ENV


def test_the_reservation_is_the_limit_in_whole_pages_or_a_refusal_naming_the_flags():
    kv_bytes, page = 23_040, 16  # SmolLM2: 3 KV heads x (64 + 64) x 30 layers x bf16
    plan = plan_graph_pool(256, pool_tokens=100_000, kv_bytes_per_token=kv_bytes, page_size=page)
    reserved = plan.reserved_tokens
    assert reserved % page == 0 and plan.pool_tokens_after % page == 0
    # The fewest whole pages holding 256 MiB.
    assert reserved * kv_bytes >= 256 * 2**20 > (reserved - page) * kv_bytes
    assert plan.pool_tokens_after == (100_000 - reserved) // page * page
    assert "256 MiB" in plan.describe() and "--kv-pass-graph-pool-mib" in plan.describe()
    with pytest.raises(ValueError) as refused:
        plan_graph_pool(256, pool_tokens=reserved, kv_bytes_per_token=kv_bytes, page_size=page)
    for fix in ("--kv-pass-graph-pool-mib", "--mem-fraction-static", "--no-kv-pass-cuda-graph"):
        assert fix in str(refused.value)


def test_only_a_server_that_replays_passes_reserves():
    config = EvictionConfig(kv_budget_tokens=1024)
    graphs = SimpleNamespace(disable_cuda_graph=False)
    no_graphs = SimpleNamespace(disable_cuda_graph=True)
    assert pass_graphs_on(config, graphs, "cuda") and pass_graphs_on(config, graphs, "cuda:1")
    assert not pass_graphs_on(config, graphs, "cpu")
    assert not pass_graphs_on(config, no_graphs, "cuda")
    off = EvictionConfig(kv_budget_tokens=1024, pass_cuda_graph=False)
    assert not pass_graphs_on(off, graphs, "cuda")
    on = EvictionConfig(kv_budget_tokens=1024, pass_cuda_graph=True)
    assert pass_graphs_on(on, graphs, torch.device("cuda"))


def configurator(device: str, *, draft: bool = False, disable_cuda_graph: bool = False):
    model = SimpleNamespace(get_num_kv_heads=lambda tp: 3 // tp, head_dim=64, v_head_dim=64)
    return SimpleNamespace(
        is_draft_worker=draft,
        server_args=SimpleNamespace(
            radix_cache_backend=BACKEND_NAME, disable_cuda_graph=disable_cuda_graph
        ),
        page_size=16,
        device=device,
        model_config=model,
        layer_info=SimpleNamespace(num_effective_layers=30),
        kv_cache_dtype=torch.bfloat16,
    )


@pytest.mark.parametrize(
    ("device", "fields", "draft", "no_graphs", "reserves"),
    [
        ("cuda", {}, False, False, True),
        ("cuda", {"pass_graph_pool_mib": 32}, False, False, True),
        ("cpu", {}, False, False, False),
        ("cuda", {"pass_cuda_graph": False}, False, False, False),
        ("cuda", {}, False, True, False),
        ("cuda", {}, True, False, False),
    ],
)
def test_the_hook_sizes_sglangs_kv_pool_down_by_the_limit(
    monkeypatch, device, fields, draft, no_graphs, reserves
):
    """``KVCacheConfigurator._resolve_memory_pool_config`` AFTER: the pool config SGLang
    allocates from loses the limit's tokens, in whole pages, on a server that will replay
    passes; any other server's is left as SGLang sized it."""
    policy = {"kv_budget_tokens": 1024, **fields}
    monkeypatch.setenv(CONFIG_ENV, json.dumps(policy))
    monkeypatch.setattr(graph_pool, "attention_tp_size", lambda _configurator: 1)
    pool_config = SimpleNamespace(max_total_num_tokens=200_000)
    out = graph_pool._after_resolve_memory_pool_config_graph_pool(
        pool_config, configurator(device, draft=draft, disable_cuda_graph=no_graphs), 0
    )
    assert out is pool_config
    if not reserves:
        assert pool_config.max_total_num_tokens == 200_000
        return
    limit_bytes = policy.get("pass_graph_pool_mib", DEFAULT_PASS_GRAPH_POOL_MIB) * 2**20
    kv_bytes = 3 * (64 + 64) * 30 * 2
    taken = 200_000 - pool_config.max_total_num_tokens
    assert taken % 16 == 0 and taken * kv_bytes >= limit_bytes > (taken - 16) * kv_bytes


def test_the_emulated_pool_counts_new_storages_not_views_or_in_place_writes():
    base = torch.zeros(16)  # outside the tally
    with AllocationTally() as tally:
        fresh = torch.ones(8, dtype=torch.float64)  # 64 bytes
        view = fresh.view(2, 4)
        fresh.add_(1)
        base.mul_(2)
        total = view.sum(dim=1)  # 2 float64: 16 bytes
        scratch = base[:4] + 1  # 4 float32: 16 bytes
        del scratch
    assert tally.bytes == 64 + 16 + 16
    assert total.tolist() == [8.0, 8.0]
