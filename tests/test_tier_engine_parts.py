"""The tier's engine parts that need no engine: the arena's row tables (what the decode
step's attention reads by request-pool row), the arena's carve from SGLang's KV pool
(``srt.tier.plan_tier``), and how ``eval-tier --engine`` plans its requests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sglang_evict.config import EvictionConfig
from sglang_evict.tier.arena import TierArena
from sglang_evict_kernels.tier_format import TierFormat


def arena_with_rows(num_groups=6, rows=4, width=3):
    fmt = TierFormat(bits=3, group_tokens=16, head_dim=64)
    arena = TierArena(
        fmt, num_groups=num_groups, num_layers=2, kv_heads=1, full_dtype=torch.float32
    )
    arena.enable_rows(rows, width)
    return arena


def test_a_rows_table_lists_its_requests_slots_and_an_ended_request_leaves_none():
    arena = arena_with_rows()
    arena.take("a", 2, row=1)
    arena.take("b", 1, row=3)
    arena.check()
    assert arena.row_counts.tolist() == [0, 2, 0, 1]
    assert sorted(arena.row_table[1, :2].tolist()) == sorted(arena.groups_of("a"))
    arena.take("a", 1, row=1)  # a later pass adds a group
    arena.check()
    assert arena.row_counts[1] == 3
    arena.release("a")
    arena.check()
    assert arena.row_counts.tolist() == [0, 0, 0, 1]
    arena.take("c", 2, row=1)  # the row reused by a new request
    arena.check()
    assert sorted(arena.row_table[1, :2].tolist()) == sorted(arena.groups_of("c"))


def test_the_row_check_catches_a_table_that_disagrees_with_the_owners():
    arena = arena_with_rows()
    arena.take("a", 2, row=0)
    arena.row_counts[0] = 1
    with pytest.raises(AssertionError, match="row 0 lists 1 tier groups"):
        arena.check()
    arena.row_counts[0] = 2
    arena.row_table[0, 0] = arena.trash
    with pytest.raises(AssertionError, match="row 0's tier table differs"):
        arena.check()


def test_a_request_past_its_rows_width_is_refused():
    arena = arena_with_rows(width=1)
    with pytest.raises(AssertionError, match="its row 1"):
        arena.take("a", 2, row=0)


def tier_config(**overrides) -> EvictionConfig:
    fields = dict(kv_budget_tokens=256, tier_bits=3, tier_group_tokens=32, tier_max_tokens=256)
    fields.update(overrides)
    return EvictionConfig(**fields)


def test_the_arena_is_carved_from_the_pool_in_whole_pages():
    from sglang_evict.srt.tier import plan_tier
    from sglang_evict.tier.arena import group_bytes

    config = tier_config(tier_pool_share=0.25)
    per_token = 2 * 30 * 3 * 64 * 2  # SmolLM2: 30 layers, 3 KV heads, head dim 64, bf16
    plan = plan_tier(
        config,
        pool_tokens=20_000,
        kv_bytes_per_token=per_token,
        num_layers=30,
        kv_heads=3,
        head_dim=64,
        full_dtype=torch.bfloat16,
        page_size=16,
    )
    fmt = config.tier_format(64)
    per_slot = group_bytes(fmt, 30, 3, torch.bfloat16) + 4 + 4 * fmt.group_tokens
    assert plan.arena_bytes == (plan.num_groups + 1) * per_slot
    assert plan.arena_bytes <= 0.25 * 20_000 * per_token
    assert plan.pool_tokens_after % 16 == 0
    taken = plan.pool_tokens_before - plan.pool_tokens_after
    assert taken * per_token >= plan.arena_bytes > (taken - 16) * per_token
    assert "KV pool 20000 ->" in plan.describe()


def test_a_share_that_holds_no_group_is_refused_naming_the_flag():
    from sglang_evict.srt.tier import plan_tier

    with pytest.raises(ValueError, match=r"--kv-tier-pool-share 0\.01 of a 64-token KV pool"):
        plan_tier(
            tier_config(tier_pool_share=0.01),
            pool_tokens=64,
            kv_bytes_per_token=23_040,
            num_layers=30,
            kv_heads=3,
            head_dim=64,
            full_dtype=torch.bfloat16,
            page_size=16,
        )


def test_the_engine_frontier_serves_every_requests_split_with_one_tier_format():
    from types import SimpleNamespace

    from sglang_evict.quality.real.frontier import Candidate, Shape
    from sglang_evict.quality.real.frontier_engine import (
        _tier_candidate,
        plan_requests,
        server_config,
    )

    shape = Shape(num_layers=30, num_kv_heads=3, head_dim=64)
    samples = [SimpleNamespace(prompt_ids=list(range(n)), key=f"s{n}") for n in (700, 1100)]
    candidates = [Candidate.parse("evict:rkv"), Candidate.parse("3:32/rkv")]
    plans = plan_requests(samples, candidates, (0.25, 0.125), shape, min_budget=37)
    assert len(plans) == 2 + 2 * 2 * 2  # plain, then candidates x fractions per sample
    config = server_config(candidates[1], plans, page_size=16, sink_tokens=4, window_tokens=32)
    spends = [p[3] for p in plans if p[3] is not None]
    assert config.kv_budget_tokens == max(s.budget_tokens for s in spends)
    assert config.tier_max_tokens >= max(s.tier_tokens for s in spends)
    assert config.tier_max_tokens % 32 == 0 and config.tier_bits == 3
    for _, _, fraction, spent, _ in plans[2:]:
        assert spent.fraction <= fraction + 1e-9  # never above the bytes asked
    with pytest.raises(ValueError, match="exactly one tier candidate"):
        _tier_candidate([candidates[0], Candidate.parse("2:32"), candidates[1]])


def test_the_metrics_report_the_tiers_tokens_bytes_and_quantized_tokens():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from sglang_evict.metrics import EvictionMetrics
    from sglang_evict.passes.state import PassResult

    registry = CollectorRegistry()
    metrics = EvictionMetrics.create("knorm", registry)
    arena = arena_with_rows()
    arena.take("a", 2, row=0)
    manager = SimpleNamespace(
        failures=SimpleNamespace(streak=0),
        lease=SimpleNamespace(release_failures=0),
        forced_completions=0,
        compactor=None,
        graphs=None,
        pass_group_steps=1,
        tier_arena=arena,
    )
    metrics.record_manager(manager)
    assert registry.get_sample_value("sglang_evict:tier_tokens") == 2 * 16
    per_group = arena.nbytes() // (arena.num_groups + 1)
    assert registry.get_sample_value("sglang_evict:tier_bytes") == 2 * per_group
    result = PassResult(
        rid="a",
        tokens_before=80,
        tokens_after=48,
        pages_freed=0,
        strategy="hole_fill",
        protected_over_budget=False,
        duration_s=0.001,
        batch_slot_copies=torch.zeros(1, dtype=torch.int64),
        batch_index=0,
        bytes_per_slot=8,
        scorer="knorm",
        budget_tokens=48,
        tokens_demoted=32,
        tokens_dropped=16,
    )
    metrics.record_batch([result], 0.001)
    assert registry.get_sample_value("sglang_evict:tier_tokens_quantized_total") == 32
    assert registry.get_sample_value("sglang_evict:tier_tokens_dropped_total") == 16


def test_the_dry_runs_bytes_line_adds_the_full_bound_and_a_full_tier():
    from types import SimpleNamespace

    from sglang_evict.cli.serve_command import tier_bytes_line
    from sglang_evict.tier.policy import full_bytes_per_token, tier_bytes_per_token

    hf = SimpleNamespace(
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        hidden_size=576,
        head_dim=64,
        rope_theta=100000.0,
    )
    config = tier_config(kv_budget_tokens=256, cadence_tokens=128, tier_max_tokens=1024)
    line = tier_bytes_line(config, SimpleNamespace(hf_text_config=hf))
    fmt = config.tier_format(64)
    full = full_bytes_per_token(fmt, 30, 3, torch.bfloat16)
    tier = tier_bytes_per_token(fmt, 30, 3, torch.bfloat16)
    most = (256 + 128 + 32 - 1) * full + 1024 * tier
    assert f"= {most / 2**20:.2f} MiB" in line and f"{most / full:.0f} full-precision" in line
    assert tier_bytes_line(tier_config(tier_bits=None), SimpleNamespace(hf_text_config=hf)) is None


def test_the_idle_check_names_a_tier_that_holds_groups_or_breaks_an_invariant():
    from sglang_evict.srt.introspection import tier_problem

    arena = arena_with_rows()
    assert tier_problem(None) is None and tier_problem(arena) is None
    arena.take("a", 1, row=2)
    problem = tier_problem(arena)
    assert "groups of ['a'] held by the tier's arena while the scheduler is idle" in problem
    arena.row_counts[2] = 0
    assert "breaks an invariant while idle: row 2 lists 0" in tier_problem(arena)


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_full_sides_lse_from_sglangs_split_kv_decode_merges_with_the_tier_exactly(
    page_size,
):
    """SGLang's own ``triton`` decode kernel (stage 1 leaves each split's log-sum-exp,
    stage 2 reduces them), run by Triton's interpreter on CPU over requests of 5 to 150
    tokens in 1 to 4 splits: ``split_kv_lse`` equals the log-sum-exp over each request's
    keys, and SGLang's output merged with a tier's partial attention equals one softmax
    over the full-precision and tier tokens together."""
    import math

    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    from sglang_evict.srt.tier import split_kv_lse
    from sglang_evict_kernels.tier_attention import (
        attention_with_lse_reference,
        merge_attention_states,
    )

    generator = torch.Generator().manual_seed(page_size)
    lens, splits = [5, 70, 33, 150], [1, 4, 2, 3]
    b, hq, h, d, max_splits = len(lens), 4, 2, 64, 4
    pages = [-(-n // page_size) for n in lens]
    k_pool = torch.randn(sum(pages) * page_size, h, d, generator=generator)
    v_pool = torch.randn(sum(pages) * page_size, h, d, generator=generator)
    q = torch.randn(b, hq, d, generator=generator)
    # Token slots (SGLang's kv_indices): each request's tokens in whole pages, the
    # pages in a random order.
    page_order = torch.randperm(sum(pages), generator=generator)
    token_slots, first = [], 0
    for n, p in zip(lens, pages, strict=True):
        own = page_order[first : first + p]
        first += p
        token_slots.append((own[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:n])
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.cat(token_slots).to(torch.int32)
    logits = torch.empty(b, hq, max_splits, d)
    split_lse = torch.full((b, hq, max_splits), 123.0)  # stale values past the live splits
    o = torch.empty(b, hq, d)
    sm_scale = 1 / math.sqrt(d)
    kwargs = {"page_size": page_size} if page_size > 1 else {}
    decode_attention_fwd(
        q, k_pool, v_pool, o, indptr, indices, logits,
        split_lse, torch.tensor(splits, dtype=torch.int32), max_splits, sm_scale, 1.0, 1.0,
        **kwargs,
    )  # fmt: skip
    lse = split_kv_lse(split_lse, torch.tensor(splits), torch.tensor(lens), 32)
    tier_k = torch.randn(b, 40, h, d, generator=generator)
    tier_v = torch.randn(b, 40, h, d, generator=generator)
    for i in range(b):
        k, v = k_pool[token_slots[i]], v_pool[token_slots[i]]
        o_ref, lse_ref = attention_with_lse_reference(q[i], k, v, sm_scale)
        assert torch.allclose(lse[i], lse_ref, atol=1e-5), i
        assert torch.allclose(o[i], o_ref, atol=1e-5), i
        o_tier, lse_tier = attention_with_lse_reference(q[i], tier_k[i], tier_v[i], sm_scale)
        merged, _ = merge_attention_states(o[i], lse[i], o_tier, lse_tier)
        o_all, _ = attention_with_lse_reference(
            q[i], torch.cat([k, tier_k[i]]), torch.cat([v, tier_v[i]]), sm_scale
        )
        assert torch.allclose(merged, o_all, atol=1e-5), i


class HostReads(TorchDispatchMode):
    """Fails on any operation that reads a tensor's values on the host or gives a shape
    that depends on them: what a CUDA graph capture cannot hold. Records every
    operation with its argument shapes (``trace``): a captured step replays the same."""

    FORBIDDEN = ("_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select")

    def __init__(self) -> None:
        super().__init__()
        self.trace: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.FORBIDDEN:
            raise AssertionError(f"a host read: aten.{name}")
        shapes = tuple(tuple(t.shape) for t in tree_leaves((args, kwargs)) if torch.is_tensor(t))
        self.trace.append((name, shapes))
        return func(*args, **(kwargs or {}))


def test_the_host_read_guard_fails_on_a_read():
    counts = torch.tensor([1, 2])
    with pytest.raises(AssertionError, match="host read"), HostReads():
        int(counts.max())
    with pytest.raises(AssertionError, match="host read"), HostReads():
        bool((counts > 0).any())


def test_the_triton_merge_reads_nothing_on_the_host_and_replays_over_new_tier_content():
    """The ``triton`` backend's decode merge (``srt.tier.merge_decode``), emulating a
    CUDA graph on CPU as the pass graphs do: run over static inputs (the arena's row
    table and counts, the backend's split-KV metadata), it makes no host read; after the
    arena's content changes (a request gains groups, another gives its up, a third
    starts one) the same inputs run the same operations on the same shapes, and each
    run equals one softmax over each request's full-precision keys and dequantized tier
    (the references)."""
    import math

    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    from sglang_evict.srt import tier as srt_tier
    from sglang_evict_kernels.tier_attention import (
        attention_with_lse_reference,
        merge_attention_states,
        tier_attention_reference,
    )
    from sglang_evict_kernels.tier_quant import quantize_into_reference

    generator = torch.Generator().manual_seed(7)
    fmt = TierFormat(bits=3, group_tokens=16, head_dim=64)
    lens, splits = [9, 40, 70, 33], [1, 2, 4, 2]
    rows = torch.tensor([1, 0, 3, 2])
    b, hq, h, d, max_splits = len(lens), 4, 2, 64, 4
    arena = TierArena(fmt, num_groups=8, num_layers=1, kv_heads=h, full_dtype=torch.float32)
    arena.enable_rows(4, 3)
    source_k = torch.randn(256, h, d, generator=generator)
    source_v = torch.randn(256, h, d, generator=generator)

    def demote(rid: str, count: int, row: int) -> None:
        slots = torch.tensor(arena.take(rid, count, row=row))
        tokens = torch.randint(0, 256, (count, fmt.group_tokens), generator=generator)
        quantize_into_reference(arena.stores[0], slots, source_k, source_v, tokens, fmt)

    k_pool = torch.randn(sum(lens), h, d, generator=generator)
    v_pool = torch.randn(sum(lens), h, d, generator=generator)
    q = torch.randn(b, hq, d, generator=generator)
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    split_lse = torch.full((b, hq, max_splits), 123.0)  # stale past the live splits
    o_full = torch.empty(b, hq, d)
    sm_scale = 1 / math.sqrt(d)
    num_splits = torch.tensor(splits, dtype=torch.int32)
    decode_attention_fwd(
        q, k_pool, v_pool, o_full, indptr, torch.arange(sum(lens), dtype=torch.int32),
        torch.empty(b, hq, max_splits, d), split_lse, num_splits, max_splits, sm_scale,
        1.0, 1.0,
    )  # fmt: skip

    class TritonAttnBackend:  # the name SGLang's backend class has
        forward_metadata = SimpleNamespace(
            attn_lse=split_lse, num_kv_splits=num_splits, kv_indptr=indptr
        )

    layer = SimpleNamespace(
        tp_q_head_num=hq, tp_k_head_num=h, qk_head_dim=d, v_head_dim=d, layer_id=0,
        scaling=sm_scale, logit_cap=0, sliding_window_size=-1,
    )  # fmt: skip
    batch = SimpleNamespace(req_pool_indices=rows)

    def expected() -> torch.Tensor:
        table, counts = arena.row_table[rows], arena.row_counts[rows]
        o_tier, lse_tier = tier_attention_reference(q, arena.stores[0], table, counts, fmt)
        out = []
        for i in range(b):
            keys = slice(int(indptr[i]), int(indptr[i + 1]))
            o_i, lse_i = attention_with_lse_reference(q[i], k_pool[keys], v_pool[keys], sm_scale)
            out.append(merge_attention_states(o_i, lse_i, o_tier[i], lse_tier[i])[0])
        return torch.stack(out)

    def run() -> tuple[torch.Tensor, list]:
        o = o_full.reshape(b, hq * d).clone()
        with HostReads() as guard:
            merged = srt_tier.merge_decode(o, q, layer, batch, arena, TritonAttnBackend())
        return merged.reshape(b, hq, d), guard.trace

    demote("a", 2, row=1)
    demote("b", 1, row=3)
    first, first_trace = run()
    assert torch.allclose(first, expected(), atol=1e-4)
    demote("a", 1, row=1)  # a later pass: a third group
    arena.release("b")  # b ended
    demote("c", 2, row=2)  # a new request's first groups
    arena.check()
    second, second_trace = run()
    assert torch.allclose(second, expected(), atol=1e-4)
    assert second_trace == first_trace  # the same operations on the same shapes
    assert not torch.allclose(first, second, atol=1e-3)  # the content did change
