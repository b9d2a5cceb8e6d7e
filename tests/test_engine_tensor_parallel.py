"""Tensor parallelism in SGLang's real engine (CPU, ``torch_native``, overlap on): two
ranks, each holding one of the model's two KV heads, run eviction and the quantized tier.

SGLang runs ``--tp-size 2`` on CPU over gloo (``engine_runner.cpu_tp_env``). Each rank's
passes score its own KV head and all-reduce the scores over SGLang's CPU cache group
(``sglang_evict.srt.tp``); each rank's arena holds its own head's groups and merges its
own query heads' attention. The engine must generate exactly what the single-process
CPU reference loop, holding every head, generates for the same policy, and both ranks
must log the same decisions at every pass (``tests/test_tensor_parallel.py`` proves the
same with SGLang's memory classes in two gloo processes)."""

from __future__ import annotations

import os
import re

import pytest

from sglang_evict.request_policy import report_of
from sglang_evict.srt.engine_runner import cpu_tp_env, parse_pass_lines
from tests.engine_harness import (
    ENGINE_TIER,
    EngineSpec,
    assert_clean_after,
    assert_same_tokens,
    greedy,
    load_reference_model,
    policy_fields,
    reference_outputs,
    shared_system_prompts,
)

pytestmark = pytest.mark.engine

TP_SIZE = 2
NEW_TOKENS = 140
TIER = {**ENGINE_TIER, "tier_bits": 3}
RANK = re.compile(r" TP(\d+)\] ")


@pytest.fixture(scope="module")
def tp_model():
    """Head dim 64 (the tier's kernels) with two KV heads: one per rank."""
    from sglang_evict.models.engine_model import ensure_engine_model

    return ensure_engine_model(variant="head_dim64_kv2")


def pass_records_by_rank(log: str) -> dict[int, list[dict]]:
    """Each rank's pass records in its log order, without their durations (timing)."""
    lines_by_rank: dict[int, list[str]] = {}
    for line in log.splitlines():
        rank = RANK.search(line)
        if rank is not None:
            lines_by_rank.setdefault(int(rank.group(1)), []).append(line)
    by_rank = {}
    for rank, lines in lines_by_rank.items():
        records = parse_pass_lines("\n".join(lines))
        for record in records:
            record.pop("duration_ms")
        if records:
            by_rank[rank] = records
    return by_rank


def test_cpu_tp_env_names_no_nccl_and_splits_the_cores():
    assert cpu_tp_env(1) == {}
    env = cpu_tp_env(2, cores=[0, 1, 2, 3, 4])
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0-1|2-3"
    assert not os.path.exists(env["SGLANG_NCCL_SO_PATH"])
    assert cpu_tp_env(2, cores=[0, 2, 5, 7])["SGLANG_CPU_OMP_THREADS_BIND"] == "0,2|5,7"
    assert cpu_tp_env(4, cores=[0, 1])["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1|0|1"


@pytest.mark.release_smoke
def test_two_ranks_evict_and_demote_as_one_process_holding_every_head(engines, tp_model):
    """Request 0 runs eviction alone (``tier_tokens`` 0), the others the tier: every
    request equals the reference loop token for token, both ranks log the same passes
    (tokens kept, demoted, pages freed), each rank's arena holds one KV head, and the
    engine ends clean."""
    policy = policy_fields(**TIER)
    engine = engines.get(
        EngineSpec.plugin(
            1,
            engine_args={"model_path": str(tp_model), "tp_size": TP_SIZE},
            env=cpu_tp_env(TP_SIZE),
            **policy,
        )
    )
    prompts = shared_system_prompts(tp_model)
    custom = [{"sglang_evict": {"tier_tokens": 0 if i == 0 else 64}} for i in range(len(prompts))]
    mark = engine.mark()
    outputs = engine.generate(prompts, [greedy(NEW_TOKENS, custom_params=c) for c in custom])
    expected, result = reference_outputs(
        load_reference_model(tp_model),
        prompts,
        NEW_TOKENS,
        page_size=1,
        policy=policy,
        custom_params=custom,
    )
    assert_same_tokens([o["output_ids"] for o in outputs], expected, f"TP {TP_SIZE} engine")

    demoted: dict[str, int] = {}
    for rid, _, r in result.passes:
        demoted[rid] = demoted.get(rid, 0) + r.tokens_demoted
    assert demoted.get("r0", 0) == 0
    assert all(demoted[f"r{i}"] >= TIER["tier_max_tokens"] for i in range(1, len(prompts)))
    reports = [report_of(o["meta_info"]) for o in outputs]
    assert reports[0]["tier_tokens_held"] == 0
    assert all(r["tier_tokens_held"] > 0 for r in reports[1:])

    by_rank = pass_records_by_rank(engine.log_since(mark))
    assert sorted(by_rank) == list(range(TP_SIZE)), "a rank logged no pass"
    assert by_rank[0] == by_rank[1], "the ranks' passes differ"
    per_request = [r for record in by_rank[0] for r in record["requests"]]
    assert len(per_request) == len(result.passes)
    assert sum(r.get("tokens_demoted", 0) for r in per_request) == sum(demoted.values())

    tier = engine.plugin_state()["tier"]
    assert tier["kv_heads"] == 1  # rank 0's share of the two
    assert tier["hook_calls"]["decode_merged"] > 0
    assert tier["cpu_kernel"] == "compiled"
    assert_clean_after(engine, mark)
    assert engine.plugin_state()["tier"]["groups_held"] == 0
    engines.report(
        f"TP {TP_SIZE} eviction + tier",
        "passes per rank (equal across ranks, = reference), tokens demoted",
        f"{len(by_rank[0])} pass records, {len(per_request)} request passes, "
        f"{sum(demoted.values())}",
    )
