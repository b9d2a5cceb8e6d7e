"""The batched pass never reads device data on the host, checked on CPU.

On PyTorch's ``meta`` device a tensor has a shape and no data, so every operation that
would make a GPU pass wait for the device raises there: ``.item()``, ``.tolist()``,
``bool(tensor)``, ``nonzero``, boolean-mask indexing (its result's shape is data), a
copy to the host. Running the whole of ``EvictionManager.run_batch_pass`` (counts,
scoring, selection, planning, the moves, the row writes and the page give-back) on a
meta pool therefore proves, without a GPU, what
``tests/test_batch_pass_hooks.py::test_the_pass_never_synchronises_the_host_on_a_gpu``
proves on one under ``torch.cuda.set_sync_debug_mode("error")``.

What this does not cover: the GPU's own kernels (the pool-reading scorers, the fused
z-score, the repack launch) cannot run on ``meta``, so the pass takes the torch forms
it takes on CPU, and the repack takes its torch form for devices without a kernel
(``repack_kv_independent``); SGLang's memory classes refuse the ``meta`` device, so the
pool here is ``sglang_evict.passes.tensor_pool.TensorPool`` (the SGLang adapter's reads and
writes are the same two tensor operations, and the GPU test runs them).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sglang_evict.config import EvictionConfig
from sglang_evict.passes.batch.counts import ceil_div
from sglang_evict.passes.batch.shapes import ladder_bucket, power_of_two_bucket
from sglang_evict.passes.manager import DueRequest, EvictionManager
from sglang_evict.passes.tensor_pool import TensorPool
from sglang_evict.query_capture import QueryRing, RingShape
from sglang_evict.request_policy import RequestPolicy
from sglang_evict.scorers.knorm import KNormScorer

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 2, 2, 4, 8
PROMPT = 24  # tokens; also the radix tree's (shared) prefix of every request


def small_config(**fields) -> EvictionConfig:
    """Budget 64, cadence 16, 4 sinks, a 16-token window, page 16, an 8-query window;
    ``fields`` override them."""
    defaults = dict(
        kv_budget_tokens=64,
        cadence_tokens=16,
        sink_tokens=4,
        window_tokens=16,
        page_size=16,
        query_window_tokens=8,
    )
    return EvictionConfig(**{**defaults, **fields})


def meta_manager(
    config: EvictionConfig,
    *,
    rows: int,
    capacity: int,
    spare_pages: int,
    layers: int = LAYERS,
    head_dim: int = HEAD_DIM,
):
    page_size = config.page_size
    slots = (rows * ceil_div(capacity, page_size) + spare_pages + 1) * page_size
    make = lambda: torch.empty(slots, KV_HEADS, head_dim, device="meta")  # noqa: E731
    pool = TensorPool(
        k_buffers=[make() for _ in range(layers)],
        v_buffers=[make() for _ in range(layers)],
        page_size=page_size,
        rows=rows,
        capacity=capacity,
    )
    pool.free = torch.empty(spare_pages, dtype=torch.int64, device="meta")
    manager = EvictionManager(
        config=config,
        pool=pool,
        compactor=None,
        num_request_rows=rows,
        row_capacity=capacity,
        device="meta",
    )
    if manager.scorer.needs_queries:
        shape = RingShape(
            num_layers=layers,
            num_request_rows=rows,
            window=config.query_window_tokens,
            num_q_heads=Q_HEADS,
            head_dim=head_dim,
            dtype=torch.float32,
        )
        manager.query_ring = QueryRing(shape, "meta")
    return manager, pool


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("compaction", ["hole_fill", "repack"])
@pytest.mark.parametrize(
    "scorer", ["knorm", "streaming", "window", "rkv", "random", "knorm/per-request"]
)
def test_a_pass_on_the_meta_device_reads_no_device_data(page_size, compaction, scorer, monkeypatch):
    """Two passes over three requests of different lengths sharing a prompt prefix,
    the second over rows the first compacted; the host-known counts hold and the
    allocator gets exactly the pages each pass reports freed (lengths, known on meta).
    ``knorm/per-request``: knorm without its batched form, so the pass scores each
    request's ``KVView`` in turn (the path of scorers without one, e.g. ``triattention``
    where no pool kernel runs)."""
    if scorer == "knorm/per-request":
        monkeypatch.setattr(KNormScorer, "batch_scores", lambda self, view: None)
        scorer = "knorm"
    config = small_config(scorer=scorer, compaction=compaction, page_size=page_size)
    capacity = 256
    manager, pool = meta_manager(config, rows=4, capacity=capacity, spare_pages=64)
    shared = ceil_div(PROMPT, page_size) * page_size if page_size > 1 else PROMPT
    lengths = {f"r{r}": 64 + 16 + 8 * r for r in range(3)}
    for attempt in range(2):
        due = [
            DueRequest(rid, r, kv_len, min(shared, PROMPT), PROMPT)
            for r, (rid, kv_len) in enumerate(lengths.items())
        ]
        free_before = pool.available_pages()
        results = manager.run_batch_pass(due)
        assert sorted(r.rid for r in results) == sorted(lengths), attempt
        for result in results:
            assert result.tokens_after == config.kv_budget_tokens
            assert result.tokens_evicted == lengths[result.rid] - config.kv_budget_tokens
        freed = sum(r.pages_freed for r in results)
        assert freed > 0 and pool.available_pages() == free_before + freed
        lengths = {rid: config.kv_budget_tokens + 16 + 4 * attempt for rid in lengths}


def test_a_pass_of_requests_with_different_scorers_on_the_meta_device():
    """Per-request policies: rows grouped by scorer, each group scored as its own batch."""
    config = EvictionConfig(
        kv_budget_tokens=48,
        cadence_tokens=16,
        sink_tokens=4,
        window_tokens=8,
        scorer="knorm",
        page_size=16,
        query_window_tokens=8,
    )
    manager, pool = meta_manager(config, rows=3, capacity=128, spare_pages=16)
    policy = lambda scorer, budget: RequestPolicy(True, budget, 16, scorer)  # noqa: E731
    due = [
        DueRequest("a", 0, 80, 16, PROMPT),
        DueRequest("b", 1, 96, 16, PROMPT, policy("streaming", 64)),
        DueRequest("c", 2, 72, 16, PROMPT, policy("knorm", 32)),
    ]
    free_before = pool.available_pages()
    results = {r.rid: r for r in manager.run_batch_pass(due)}
    assert {rid: r.tokens_after for rid, r in results.items()} == {"a": 48, "b": 64, "c": 32}
    assert {rid: r.scorer for rid, r in results.items()} == {
        "a": "knorm",
        "b": "streaming",
        "c": "knorm",
    }
    freed = sum(r.pages_freed for r in results.values())
    assert freed > 0 and pool.available_pages() == free_before + freed


def test_the_meta_check_catches_a_host_read():
    """The check can fail: the host read a boolean mask makes raises on ``meta``."""
    values = torch.empty(8, device="meta")
    with pytest.raises((NotImplementedError, RuntimeError)):
        values[values > 0]
    with pytest.raises((NotImplementedError, RuntimeError)):
        values.sum().item()


class LargestOutput(TorchDispatchMode):
    """Records the most elements any operation's new output holds (its shape: known on
    ``meta``), and where; views and in-place writes (the moves into the KV buffers)
    allocate nothing and are left out."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or any(r.alias_info is not None for r in func._schema.returns):
            return out
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.numel() > self.numel:
                self.numel, self.op = leaf.numel(), f"{func} -> {tuple(leaf.shape)}"
        return out


@pytest.mark.parametrize("scorer", ["knorm", "streaming", "window", "rkv"])
def test_batched_scoring_holds_one_layer_of_keys_at_a_time(scorer):
    """The torch forms of the batched scorers read the pass's keys one layer at a time
    (``KVPoolAccess.gather_layer_keys``): no tensor a pass makes is larger than one
    layer's float keys of the pass, or one layer's window logits (``window``, ``rkv``).
    Every layer's at once would be ``layers`` times that: on a real model (tens of
    layers, 64 requests of thousands of tokens) gigabytes on top of the KV pool, on CPU
    servers and on a GPU whose scoring kernel fell back to the torch forms."""
    layers, window, rows = 6, 8, 3
    config = small_config(scorer=scorer, query_window_tokens=window)
    manager, _ = meta_manager(config, rows=rows, capacity=256, spare_pages=64, layers=layers)
    lengths = [80 + 16 * r for r in range(rows)]
    due = [DueRequest(f"r{r}", r, n, 16, PROMPT) for r, n in enumerate(lengths)]
    # The pass's padded shape (``passes.batch.shapes``: requests and row width bucketed).
    padded_rows = power_of_two_bucket(rows)
    width = ladder_bucket(ceil_div(max(lengths), 16)) * 16
    one_layer_keys = padded_rows * width * KV_HEADS * HEAD_DIM
    one_layer_logits = padded_rows * Q_HEADS * window * width
    largest = LargestOutput()
    with largest:
        results = manager.run_batch_pass(due)
    assert [r.tokens_after for r in results] == [64] * rows
    assert largest.numel <= max(one_layer_keys, one_layer_logits), largest.op
    assert layers * one_layer_keys > max(one_layer_keys, one_layer_logits)  # the check bites
