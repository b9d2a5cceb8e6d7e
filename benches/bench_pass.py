"""Host time of a pass against the budget and the number of due requests per decode
step: the per-request path the plugin used before the batched pass, and the batched
pass, side by side in one run on the same inputs.

    per-request  the previous pass, copied here for this measurement only: per request,
                 the row read to the host, knorm scores, ``select_survivors``, the numpy
                 ``plan_compaction``, the copy, the commit (row write, page frees)
    batched      ``EvictionManager.run_batch_pass``: every due request in one pass,
                 tensor ops on the pool's device, one repack launch

Every request holds budget + cadence tokens (``hole_fill``, page size 16, knorm, 4
sinks, a 128-token window, a 64-token prompt sharing its first 64 tokens), so a pass
evicts one cadence of tokens from each, as it does in a server. On CPU tensors every
device operation runs on the host too: the figures include the work a GPU would do
asynchronously. The last column counts the tensor operations one batched pass
dispatches (a ``TorchDispatchMode``): on a GPU these launches are the host's whole
share of the device work, and their number depends on neither the budget nor the
number of requests. ``done ms/req`` is the batched pass until the device finished it
(the same as the host time on CPU). The per-request path runs at most
``--old-requests`` requests per point (it handles one request at a time, so its cost
per request does not depend on how many are due).

A second table compares the static-shape pass run eagerly with the same pass replayed
(``sglang_evict.passes.graphs``: a CUDA graph per shape on a GPU; off CUDA the capture is
emulated, so the CPU table's replay column still runs the device work on the host):
host time per pass, and the tensor operations a replayed pass dispatches outside the
replay (on a GPU the replay itself is one launch).

    python3 benches/bench_pass.py                      # CPU, one torch thread
    python3 benches/bench_pass.py --device cuda        # GPU: host time, no synchronise
    python3 benches/bench_pass.py --device cuda --replay-only   # just the second table
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path[:0] = [
    os.path.join(os.path.dirname(__file__), ".."),
    os.path.join(os.path.dirname(__file__), "..", "kernels"),
]

from sglang_evict.config import EvictionConfig  # noqa: E402
from sglang_evict.passes.batch.counts import ceil_div  # noqa: E402
from sglang_evict.passes.graphs import PassGraphs  # noqa: E402
from sglang_evict.passes.manager import DueRequest, EvictionManager  # noqa: E402
from sglang_evict.passes.planner import fresh_pages_needed, plan_compaction  # noqa: E402
from sglang_evict.passes.selection import protected_mask, select_survivors  # noqa: E402
from sglang_evict.passes.tensor_pool import TensorPool  # noqa: E402
from sglang_evict.scorers import KVView  # noqa: E402
from sglang_evict_kernels import repack_kv_reference  # noqa: E402

PROMPT_TOKENS = 64  # also the shared (tree-owned) prefix


class BenchPool(TensorPool):
    """The plain-tensor pool the batched pass reads (``TensorPool``), random K/V, plus
    the per-request interface the previous path used."""

    def __init__(self, *, num_pages, page_size, rows, capacity, layers, heads, head_dim, device):
        slots = num_pages * page_size
        g = torch.Generator().manual_seed(0)
        make = lambda: torch.randn(slots, heads, head_dim, generator=g).to(device)  # noqa: E731
        super().__init__(
            k_buffers=[make() for _ in range(layers)],
            v_buffers=[make() for _ in range(layers)],
            page_size=page_size,
            rows=rows,
            capacity=capacity,
        )

    # the previous per-request interface
    def read_row(self, req_pool_idx, length):
        return self.req_to_token[req_pool_idx, :length].to("cpu", torch.int64)

    def write_row(self, req_pool_idx, row):
        self.req_to_token[req_pool_idx, : row.numel()] = row.to(self.device, torch.int32)

    def free_pages(self, pages):
        if pages.numel():
            self.release_pages(torch.unique(pages.to(self.device)))


def previous_pass(pool, config, scorer, req_pool_idx, kv_len):
    """The per-request pass as it was (``EvictionManager._run_pass`` before the batched
    pass), without leases and tracing: a first pass over a request."""
    page_size = config.page_size
    row = pool.read_row(req_pool_idx, kv_len)
    positions = torch.arange(kv_len)
    next_position = kv_len
    frozen_len = min(ceil_div(PROMPT_TOKENS, page_size) * page_size, kv_len)
    immovable = torch.zeros(kv_len, dtype=torch.bool)
    immovable[:frozen_len] = True
    pinned = immovable | (positions < PROMPT_TOKENS)
    order = torch.argsort(positions)
    view = KVView(
        keys=pool.gather_keys(row[order]),
        positions=positions[order],
        current_position=next_position,
    )
    scores = scorer.score(view).cpu()  # selection and planning ran on the host
    protected = protected_mask(
        positions[order],
        sink_tokens=config.sink_tokens,
        protected_tokens=config.protected_tokens,
        window_tokens=config.window_tokens,
        pinned=pinned[order],
    )
    selection = select_survivors(scores, config.kv_budget_tokens, protected)
    survivors = torch.sort(order[selection.indices]).values
    request = dict(page_size=page_size, positions=positions, immovable=immovable)
    strategy = config.compaction
    need = fresh_pages_needed(row, survivors, strategy=strategy, **request)
    fresh = pool.alloc_pages(need) if need else torch.zeros(0, dtype=torch.int64)
    plan = plan_compaction(row, survivors, strategy=strategy, fresh_pages=fresh.cpu(), **request)
    repack_kv_reference(pool.k_buffers, pool.v_buffers, plan.src_slots, plan.dst_slots)
    pool.write_row(req_pool_idx, plan.new_row)
    pool.free_pages(plan.freed_pages)
    evicted = positions[~torch.isin(positions, plan.new_positions)]
    return int(evicted.min())


class CountOps(TorchDispatchMode):
    """Counts dispatched tensor operations that compute (views excluded: on a GPU they
    launch nothing), except inside a function wrapped by ``outside_of`` (a replayed
    pass's device body: one launch on a GPU)."""

    def __init__(self):
        super().__init__()
        self.count, self.inside = 0, 0

    def outside_of(self, function):
        """``function``, its own operations left uncounted."""

        def wrapped(*args, **kwargs):
            self.inside += 1
            try:
                return function(*args, **kwargs)
            finally:
                self.inside -= 1

        return wrapped

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside and not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def setup(args, budget, num_requests):
    config = EvictionConfig(
        kv_budget_tokens=budget,
        cadence_tokens=args.cadence,
        sink_tokens=4,
        window_tokens=128,
        scorer="knorm",
        compaction=args.strategy,
        page_size=args.page_size,
        lease_store="none",
    )
    kv_len = budget + args.cadence
    pages_per_request = ceil_div(kv_len, args.page_size)
    pool = BenchPool(
        num_pages=num_requests * pages_per_request * 2 + 2,
        page_size=args.page_size,
        rows=num_requests,
        capacity=kv_len,
        layers=args.layers,
        heads=args.kv_heads,
        head_dim=args.head_dim,
        device=args.device,
    )
    return config, pool, kv_len


def fill_rows(pool, num_requests, kv_len, page_size, seed):
    """Fresh rows at random pages; the rest of the pool free."""
    pages_per_request = ceil_div(kv_len, page_size)
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(pool.num_pages - 1, generator=g)[: num_requests * pages_per_request] + 1
    offsets = torch.arange(page_size)
    for r in range(num_requests):
        mine = pages[r * pages_per_request : (r + 1) * pages_per_request]
        row = (mine.unsqueeze(1) * page_size + offsets).reshape(-1)[:kv_len]
        pool.req_to_token[r, :kv_len] = row.to(pool.device, torch.int32)
    used = torch.zeros(pool.num_pages, dtype=torch.bool)
    used[pages] = True
    used[0] = True
    pool.free = torch.nonzero(~used)[:, 0].to(pool.device)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_batched(args, config, pool, kv_len, num_requests, count_ops=False):
    manager = EvictionManager(
        config=config,
        pool=pool,
        compactor=None,
        num_request_rows=num_requests,
        row_capacity=kv_len,
        device=args.device,
    )
    due = [
        DueRequest(f"r{r}", r, kv_len, PROMPT_TOKENS, PROMPT_TOKENS) for r in range(num_requests)
    ]
    sync(args.device)
    counter = CountOps() if count_ops else None
    start = time.perf_counter()
    if counter is None:
        results = manager.run_batch_pass(due)
    else:
        with counter:
            results = manager.run_batch_pass(due)
    elapsed = time.perf_counter() - start  # host time: no wait for the device
    sync(args.device)
    done = time.perf_counter() - start  # until the device finished the pass too
    assert len(results) == num_requests and all(
        r.tokens_after == config.kv_budget_tokens for r in results
    )
    return elapsed, done, (counter.count if counter else None)


def replay_manager(args, config, pool, kv_len, num_requests, replayed: bool):
    """A manager kept across passes (its graphs live as long as it does): replayed,
    or the static-shape pass run eagerly."""
    import dataclasses

    config = dataclasses.replace(config, pass_cuda_graph=replayed and args.device == "cuda")
    manager = EvictionManager(
        config=config,
        pool=pool,
        compactor=None,
        num_request_rows=num_requests,
        row_capacity=kv_len,
        device=args.device,
    )
    if replayed and manager.graphs is None:  # off CUDA: the emulated capture
        manager.graphs = PassGraphs(torch.device(args.device))
    return manager


def time_replay_point(args, budget, num_requests, replayed: bool):
    """Median host ms per pass (the first two passes, which capture, left out), the
    median host ms outside the pass's device body (on a GPU a replay does not run the
    body on the host, so there the two agree; off CUDA the emulated replay runs it, and
    the second figure is what the host would pay around a real replay), the
    operations a pass dispatched outside its device body, counted on one more pass
    (the counter's dispatch hook costs host time: the timed passes run without it),
    and the MiB the shape's capture took from the graphs' pool (on a GPU what the
    capture reserved; off CUDA what the shape's first pass allocated, the most a
    capture could take; 0 for eager passes)."""
    config, pool, kv_len = setup(args, budget, num_requests)
    manager = replay_manager(args, config, pool, kv_len, num_requests, replayed)
    counter = CountOps()
    in_body = [0.0]
    body = counter.outside_of(manager._device_pass)

    def timed_body(*a, **k):
        started = time.perf_counter()
        try:
            return body(*a, **k)
        finally:
            in_body[0] += time.perf_counter() - started

    manager._device_pass = timed_body
    due = [
        DueRequest(f"r{r}", r, kv_len, PROMPT_TOKENS, PROMPT_TOKENS) for r in range(num_requests)
    ]
    times, outside = [], []
    for repeat in range(args.repeats + 3):
        fill_rows(pool, num_requests, kv_len, args.page_size, seed=repeat)
        manager.states.clear()
        manager.positions_by_row.zero_()
        manager.offsets_by_row.zero_()
        sync(args.device)
        counted = repeat == args.repeats + 2
        in_body[0] = 0.0
        start = time.perf_counter()
        if counted:
            counter.count = 0
            with counter:
                results = manager.run_batch_pass(due)
        else:
            results = manager.run_batch_pass(due)
        elapsed = time.perf_counter() - start
        sync(args.device)
        assert all(r.tokens_after == config.kv_budget_tokens for r in results)
        if 2 <= repeat and not counted:
            times.append(elapsed)
            outside.append(elapsed - (in_body[0] if not replayed or args.device != "cuda" else 0))
    pool_mib = 0.0
    if replayed:
        assert manager.graphs.replays == args.repeats + 2, "every timed pass must be a replay"
        pool_mib = manager.graphs.graph_pool_bytes / 2**20
    ms = statistics.median(times) * 1e3
    return ms, statistics.median(outside) * 1e3, counter.count, pool_mib


def replay_table(args) -> None:
    how = "CUDA graphs" if args.device == "cuda" else "capture emulated off CUDA"
    print(f"\nstatic-shape pass, eager vs replayed ({how}), host ms per pass")
    if args.device != "cuda":
        print(
            "(off CUDA the emulated replay runs the device body on the host: 'replay "
            "outside ms' leaves it out, the host's share around a real replay)"
        )
    print(
        f"{'budget':>7} {'due':>4} {'eager ms':>9} {'replay ms':>10} {'ratio':>7} "
        f"{'replay outside ms':>18} {'pool MiB':>9} {'ops outside':>12}"
    )
    for budget in args.budgets:
        for num_requests in args.due:
            eager_ms, _, _, _ = time_replay_point(args, budget, num_requests, replayed=False)
            replay_ms, outside_ms, ops, pool_mib = time_replay_point(
                args, budget, num_requests, replayed=True
            )
            print(
                f"{budget:>7} {num_requests:>4} {eager_ms:>9.3f} {replay_ms:>10.3f} "
                f"{eager_ms / replay_ms:>6.1f}x {outside_ms:>18.3f} {pool_mib:>9.2f} {ops:>12}",
                flush=True,
            )


def time_previous(args, config, pool, kv_len, num_requests):
    scorer = config.make_scorer()
    sync(args.device)
    start = time.perf_counter()
    for r in range(num_requests):
        previous_pass(pool, config, scorer, r, kv_len)
    sync(args.device)
    return time.perf_counter() - start


def add_pool_arguments(parser: argparse.ArgumentParser) -> None:
    """The pass's policy and pool shape (``setup``), shared with bench_step_hooks.py."""
    parser.add_argument("--cadence", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--strategy", default="hole_fill", choices=["hole_fill", "repack"])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--due", type=int, nargs="+", default=[1, 4, 16, 64])
    add_pool_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--old-requests", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="one tiny point (checks the script)")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after the table: cProfile of N batched passes with one due request (first budget)",
    )
    parser.add_argument(
        "--replay-only", action="store_true", help="only the eager vs replayed table"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.budgets, args.due, args.cadence, args.repeats = [256], [2], 32, 1
    torch.set_num_threads(args.threads)
    print(
        f"device {args.device}, {args.threads} torch thread(s), page size {args.page_size}, "
        f"{args.strategy}, knorm, cadence {args.cadence}; pool {args.layers} layer(s) x "
        f"{args.kv_heads} KV head(s) x {args.head_dim}"
    )
    header = (
        f"{'budget':>7} {'due':>4} {'per-request ms/req':>19} {'batched ms/req':>15} "
        f"{'ratio':>7} {'ops/pass':>9} {'done ms/req':>13}"
    )
    if args.replay_only:
        replay_table(args)
        return
    print(header)
    for budget in args.budgets:
        for num_requests in args.due:
            config, pool, kv_len = setup(args, budget, num_requests)
            batched, finished, previous = [], [], []
            old_requests = min(num_requests, args.old_requests)
            for repeat in range(args.repeats + 1):  # the first round warms up
                fill_rows(pool, num_requests, kv_len, args.page_size, seed=repeat)
                b, d, _ = time_batched(args, config, pool, kv_len, num_requests)
                fill_rows(pool, num_requests, kv_len, args.page_size, seed=repeat)
                p = time_previous(args, config, pool, kv_len, old_requests)
                if repeat:
                    batched.append(b / num_requests)
                    finished.append(d / num_requests)
                    previous.append(p / old_requests)
            fill_rows(pool, num_requests, kv_len, args.page_size, seed=0)
            _, _, ops = time_batched(args, config, pool, kv_len, num_requests, count_ops=True)
            b_ms, p_ms = statistics.median(batched) * 1e3, statistics.median(previous) * 1e3
            d_ms = statistics.median(finished) * 1e3
            print(
                f"{budget:>7} {num_requests:>4} {p_ms:>19.3f} {b_ms:>15.3f} "
                f"{p_ms / b_ms:>6.1f}x {ops:>9} {d_ms:>13.3f}",
                flush=True,
            )
    replay_table(args)
    if args.profile:
        profile_passes(args, args.budgets[0], args.profile)


def profile_passes(args, budget: int, passes: int) -> None:
    """Where a pass's host time goes: cProfile over ``passes`` one-request passes."""
    import cProfile
    import pstats

    config, pool, kv_len = setup(args, budget, 1)
    profiler = cProfile.Profile()
    for repeat in range(passes + 1):
        fill_rows(pool, 1, kv_len, args.page_size, seed=repeat)
        sync(args.device)
        if repeat:  # the first warms up
            profiler.enable()
        time_batched(args, config, pool, kv_len, 1)
        profiler.disable()
    print(f"\ncProfile, {passes} passes of one due request, budget {budget}:")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
