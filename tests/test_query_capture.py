"""The query ring and the capture hook on constructed inputs: what the ring holds and
costs, that a capture is a plain copy into preallocated buffers (what keeps it valid
under CUDA-graph replay), that the attention backend receives exactly its own
arguments, and that the batched ``window``/``rkv`` scores equal the per-request ones."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.plugins.hook_registry import HookType, _wrap_fn
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_evict.passes.batch.scoring import score_rows
from sglang_evict.query_capture import QueryRing, RingShape, kv_tokens_for
from sglang_evict.scorers import KVView, build_scorer
from sglang_evict.scorers.base import BatchKVView
from sglang_evict.srt import capture
from sglang_evict.srt.versioned import req_kv

LAYERS, KV_HEADS, GROUP, HEAD_DIM = 2, 2, 2, 8
Q_HEADS = KV_HEADS * GROUP


def ring_of(window=6, rows=4, dtype=torch.float32, layers=LAYERS) -> QueryRing:
    return QueryRing(RingShape(layers, rows, window, Q_HEADS, HEAD_DIM, dtype))


def queries_at(positions, layers=LAYERS, seed=0) -> torch.Tensor:
    """Distinct queries ``[layers, T, Q_HEADS, HEAD_DIM]``: query t of layer l is filled
    with ``1000 * l + position``, so a cell tells which query it holds."""
    base = torch.as_tensor(positions, dtype=torch.float32)
    layer = torch.arange(layers, dtype=torch.float32).view(-1, 1) * 1000
    return (layer + base).view(layers, -1, 1, 1).expand(-1, -1, Q_HEADS, HEAD_DIM).clone()


# --- what the ring holds and costs -------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "window", "rows"), [(torch.float32, 6, 4), (torch.bfloat16, 32, 9)]
)
def test_ring_memory_equals_the_documented_formula(dtype, window, rows):
    ring = ring_of(window, rows, dtype)
    element = torch.empty((), dtype=dtype).element_size()
    # One slot per row + the scratch slot; an int64 slot per row + the scratch row.
    formula = (rows + 1) * window * (LAYERS * Q_HEADS * HEAD_DIM * element + 8) + (rows + 1) * 8
    assert ring.nbytes == ring.shape.total_bytes == formula
    shared = QueryRing(RingShape(LAYERS, rows, window, Q_HEADS, HEAD_DIM, dtype, num_slots=2))
    slots_formula = 3 * window * (LAYERS * Q_HEADS * HEAD_DIM * element + 8) + (rows + 1) * 8
    assert shared.nbytes == shared.shape.total_bytes == slots_formula
    # In KV tokens of 512 bytes, whole pages of 4: ceil(formula / 2048) pages.
    assert kv_tokens_for(formula, 512, 4) == 4 * math.ceil(formula / 2048)


def test_ring_holds_each_requests_last_w_queries_and_nothing_older():
    ring = ring_of(window=6)
    for position in range(20):  # decode steps of request row 2 (row 1 idle)
        ring.record(2, queries_at([position]), torch.tensor([position]))
    window = ring.window_of(torch.tensor([2, 1]), torch.tensor([20, 20]))
    held = window.positions[0][window.valid[0]].tolist()
    assert sorted(held) == list(range(14, 20)) and not window.valid[1].any()
    queries, positions = window.request_queries(0)
    assert positions.tolist() == list(range(14, 20))  # oldest first
    assert queries[1, :, 0, 0].tolist() == [1000.0 + p for p in range(14, 20)]
    # At a later next position the older queries fall out of the window.
    later = ring.window_of(torch.tensor([2]), torch.tensor([23]))
    assert sorted(later.positions[0][later.valid[0]].tolist()) == [17, 18, 19]


def test_extend_batch_keeps_each_requests_last_w_prompt_queries():
    """Two prompts in one extend batch (3 and 10 tokens, W = 4): each row gets its own
    last min(W, length) queries; the others go to the scratch row."""
    ring = ring_of(window=4)
    lens = [3, 10]
    positions = torch.cat([torch.arange(3), torch.arange(10)])
    queries = queries_at(positions)
    for layer in range(LAYERS):
        ring.write_extend(
            layer,
            queries[layer],
            torch.tensor([1, 3]),
            positions,
            torch.tensor([0, 3]),
            torch.tensor(lens),
        )
    window = ring.window_of(torch.tensor([1, 3]), torch.tensor([3, 10]))
    for r, expected in enumerate(([0, 1, 2], [6, 7, 8, 9])):
        q, p = window.request_queries(r)
        assert p.tolist() == expected and q[0, :, 0, 0].tolist() == expected


def test_a_new_request_on_a_reused_row_sees_none_of_the_previous_requests_queries():
    ring = ring_of(window=6)
    ring.claim_rows([2], [1])
    ring.record(2, queries_at(range(10)), torch.arange(10))  # request 1: positions 0..9
    ring.claim_rows([2], [1])  # the same request again (a later chunk): nothing reset
    assert ring.window_of(torch.tensor([2]), torch.tensor([10])).valid.sum() == 6
    ring.claim_rows([2], [2])  # SGLang handed the row to a new request
    ring.record(2, queries_at([7]), torch.tensor([7]))  # its prompt ends where 1's did
    window = ring.window_of(torch.tensor([2]), torch.tensor([8]))
    assert window.positions[0][window.valid[0]].tolist() == [7]  # not 2..6 of request 1


# --- the capture is a plain copy (CUDA-graph safe) ---------------------------------------

# Ops that read tensor data on the host (a synchronisation on a GPU) or size a result by
# data (which a captured CUDA graph cannot replay).
HOST_READS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "is_nonzero", "equal"}


class OpLog(TorchDispatchMode):
    """Every aten op run: its name, its tensor arguments' shapes, and the storages that
    in-place ops wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []
        self.written: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        self.ops.append((func.overloadpacket.__name__, shapes))
        if func._schema.is_mutable:
            self.written.append(args[0].untyped_storage().data_ptr())
        return func(*args, **kwargs)


class RecordingBackend(AttentionBackend):
    """An attention backend that records what its decode/extend kernels receive."""

    def __init__(self) -> None:
        self.received = []

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self.received.append((q, k, v, layer, forward_batch, save_kv_cache, kwargs))
        return q

    forward_extend = forward_decode


def decode_batch(rows, positions) -> ForwardBatch:
    rows = torch.tensor(rows)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=len(rows),
        input_ids=torch.zeros(len(rows), dtype=torch.int64),
        req_pool_indices=rows,
        seq_lens=torch.tensor(positions) + 1,
        out_cache_loc=torch.zeros(len(rows), dtype=torch.int64),
        seq_lens_sum=0,
        positions=torch.tensor(positions),
    )


def attention_layer(layer_id: int) -> RadixAttention:
    return RadixAttention(Q_HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, layer_id)


@pytest.fixture
def hooked_forward(monkeypatch):
    """``AttentionBackend.forward`` wrapped as ``HookRegistry`` wraps it, over a ring."""
    ring = ring_of(window=4)
    monkeypatch.setattr(capture.STATE, "ring", ring)
    forward = _wrap_fn(AttentionBackend.forward, capture._before_attention_forward, HookType.BEFORE)
    return ring, forward


def test_the_backend_receives_its_own_arguments_unchanged(hooked_forward):
    ring, forward = hooked_forward
    backend = RecordingBackend()
    q = torch.randn(2, Q_HEADS * HEAD_DIM)
    k, v = torch.randn(2, KV_HEADS, HEAD_DIM), torch.randn(2, KV_HEADS, HEAD_DIM)
    layer, batch = attention_layer(1), decode_batch([1, 3], [5, 9])
    before = q.clone()
    out = forward(backend, q, k, v, layer, batch, save_kv_cache=False)
    assert out is q and torch.equal(q, before)
    (got,) = backend.received
    assert got[0] is q and got[1] is k and got[2] is v and got[3] is layer and got[4] is batch
    assert got[5] is False and got[6] == {}
    # ... and the ring holds layer 1's query of each request at its position.
    window = ring.window_of(torch.tensor([1, 3]), torch.tensor([6, 10]))
    assert torch.equal(window.queries_of_layer(1)[0, 5 % 4], q[0].view(Q_HEADS, HEAD_DIM))
    assert torch.equal(window.queries_of_layer(1)[1, 9 % 4], q[1].view(Q_HEADS, HEAD_DIM))


def test_capture_is_a_fixed_shape_copy_into_the_preallocated_ring(hooked_forward):
    """What a CUDA graph needs of the capture (checked on CPU, where no graph exists):
    the same ops on the same shapes whatever the rows and positions, no op that reads
    tensor data on the host, writes only into the ring's own buffers, none reallocated.
    SGLang writes its KV cache with the same ``index_put_``."""
    ring, forward = hooked_forward
    backend = RecordingBackend()
    storages = {b.untyped_storage().data_ptr() for b in (*ring.queries, ring.positions)}
    traces = []
    for rows, positions in (([1, 3], [5, 9]), ([2, 0], [130, 7])):  # 0: padding row
        with OpLog() as log:
            for layer_id in range(LAYERS):
                q = torch.randn(2, Q_HEADS * HEAD_DIM)
                forward(
                    backend, q, None, None, attention_layer(layer_id), decode_batch(rows, positions)
                )
        traces.append(log.ops)
        assert not {name for name, _ in log.ops} & HOST_READS, log.ops
        assert log.written and set(log.written) <= storages
    assert traces[0] == traces[1]
    assert {b.untyped_storage().data_ptr() for b in (*ring.queries, ring.positions)} == storages


def test_a_backend_applying_rope_itself_is_refused(hooked_forward):
    _, forward = hooked_forward
    with pytest.raises(RuntimeError, match="applies RoPE inside the backend"):
        forward(
            RecordingBackend(),
            torch.randn(1, Q_HEADS * HEAD_DIM),
            None,
            None,
            attention_layer(0),
            decode_batch([1], [3]),
            cos_sin_cache=torch.zeros(4),
        )


def test_capture_plan_shrinks_the_pool_by_the_ring_in_whole_pages_or_refuses():
    config = SimpleNamespace(
        query_window_tokens=32, scorer="rkv", query_slots=None, kv_budget_tokens=64
    )
    model = SimpleNamespace(
        get_num_kv_heads=lambda tp: 8 // tp,
        get_num_attention_heads=lambda tp: 32 // tp,
        head_dim=128,
        v_head_dim=128,
    )
    kwargs = dict(
        model_config=model,
        tp_size=2,
        num_layers=32,
        kv_cache_dtype=torch.bfloat16,
        model_dtype=torch.bfloat16,
        page_size=16,
    )
    plan = capture.plan_capture(config, pool_tokens=100_000, num_request_rows=65, **kwargs)
    # Per slot: 32 queries x 32 layers x 16 heads x 128 x 2 bytes (+ 8 per cell); a KV
    # token: 4 heads x 256 x 32 layers x 2 bytes. 64 tokens a slot + the positions. The
    # budget lets 100_000 // 65 requests run: the 65 rows cap the slots.
    assert plan.shape.slots == 65
    assert plan.ring_bytes == 66 * 32 * (32 * 16 * 128 * 2 + 8) + 66 * 8
    assert plan.kv_bytes_per_token == 4 * 256 * 32 * 2
    assert plan.reserved_tokens == 16 * math.ceil(plan.ring_bytes / (65536 * 16))
    assert plan.pool_tokens_after == 100_000 - plan.reserved_tokens
    # At a 4,096-token budget at most 100_000 // 4097 = 24 requests a pass may read run
    # at once: 24 slots (the rows no longer bound them).
    config.kv_budget_tokens = 4096
    plan = capture.plan_capture(config, pool_tokens=100_000, num_request_rows=65, **kwargs)
    assert plan.shape.slots == 100_000 // 4097 == 24
    assert plan.ring_bytes == 25 * 32 * (32 * 16 * 128 * 2 + 8) + 66 * 8
    config.query_slots = 3  # --kv-query-slots
    fixed = capture.plan_capture(config, pool_tokens=100_000, num_request_rows=65, **kwargs)
    assert fixed.shape.slots == 3
    config.query_slots, config.kv_budget_tokens = 65, 64
    with pytest.raises(ValueError, match="lower --kv-query-slots or --kv-query-window"):
        capture.plan_capture(config, pool_tokens=4096, num_request_rows=65, **kwargs)


# --- batched scores equal the per-request scorer ------------------------------------------


def batch_case(lengths=(30, 17, 24), window=6, seed=0):
    """Requests whose rows hold scattered logical positions in a scrambled order (as
    after ``hole_fill`` passes), padded to the longest, with their queries in a ring;
    returns the batched view and each request's per-request ``KVView``."""
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(lengths) + 1
    k_buffers = [torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=g) for _ in range(LAYERS)]
    ring = ring_of(window=window, rows=len(lengths) + 1)
    R, N = len(lengths), max(lengths)
    slots = torch.zeros(R, N, dtype=torch.int64)
    positions = torch.zeros(R, N, dtype=torch.int64)
    accumulated = torch.zeros(R, N)
    next_positions, views = [], []
    base = 1
    for r, n in enumerate(lengths):
        held = torch.sort(torch.randperm(n + 12, generator=g)[:n]).values  # some evicted
        next_position = int(held[-1]) + 1
        order = torch.randperm(n, generator=g)  # row order != logical order
        slots[r, :n] = base + torch.arange(n)
        positions[r, :n] = held[order]
        accumulated[r, :n] = torch.rand(n, generator=g)
        query_positions = torch.arange(next_position - window - 3, next_position)
        ring.record(
            r + 1, torch.randn(LAYERS, window + 3, Q_HEADS, HEAD_DIM, generator=g), query_positions
        )
        base += n
        next_positions.append(next_position)
    valid = torch.arange(N).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    rows = torch.arange(1, R + 1)
    current = torch.tensor(next_positions)
    gather = lambda s: torch.stack([b.index_select(0, s) for b in k_buffers])  # noqa: E731
    view = BatchKVView(
        k_buffers=k_buffers,
        slots=torch.where(valid, slots, 0),
        positions=positions,
        valid=valid,
        current_positions=current,
        lengths=tuple(lengths),
        current_positions_host=tuple(next_positions),
        gather_keys=gather,
        gather_layer_keys=lambda layer, s: k_buffers[layer].index_select(0, s),
        queries=ring.window_of(rows, current),
        accumulated_scores=accumulated,
    )
    for r, n in enumerate(lengths):
        logical = torch.argsort(positions[r, :n])
        queries, query_positions = view.queries.request_queries(r)
        assert query_positions.tolist() == list(
            range(next_positions[r] - window, next_positions[r])
        )
        per_request = KVView(
            keys=gather(slots[r, :n][logical]),
            positions=positions[r, :n][logical],
            current_position=next_positions[r],
            queries=queries,
            query_positions=query_positions,
            accumulated_scores=accumulated[r, :n][logical],
        )
        views.append((logical, per_request))
    return view, views


SCORER_CASES = [
    pytest.param("window", {}, id="window-sum"),
    pytest.param("window", {"mode": "last"}, id="window-last"),
    pytest.param(
        "window", {"mode": "cumulative", "head_normalization": "none"}, id="window-cumulative"
    ),
    pytest.param("window", {"pool_kernel": 5, "head_reduction": "max"}, id="window-pooled-max"),
    pytest.param("rkv", {}, id="rkv"),
    pytest.param("rkv", {"mix_lambda": 0.5, "pool_kernel": 1}, id="rkv-unpooled"),
    pytest.param("knorm", {}, id="knorm"),
    pytest.param("random", {"seed": 3}, id="random"),
]


@pytest.mark.parametrize(("name", "params"), SCORER_CASES)
def test_batched_scores_equal_the_per_request_scorer(name, params):
    scorer = build_scorer(name, params)
    view, per_request = batch_case()
    batched = scorer.batch_scores(view)
    assert batched.shape == view.slots.shape and batched.dtype == torch.float32
    for r, (logical, request_view) in enumerate(per_request):
        expected = scorer.score(request_view)
        got = batched[r, : view.lengths[r]][logical]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=f"request {r}")


def test_a_pass_mixing_scorers_scores_each_request_as_its_own_scorer_alone():
    """Requests of one pass that chose different scorers (per-request policy) are scored
    in one group per scorer: each group reads its own requests' queries and carried
    scores, never a neighbour's."""
    view, per_request = batch_case(lengths=(30, 17, 24, 9))
    chosen = [
        build_scorer("rkv"),
        build_scorer("knorm"),
        build_scorer("window", {"mode": "cumulative", "head_normalization": "none"}),
        build_scorer("rkv"),
    ]
    chosen[3] = chosen[0]  # one instance per scorer, as the manager holds them
    mixed = score_rows(chosen, view)
    for r, (logical, request_view) in enumerate(per_request):
        expected = chosen[r].score(request_view)
        got = mixed[r, : view.lengths[r]][logical]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=f"request {r}")


def test_rkv_never_materialises_a_token_by_token_matrix():
    """R-KV's redundancy as ``u_i . S - u_i . u_i``: no tensor of N x N entries."""
    view, _ = batch_case(lengths=(300,), window=4)
    with OpLog() as log:
        build_scorer("rkv").batch_scores(view)
    largest = max(math.prod(shape) for _, shapes in log.ops for shape in shapes)
    assert largest < 300 * 300 / 4, largest


# --- on a GPU (skipped here: no CUDA device) ---------------------------------------------

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs, host syncs)"
)


@needs_cuda
def test_ring_write_recorded_in_a_cuda_graph_replays_with_new_rows_and_positions():
    """A decode graph captured with the capture's copy writes the replayed batch's
    queries at the replayed rows and positions (static inputs updated in place)."""
    ring = QueryRing(RingShape(1, 4, 4, Q_HEADS, HEAD_DIM, torch.float32), "cuda")
    rows = torch.tensor([1, 0], device="cuda")  # entry 1: a padded entry (row 0)
    positions = torch.tensor([5, 0], device="cuda")
    queries = torch.zeros(2, Q_HEADS, HEAD_DIM, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up, as SGLang's graph runner does
        ring.write_decode(0, queries, rows, positions)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ring.write_decode(0, queries, rows, positions)
    for row, position, value in ((3, 9, 7.0), (2, 14, 11.0)):
        rows.copy_(torch.tensor([row, 0]))
        positions.copy_(torch.tensor([position, 0]))
        queries.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        cell = position % 4
        assert int(ring.positions[row, cell]) == position
        assert torch.all(ring.queries[0][row, cell] == value)


@needs_cuda
@pytest.mark.parametrize("scorer", ["window", "rkv"])
def test_capture_and_query_scorer_passes_never_synchronise_the_host_on_a_gpu(scorer):
    """Decode steps on CUDA tensors under ``set_sync_debug_mode("error")``: the ring's
    writes and every batched pass of a query-reading scorer (any host wait raises)."""
    from sglang_evict.config import EvictionConfig
    from sglang_evict.srt.cpu_driver import MemoryDriver
    from sglang_evict.srt.hooks import compact_decode_batch
    from tests.sglang_harness import finish_decode_step

    config = EvictionConfig(
        kv_budget_tokens=64, cadence_tokens=16, window_tokens=16, scorer=scorer, page_size=16
    )
    driver = MemoryDriver(
        page_size=16,
        num_tokens=4096,
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        config=config,
        device="cuda",
        num_q_heads=Q_HEADS,
    )
    manager = driver.evictor
    reqs = []
    for i, length in enumerate((40, 56, 70)):
        req, _, _ = driver.admit(f"r{i}", list(range(i, i + length)))
        manager.record_queries(
            req_kv(req).req_pool_idx,
            torch.randn(LAYERS, length, Q_HEADS, HEAD_DIM, device="cuda"),
            torch.arange(length, device="cuda"),
        )
        driver.prefill_done(req)
        reqs.append(req)
    results = []
    for _ in range(40):
        batch = driver.schedule_batch(reqs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            results += compact_decode_batch(manager, batch)
            positions = manager.decode_positions(batch.req_pool_indices, batch.seq_lens + 1)
            for layer in range(LAYERS):
                manager.query_ring.write_decode(
                    layer,
                    torch.randn(len(reqs), Q_HEADS, HEAD_DIM, device="cuda"),
                    batch.req_pool_indices,
                    positions,
                )
        finally:
            torch.cuda.set_sync_debug_mode("default")
        finish_decode_step(batch, reqs)
    assert results, "no pass ran"
    for req in reqs:
        manager.check_request(req.rid, req_kv(req).kv_committed_len)
