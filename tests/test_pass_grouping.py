"""``--kv-pass-group-steps auto`` (``sglang_evict.passes.grouping``),
``--kv-pass-cuda-graph`` and ``--kv-pass-graph-pool-mib``: the choice's arithmetic, its
re-choosing, the flags, the admission bound and the refusals."""

from __future__ import annotations

import argparse
import json

import pytest
from sglang.srt.server_args import ServerArgs

from sglang_evict.cli.flags import add_policy_flags, config_from_args
from sglang_evict.config import DEFAULT_PASS_GRAPH_POOL_MIB, EvictionConfig
from sglang_evict.passes.grouping import (
    AUTO_MAX_GROUP_STEPS,
    RECHOOSE_STEPS,
    GroupChoice,
    choose_group_steps,
)
from sglang_evict.srt.server_args import CONFIG_ENV, config_from_env, startup_problems
from sglang_evict.srt.versioned import IS_0_5_23


def test_the_choice_is_the_smallest_group_keeping_passes_under_one_percent():
    # A 0.3 ms pass against 1.5 ms steps: 20 steps make it 1 %.
    assert choose_group_steps(0.3e-3, 1.5e-3) == 20
    assert 0.3e-3 / (20 * 1.5e-3) <= 0.01 < 0.3e-3 / (19 * 1.5e-3)
    assert choose_group_steps(1e-6, 1e-3) == 1  # a pass under 1 % of one step
    assert choose_group_steps(1.0, 1e-3) == AUTO_MAX_GROUP_STEPS  # capped
    assert choose_group_steps(0.0, 1e-3) == 1 and choose_group_steps(1e-3, 0.0) == 32


def test_the_choice_starts_at_one_and_changes_only_every_rechoose_steps():
    choice = GroupChoice()
    assert choice.steps == 1
    for _ in range(3 * RECHOOSE_STEPS):  # no pass seen yet: no reason to group
        assert choice.note_step(1e-3) is False
    assert choice.steps == 1
    choice.note_pass(0.2e-3)
    changed = [choice.note_step(1e-3) for _ in range(RECHOOSE_STEPS)]
    assert changed.index(True) == RECHOOSE_STEPS - 1 and sum(changed) == 1
    assert choice.steps == 20
    report = choice.report()
    assert report["pass_group_steps"] == 20 and report["pass_share_of_step"] == 0.01


def parse(*argv: str) -> EvictionConfig:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_policy_flags(parser, default_budget=1024)
    parser.add_argument("--page-size", type=int, default=1)  # the server's flag
    return config_from_args(parser.parse_args(list(argv)))


def test_the_flags_take_auto_and_the_graph_switch_and_refuse_the_rest():
    assert parse().pass_group_steps == 1 and parse().pass_cuda_graph is None
    config = parse("--kv-pass-group-steps", "auto", "--no-kv-pass-cuda-graph")
    assert config.pass_group_steps == "auto" and config.pass_cuda_graph is False
    assert config.group_steps_bound == AUTO_MAX_GROUP_STEPS  # what admission counts
    assert parse("--kv-pass-group-steps", "8").group_steps_bound == 8
    with pytest.raises(argparse.ArgumentError, match=r"invalid int value.*\(or auto\)"):
        parse("--kv-pass-group-steps", "sometimes")
    with pytest.raises(ValueError, match="pass_group_steps must be an integer"):
        EvictionConfig(kv_budget_tokens=1024, pass_group_steps="often")
    with pytest.raises(ValueError, match="pass_cuda_graph must be true, false or unset"):
        EvictionConfig(kv_budget_tokens=1024, pass_cuda_graph="yes")


def test_the_flag_sets_the_limit_and_reaches_the_server_through_its_policy():
    assert parse().pass_graph_pool_mib == DEFAULT_PASS_GRAPH_POOL_MIB
    config = parse("--kv-pass-graph-pool-mib", "64")
    assert config.pass_graph_pool_mib == 64
    assert config_from_env(1, {CONFIG_ENV: config.to_json()}).pass_graph_pool_mib == 64
    for bad in ("0", "-3", "lots"):
        with pytest.raises(argparse.ArgumentError):
            parse("--kv-pass-graph-pool-mib", bad)
    with pytest.raises(ValueError, match=r"pass_graph_pool_mib=0 is out of range"):
        EvictionConfig(kv_budget_tokens=1024, pass_graph_pool_mib=0)
    with pytest.raises(ValueError, match="pass_graph_pool_mib must be an integer"):
        policy = {"kv_budget_tokens": 1024, "pass_graph_pool_mib": 1.5}
        config_from_env(1, {CONFIG_ENV: json.dumps(policy)})


def test_pass_graphs_are_refused_without_sglangs_graphs_or_off_cuda():
    config = EvictionConfig(kv_budget_tokens=1024, scorer="knorm", pass_cuda_graph=True)
    off = ServerArgs(model_path="dummy", device="cuda", disable_cuda_graph=True)
    (problem,) = startup_problems(off, config)
    assert "--kv-pass-cuda-graph" in problem and "--disable-cuda-graph" in problem
    cpu = ServerArgs(model_path="dummy", device="cpu")
    (problem,) = startup_problems(cpu, config)
    assert "needs a CUDA device" in problem
    default = EvictionConfig(kv_budget_tokens=1024, scorer="knorm")
    assert startup_problems(off, default) == [] and startup_problems(cpu, default) == []


def test_pass_graphs_are_refused_and_not_reserved_beside_parts_whose_passes_run_eagerly():
    """The tier's demotion and the sidecar's moves are not replayed
    (``PassManager._graphable``): asking for pass graphs with either is refused, and by
    default no graph pool is reserved for them (``graph_pool.pass_graphs_on``)."""
    from sglang_evict.srt.graph_pool import pass_graphs_on

    gpu = ServerArgs(model_path="dummy", device="cuda", attention_backend="torch_native")
    eager_parts = {
        "--kv-tier-bits": dict(tier_bits=3),
        "--kv-compactor grpc": dict(compactor="grpc"),
    }
    for flag, fields in eager_parts.items():
        forced = EvictionConfig(
            kv_budget_tokens=1024, scorer="knorm", pass_cuda_graph=True, **fields
        )
        refusals = [
            p for p in startup_problems(gpu, forced) if p.startswith("--kv-pass-cuda-graph")
        ]
        assert len(refusals) == 1 and flag in refusals[0], (flag, refusals)
        default = EvictionConfig(kv_budget_tokens=1024, scorer="knorm", **fields)
        assert not any(p.startswith("--kv-pass-cuda-graph") for p in startup_problems(gpu, default))
        assert not pass_graphs_on(default, gpu, "cuda"), flag
    assert pass_graphs_on(EvictionConfig(kv_budget_tokens=1024, scorer="knorm"), gpu, "cuda")


def test_the_tier_with_triton_on_a_gpu_is_refused_unless_tried_on_purpose(monkeypatch):
    from sglang_evict.srt.server_args import TIER_GPU_TRIAL_ENV

    tier = EvictionConfig(kv_budget_tokens=1024, scorer="knorm", tier_bits=3)
    triton = ServerArgs(model_path="dummy", device="cuda", attention_backend="triton")
    monkeypatch.delenv(TIER_GPU_TRIAL_ENV, raising=False)
    assert any("triton on cuda" in p for p in startup_problems(triton, tier))
    monkeypatch.setenv(TIER_GPU_TRIAL_ENV, "1")
    assert not any("triton" in p for p in startup_problems(triton, tier))


@pytest.mark.skipif(not IS_0_5_23, reason="SGLang 0.5.23's flag (0.5.17 has none)")
def test_pass_graphs_are_refused_when_sglangs_decode_graph_backend_is_disabled():
    """0.5.23 turns decode graphs off with ``--cuda-graph-backend-decode disabled``,
    which leaves ``disable_cuda_graph`` False: the refusal and the reservation see it."""
    from sglang_evict.srt.graph_pool import pass_graphs_on

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    argv = ["--model-path", "dummy", "--device", "cuda", "--cuda-graph-backend-decode", "disabled"]
    off = ServerArgs.from_cli_args(parser.parse_args(argv))
    forced = EvictionConfig(kv_budget_tokens=1024, scorer="knorm", pass_cuda_graph=True)
    (problem,) = startup_problems(off, forced)
    assert "--cuda-graph-backend-decode disabled" in problem
    default = EvictionConfig(kv_budget_tokens=1024, scorer="knorm")
    assert not pass_graphs_on(default, off, "cuda")


def test_a_manager_off_cuda_refuses_pass_graphs_and_groups_by_its_choice():
    import torch

    from sglang_evict.passes.manager import EvictionManager
    from sglang_evict.passes.tensor_pool import TensorPool

    def pool():
        buffers = [torch.zeros(64, 1, 4)]
        return TensorPool(k_buffers=buffers, v_buffers=buffers, page_size=1, rows=2, capacity=32)

    def manager(**fields):
        config = EvictionConfig(kv_budget_tokens=16, window_tokens=4, page_size=1, **fields)
        return EvictionManager(
            config=config, pool=pool(), compactor=None, num_request_rows=2, row_capacity=32
        )

    with pytest.raises(ValueError, match="needs the KV pool on a CUDA device"):
        manager(pass_cuda_graph=True)
    assert manager().graphs is None  # the default off CUDA: eager
    auto = manager(pass_group_steps="auto")
    assert [auto.open_pass_step() for _ in range(3)] == [True, True, True]
    auto.group_choice.steps = 4
    assert [auto.open_pass_step() for _ in range(4)] == [True, False, False, False]
    assert auto.pass_group_steps == 4


def test_auto_measures_replayed_passes_and_leaves_capturing_ones_out():
    """The first pass of a shape runs eagerly and captures its graph (a one-off cost):
    ``auto`` does not count it as a pass's host time; the replays of that shape it does
    (graphs emulated off CUDA, ``sglang_evict.passes.graphs``)."""
    import torch

    from sglang_evict.passes.graphs import PassGraphs
    from sglang_evict.passes.manager import DueRequest, EvictionManager
    from sglang_evict.passes.tensor_pool import TensorPool

    buffers = [torch.randn(128, 1, 4)]
    pool = TensorPool(k_buffers=buffers, v_buffers=buffers, page_size=1, rows=2, capacity=40)
    config = EvictionConfig(
        kv_budget_tokens=16, window_tokens=4, page_size=1, pass_group_steps="auto"
    )
    manager = EvictionManager(
        config=config, pool=pool, compactor=None, num_request_rows=2, row_capacity=40
    )
    manager.graphs = PassGraphs(torch.device("cpu"))
    for attempt in range(3):  # one request, the same shape each time
        slots = pool.alloc_pages(24)
        pool.req_to_token[0, :24] = slots.to(torch.int32)
        manager.states.clear()
        (result,) = manager.run_batch_pass([DueRequest(f"r{attempt}", 0, 24, 0, 0)])
        assert result.tokens_after == 16
        pool.release_pages(pool.req_to_token[0, :16].to(torch.int64))
        assert manager.group_choice.passes_seen == attempt  # the capture is not counted
    assert manager.graphs.captures == 1 and manager.graphs.replays == 2
    assert manager.group_choice.pass_s > 0
