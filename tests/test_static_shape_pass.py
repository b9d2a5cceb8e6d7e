"""The static-shape pass (``sglang_evict.passes.batch.shapes``: requests, row width,
survivors, top-k, released pages and staging padded to buckets) keeps exactly the
survivors, moves exactly the slots and frees exactly the pages of the exact-shape pass,
on generated batches: page sizes 1, 16 and 64, both strategies, per-request scorers and
budgets mixed, shared prefixes, two passes per request (the second reads positions the
first compacted). Same pool, same rows, same positions, same offsets, same free list,
bit for bit, after every pass; the invariants hold after every pass too."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_evict.config import EvictionConfig
from sglang_evict.passes.batch.counts import ceil_div
from sglang_evict.passes.batch.shapes import ladder_bucket, pass_shape, power_of_two_bucket
from sglang_evict.passes.graphs import PassGraphs
from sglang_evict.passes.manager import DueRequest, EvictionManager
from sglang_evict.passes.tensor_pool import TensorPool
from sglang_evict.request_policy import RequestPolicy

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 4
SINKS, WINDOW = 4, 8
CAPACITY = 512  # row capacity (tokens)


def small_config(**fields) -> EvictionConfig:
    """Budget 64, cadence 16, page 16, knorm, the module's sinks and window; ``fields``
    override them."""
    defaults = dict(
        kv_budget_tokens=64,
        cadence_tokens=16,
        sink_tokens=SINKS,
        window_tokens=WINDOW,
        page_size=16,
        scorer="knorm",
    )
    return EvictionConfig(**{**defaults, **fields})


def make_pool(page_size: int, rows: int, seed: int, device: str = "cpu") -> TensorPool:
    num_pages = rows * ceil_div(CAPACITY, page_size) + 8
    g = torch.Generator().manual_seed(seed)

    def buffer():
        return torch.randn(num_pages * page_size, KV_HEADS, HEAD_DIM, generator=g).to(device)

    return TensorPool(
        k_buffers=[buffer() for _ in range(LAYERS)],
        v_buffers=[buffer() for _ in range(LAYERS)],
        page_size=page_size,
        rows=rows,
        capacity=CAPACITY,
    )


def clone_pool(pool: TensorPool) -> TensorPool:
    twin = TensorPool(
        k_buffers=[b.clone() for b in pool.k_buffers],
        v_buffers=[b.clone() for b in pool.v_buffers],
        page_size=pool.page_size,
        rows=pool.req_to_token.shape[0],
        capacity=CAPACITY,
    )
    twin.req_to_token.copy_(pool.req_to_token)
    twin.free = pool.free.clone()
    return twin


def append_tokens(pool: TensorPool, row: int, kv_len: int, count: int) -> None:
    """Write ``count`` new entries after ``kv_len`` in ``row``: the free tail of its
    last page first, then fresh pages from the front of the free list."""
    P = pool.page_size
    for index in range(kv_len, kv_len + count):
        if index % P == 0:
            page = pool.alloc_pages(1)
            assert page is not None, "the test pool ran out of pages"
            slot = int(page[0]) * P
        else:
            slot = int(pool.req_to_token[row, index - 1]) + 1
        pool.req_to_token[row, index] = slot


def manager_for(pool: TensorPool, config: EvictionConfig, static: bool) -> EvictionManager:
    return EvictionManager(
        config=config,
        pool=pool,
        compactor=None,
        num_request_rows=pool.req_to_token.shape[0],
        row_capacity=CAPACITY,
        device=pool.device,
        static_shapes=static,
    )


def assert_same(a: EvictionManager, b: EvictionManager, results_a, results_b) -> None:
    assert [(r.rid, r.tokens_after, r.pages_freed, r.strategy) for r in results_a] == [
        (r.rid, r.tokens_after, r.pages_freed, r.strategy) for r in results_b
    ]
    assert [r.slot_copies for r in results_a] == [r.slot_copies for r in results_b]
    for x, y in zip(
        a.pool.k_buffers + a.pool.v_buffers, b.pool.k_buffers + b.pool.v_buffers, strict=True
    ):
        assert torch.equal(x, y), "the pools' K/V differ"
    assert torch.equal(a.pool.free, b.pool.free), "the allocators got different pages back"
    for r in results_a:
        rows = a.states[r.rid].req_pool_idx
        n = r.tokens_after
        assert torch.equal(a.pool.req_to_token[rows, :n], b.pool.req_to_token[rows, :n])
        assert torch.equal(a.positions(r.rid, n), b.positions(r.rid, n))
    assert torch.equal(a.offsets_by_row, b.offsets_by_row)


request = st.fixed_dictionaries(
    {
        "kv_len": st.integers(40, 300),
        "budget": st.integers(SINKS + WINDOW + 1, 120),
        "cadence": st.integers(1, 40),
        "scorer": st.sampled_from(["knorm", "streaming", "random"]),
        "shared_pages": st.integers(0, 2),
        "prompt": st.integers(0, 60),
        "extra": st.integers(1, 80),
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_size=st.sampled_from([1, 16, 64]),
    compaction=st.sampled_from(["hole_fill", "repack"]),
    evict_prompt=st.booleans(),
    requests=st.lists(request, min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_the_padded_pass_equals_the_exact_pass(page_size, compaction, evict_prompt, requests, seed):
    config = EvictionConfig(
        kv_budget_tokens=64,
        cadence_tokens=16,
        sink_tokens=SINKS,
        window_tokens=WINDOW,
        page_size=page_size,
        compaction=compaction,
        evict_prompt=evict_prompt,
        scorer="knorm",
    )
    rows = len(requests)
    exact_pool = make_pool(page_size, rows, seed)
    lengths = {}
    for r, spec in enumerate(requests):
        append_tokens(exact_pool, r, 0, spec["kv_len"])
        lengths[r] = spec["kv_len"]
    padded_pool = clone_pool(exact_pool)
    exact = manager_for(exact_pool, config, static=False)
    padded = manager_for(padded_pool, config, static=True)

    def due():
        return [
            DueRequest(
                f"r{r}",
                r,
                lengths[r],
                min(spec["shared_pages"] * page_size, spec["kv_len"]),
                min(spec["prompt"], spec["kv_len"]),
                RequestPolicy(
                    enabled=True,
                    kv_budget_tokens=spec["budget"],
                    cadence_tokens=spec["cadence"],
                    scorer=spec["scorer"],
                ),
            )
            for r, spec in enumerate(requests)
        ]

    for pass_index in range(2):
        results_exact = exact.run_batch_pass(due())
        results_padded = padded.run_batch_pass(due())
        assert_same(exact, padded, results_exact, results_padded)
        for result in results_exact:
            r = int(result.rid[1:])
            lengths[r] = result.tokens_after
            exact.check_request(result.rid, lengths[r])
            padded.check_request(result.rid, lengths[r])
        if pass_index == 0:  # both grow the same way before the second pass
            for r, spec in enumerate(requests):
                append_tokens(exact_pool, r, lengths[r], spec["extra"])
                append_tokens(padded_pool, r, lengths[r], spec["extra"])
                lengths[r] += spec["extra"]


def test_buckets_are_the_ladder_and_cover_their_content():
    ladder = [0, 1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    assert [ladder_bucket(n) for n in range(0, 14)] == ladder
    assert [power_of_two_bucket(n) for n in (0, 1, 3, 5, 64, 65)] == [0, 1, 4, 8, 64, 128]
    for n in range(1, 5000):
        assert n <= ladder_bucket(n) <= max(4, 1.5 * n)


def test_a_padded_shape_covers_the_exact_one_and_stays_in_the_row():
    from sglang_evict.passes.batch.counts import batch_pass_counts

    zeros = np.zeros(3, dtype=np.int64)
    counts = batch_pass_counts(
        kv_len=np.array([130, 300, 501]),
        position_offset=zeros,
        num_shared=zeros,
        prompt_len=zeros,
        budget=np.full(3, 100),
        page_size=16,
        sink_tokens=4,
        protected_tokens=0,
        window_tokens=8,
        evict_prompt=True,
    )
    exact = pass_shape(counts, zeros, page_size=16, row_capacity=510, static=False)
    padded = pass_shape(counts, zeros, page_size=16, row_capacity=510, static=True)
    assert exact.width == 510 and padded.width == 510  # capped by the row capacity
    assert padded.requests == 4 and exact.requests == 3
    for field in ("survivors", "evicted"):
        assert getattr(exact, field) <= getattr(padded, field) <= padded.width
    assert exact.released <= padded.released


def count_ops():
    """``benches/bench_pass.py``'s operation counter (one definition of what counts)."""
    path = Path(__file__).resolve().parents[1] / "benches" / "bench_pass.py"
    spec = importlib.util.spec_from_file_location("bench_pass", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CountOps()


def eager_and_graphed(config: EvictionConfig, lengths: list[int], seed: int, page_size=16):
    """Two managers over identical pools holding rows of ``lengths`` tokens: one eager,
    one with pass graphs (emulated off CUDA); returns ``(eager pool, eager, graphed
    pool, graphed)``."""
    eager_pool = make_pool(page_size, len(lengths), seed=seed)
    for r, length in enumerate(lengths):
        append_tokens(eager_pool, r, 0, length)
    graphed_pool = clone_pool(eager_pool)
    eager = manager_for(eager_pool, config, static=True)
    graphed = manager_for(graphed_pool, config, static=True)
    graphed.graphs = PassGraphs(torch.device("cpu"))
    return eager_pool, eager, graphed_pool, graphed


@pytest.mark.parametrize("compaction", ["hole_fill", "repack"])
@pytest.mark.parametrize("scorer", ["knorm", "streaming"])
def test_replayed_passes_equal_eager_ones_and_dispatch_little_outside_the_replay(
    compaction, scorer
):
    """The replay mechanism (``sglang_evict.passes.graphs``, its capture emulated off
    CUDA): the first pass of a shape runs and is captured, later passes of that shape
    are replays of the captured body on the key's static buffers, and the outcome is the
    eager pass's, bit for bit. Outside the replay a pass dispatches at most 10 tensor
    operations (the copy into the static buffer, the staging copy, the clones, the
    allocator hand-over)."""
    page_size, rows = 16, 3
    config = small_config(
        kv_budget_tokens=96, cadence_tokens=32, compaction=compaction, scorer=scorer
    )
    eager_pool, eager, replay_pool, replayed = eager_and_graphed(
        config, [128 + 8 * r for r in range(rows)], seed=7, page_size=page_size
    )
    counter = count_ops()
    replayed._device_pass = counter.outside_of(replayed._device_pass)
    lengths = {r: 128 + 8 * r for r in range(rows)}
    outside = []
    for _ in range(4):
        due = [DueRequest(f"r{r}", r, lengths[r], 0, 0) for r in range(rows)]
        results_eager = eager.run_batch_pass(due)
        counter.count = 0
        with counter:
            results_replayed = replayed.run_batch_pass(due)
        outside.append(counter.count)
        assert_same(eager, replayed, results_eager, results_replayed)
        for result in results_eager:
            r = int(result.rid[1:])
            lengths[r] = result.tokens_after
            replayed.check_request(result.rid, lengths[r])
            append_tokens(eager_pool, r, lengths[r], 32)
            append_tokens(replay_pool, r, lengths[r], 32)
            lengths[r] += 32
    graphs = replayed.graphs
    # The first pass's rows are longer than the steady state's: two shapes, two captures.
    assert len(graphs.entries) == graphs.captures == 2, graphs.entries.keys()
    assert graphs.replays == 2 and graphs.misses == 0
    replays = [n for n, first in zip(outside, (1, 1, 0, 0), strict=True) if not first]
    print("tensor operations outside the replay per pass:", outside)
    assert max(replays) <= 10, outside


def test_a_capture_that_fails_leaves_its_shape_eager_and_the_pass_committed(monkeypatch):
    """A capture raising (a CUDA error, an operation graphs refuse) comes after the
    shape's first pass ran: that pass commits, and later passes of the shape run
    eagerly, counted as misses; the outcome equals eager passes throughout."""
    config = small_config()
    eager_pool, eager, other_pool, broken = eager_and_graphed(config, [80, 80], seed=11)

    def refuse(*_args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(broken.graphs, "_capture", refuse)
    lengths = {0: 80, 1: 80}
    for _ in range(3):
        due = [DueRequest(f"r{r}", r, lengths[r], 0, 0) for r in range(2)]
        assert_same(eager, broken, eager.run_batch_pass(due), broken.run_batch_pass(due))
        for r in range(2):
            lengths[r] = 64
            broken.check_request(f"r{r}", 64)
            append_tokens(eager_pool, r, 64, 16)
            append_tokens(other_pool, r, 64, 16)
            lengths[r] = 80
    assert broken.graphs.misses == 2 and broken.graphs.replays == 0
    assert broken.failures.streak == 0  # no pass failed


def test_passes_that_cannot_be_replayed_run_eagerly_and_are_counted():
    """Mixed scorers in one pass, or a scorer that draws on the host (``random``): the
    pass runs eagerly, the same as without graphs, and counts as a miss."""
    config = small_config()
    pool = make_pool(16, 2, seed=3)
    for r in range(2):
        append_tokens(pool, r, 0, 100)
    manager = manager_for(pool, config, static=True)
    manager.graphs = PassGraphs(torch.device("cpu"))
    mixed = [
        DueRequest("a", 0, 100, 0, 0),
        DueRequest("b", 1, 100, 0, 0, RequestPolicy(True, 64, 16, "streaming")),
    ]
    assert len(manager.run_batch_pass(mixed)) == 2
    assert manager.graphs.misses == 1 and manager.graphs.captures == 0
    manager.check_request("a", 64)
    manager.check_request("b", 64)


def test_shapes_past_the_graph_pool_limit_run_eagerly_counted_and_warned(caplog):
    """The graphs' pool has a limit (``--kv-pass-graph-pool-mib``, taken out of the KV
    pool): a new shape is captured only while the pool plus the largest growth so far
    fits it. Past it the shape's passes run eagerly, equal to eager passes, counted as
    misses, and one warning names the flag (graphs emulated off CUDA: the pool grows by
    what the shape's first pass allocated)."""
    page_size, rows = 16, 3
    config = small_config(kv_budget_tokens=96, cadence_tokens=32)
    eager_pool, eager, limited_pool, limited = eager_and_graphed(
        config, [128 + 8 * r for r in range(rows)], seed=9, page_size=page_size
    )
    graphs = limited.graphs
    lengths = {r: 128 + 8 * r for r in range(rows)}
    for step in range(4):
        due = [DueRequest(f"r{r}", r, lengths[r], 0, 0) for r in range(rows)]
        with caplog.at_level("WARNING", logger="sglang_evict.passes.graphs"):
            assert_same(eager, limited, eager.run_batch_pass(due), limited.run_batch_pass(due))
        if step == 0:  # one shape captured: the pool is full from here on
            assert graphs.captures == 1 and graphs.graph_pool_bytes > 0
            assert graphs.largest_growth_bytes == graphs.graph_pool_bytes
            graphs.pool_limit_bytes = graphs.graph_pool_bytes
        for r in range(rows):
            lengths[r] = 96
            limited.check_request(f"r{r}", 96)
            append_tokens(eager_pool, r, 96, 32)
            append_tokens(limited_pool, r, 96, 32)
            lengths[r] = 128
    # The steady state's shape differs from the first pass's: never captured.
    assert graphs.captures == 1 and len(graphs.entries) == 1
    assert graphs.misses == 3 and graphs.replays == 0
    warnings = [r.getMessage() for r in caplog.records if "eagerly from now on" in r.getMessage()]
    assert len(warnings) == 1 and "--kv-pass-graph-pool-mib" in warnings[0], warnings
    report = graphs.report()
    assert report["graph_pool_limit_mib"] == round(graphs.graph_pool_bytes / 2**20, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")
@pytest.mark.parametrize("compaction", ["hole_fill", "repack"])
@pytest.mark.parametrize("scorer", ["knorm", "streaming"])
def test_cuda_graph_replays_equal_eager_passes_on_a_gpu(compaction, scorer):
    """On CUDA (GPU machines only): passes replayed as real CUDA graphs (on by default
    for a CUDA pool) leave the pool, rows, positions and free list exactly as eager
    passes do; host time per pass, eager and replayed, is printed."""
    import time

    page_size, rows, steps = 16, 8, 6
    config = small_config(
        kv_budget_tokens=96, cadence_tokens=32, compaction=compaction, scorer=scorer
    )
    eager_config = dataclasses.replace(config, pass_cuda_graph=False)
    eager_pool = make_pool(page_size, rows, seed=5, device="cuda")
    for r in range(rows):
        append_tokens(eager_pool, r, 0, 128)
    replay_pool = clone_pool(eager_pool)
    eager = manager_for(eager_pool, eager_config, static=True)
    replayed = manager_for(replay_pool, config, static=True)
    assert replayed.graphs is not None and eager.graphs is None
    lengths = dict.fromkeys(range(rows), 128)
    host_s = {"eager": [], "replayed": []}
    for _ in range(steps):
        due = [DueRequest(f"r{r}", r, lengths[r], 0, 0) for r in range(rows)]
        for name, manager in (("eager", eager), ("replayed", replayed)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            results = manager.run_batch_pass(due)
            host_s[name].append(time.perf_counter() - start)
            torch.cuda.synchronize()
            if name == "eager":
                results_eager = results
        assert_same(eager, replayed, results_eager, results)
        for result in results:
            r = int(result.rid[1:])
            lengths[r] = result.tokens_after
            replayed.check_request(result.rid, lengths[r])
            append_tokens(eager_pool, r, lengths[r], 32)
            append_tokens(replay_pool, r, lengths[r], 32)
            lengths[r] += 32
    assert replayed.graphs.replays >= steps - 2 and replayed.graphs.misses == 0
    print(
        f"{scorer} {compaction}: host ms per pass of {rows} requests, eager "
        f"{1e3 * min(host_s['eager'][2:]):.3f}, replayed {1e3 * min(host_s['replayed'][2:]):.3f}"
    )
