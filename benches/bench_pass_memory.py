"""Peak host memory one batched pass adds on CPU tensors, at a model's shapes.

A pass's torch forms read keys one layer at a time (``KVPoolAccess.gather_layer_keys``),
so what a pass adds should be about one layer's float keys of its due requests,
whatever the number of layers. Each scorer runs in a fresh process (the peak resident
size, ``ru_maxrss``, is per process): the pool is built, then one pass over every
request, and the growth of the peak during the pass is printed beside one layer's and
every layer's float keys of the pass.

    python3 benches/bench_pass_memory.py                     # 32 layers, 8 KV heads x 128
    python3 benches/bench_pass_memory.py --smoke             # a tiny pool (checks the script)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "kernels")]

MiB = 2**20


def one_pass(args) -> dict:
    """In this process: build a bf16 pool, run one pass, report the peak's growth."""
    import torch
    from bench_pass import fill_rows  # this script's directory is on the path

    from sglang_evict.config import EvictionConfig
    from sglang_evict.passes.batch.counts import ceil_div
    from sglang_evict.passes.manager import DueRequest, EvictionManager
    from sglang_evict.passes.tensor_pool import TensorPool

    torch.set_num_threads(1)
    P, R, kv_len = args.page_size, args.requests, args.budget + args.cadence
    pages_per_request = ceil_div(kv_len, P)
    num_pages = R * pages_per_request + 2

    def make():
        shape = (num_pages * P, args.kv_heads, args.head_dim)
        return torch.empty(shape, dtype=torch.bfloat16).normal_()

    pool = TensorPool(
        k_buffers=[make() for _ in range(args.layers)],
        v_buffers=[make() for _ in range(args.layers)],
        page_size=P,
        rows=R,
        capacity=kv_len,
    )
    fill_rows(pool, R, kv_len, P, seed=0)  # rows at random pages, the rest free
    config = EvictionConfig(
        kv_budget_tokens=args.budget,
        cadence_tokens=args.cadence,
        sink_tokens=4,
        window_tokens=128,
        scorer=args.scorer,
        page_size=P,
        lease_store="none",
    )
    manager = EvictionManager(
        config=config,
        pool=pool,
        compactor=None,
        num_request_rows=R,
        row_capacity=kv_len,
        device="cpu",
    )
    due = [DueRequest(f"r{r}", r, kv_len, 64, 64) for r in range(R)]
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results = manager.run_batch_pass(due)
    after_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert all(r.tokens_after == args.budget for r in results)
    return {"growth_bytes": (after_kib - before_kib) * 1024}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scorers",
        nargs="+",
        default=["knorm", "streaming", "random"],
        choices=["knorm", "streaming", "random"],  # the others need a query ring or stats
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--cadence", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="a tiny pool (checks the script)")
    parser.add_argument("--scorer", help=argparse.SUPPRESS)  # the child's one scorer
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.kv_heads, args.head_dim = 4, 2, 16
        args.requests, args.budget, args.cadence = 2, 256, 32
    if args.scorer:  # the child process
        print(json.dumps(one_pass(args)))
        return
    tokens = args.requests * (args.budget + args.cadence)
    layer_bytes = tokens * args.kv_heads * args.head_dim * 4  # float32 keys
    pool_bytes = 2 * args.layers * tokens * args.kv_heads * args.head_dim * 2
    print(
        f"{args.layers} layers x {args.kv_heads} KV heads x {args.head_dim}, bf16 pool "
        f"{pool_bytes / MiB:,.0f} MiB; {args.requests} due requests x "
        f"{args.budget + args.cadence} tokens; one layer's float keys of the pass "
        f"{layer_bytes / MiB:,.1f} MiB, every layer's {args.layers * layer_bytes / MiB:,.1f} MiB"
    )
    print(f"{'scorer':>10} {'pass adds MiB':>14} {'/ one layer':>12}")
    sizes = {
        "--layers": args.layers,
        "--kv-heads": args.kv_heads,
        "--head-dim": args.head_dim,
        "--requests": args.requests,
        "--budget": args.budget,
        "--cadence": args.cadence,
        "--page-size": args.page_size,
    }
    for scorer in args.scorers:
        child = [sys.executable, os.path.abspath(__file__), "--scorer", scorer]
        child += [str(x) for flag, value in sizes.items() for x in (flag, value)]
        out = subprocess.run(child, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            sys.exit(f"{scorer}: the pass failed:\n{out.stderr[-2000:]}")
        growth = json.loads(out.stdout.strip().splitlines()[-1])["growth_bytes"]
        print(f"{scorer:>10} {growth / MiB:>14,.1f} {growth / layer_bytes:>11.2f}x", flush=True)


if __name__ == "__main__":
    main()
