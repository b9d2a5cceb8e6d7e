"""The tier's decode attention on CPU, side by side in one run: the compiled kernel that
SGLang's CPU engine runs (``tier_attention_cpu``), the tensor form it falls back to
(``tier_attention_torch``), and, for scale, float32 SDPA over the same tokens held in
full precision (what plain SGLang's ``torch_native`` backend computes for them).

For each (shape, bits, requests, tier tokens per request, threads) it prints each one's
median milliseconds per layer and the ratios kernel / SDPA and tensor form / kernel.
Shapes: SmolLM2-135M's layer (3 KV heads, 9 query heads, head dim 64; 13 requests x 768
tier tokens is the memory-bound bench's steady state) and a Llama-8B layer (8, 32, 128).
Groups of 32 tokens, no outlier tokens (the recommended configuration). The kernel is
built on first use (about half a minute). ``--smoke`` runs one small configuration.

    python3 benches/bench_tier_cpu.py [--shape smollm2] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

SHAPES = {
    "smollm2": {"kv_heads": 3, "q_heads": 9, "head_dim": 64},
    "llama8b": {"kv_heads": 8, "q_heads": 32, "head_dim": 128},
}
GRID = [(3, 13, 768), (3, 4, 256), (2, 13, 768), (4, 13, 768)]  # bits, requests, tokens


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench_one(bits: int, requests: int, tokens: int, shape: dict, repeats: int) -> dict:
    from sglang_evict_kernels.tier_attention import tier_attention_torch
    from sglang_evict_kernels.tier_cpu import tier_attention_cpu
    from sglang_evict_kernels.tier_format import TierFormat, quantize_groups_reference

    kv_heads, q_heads, head_dim = shape["kv_heads"], shape["q_heads"], shape["head_dim"]
    fmt = TierFormat(bits=bits, group_tokens=32, head_dim=head_dim)
    groups = tokens // fmt.group_tokens
    gen = torch.Generator().manual_seed(bits * 1000 + requests)
    shape_kv = (requests * groups, fmt.group_tokens, kv_heads, head_dim)
    k = torch.randn(shape_kv, generator=gen)
    v = torch.randn(shape_kv, generator=gen)
    store = quantize_groups_reference(k, v, fmt)
    table = torch.randperm(requests * groups, generator=gen).reshape(requests, groups)
    counts = torch.full((requests,), groups)
    q = torch.randn(requests, q_heads, head_dim, generator=gen)
    # the same tokens in full precision, [requests, kv heads, tokens, head dim]
    kf = k.reshape(requests, tokens, kv_heads, head_dim).transpose(1, 2).contiguous()
    vf = v.reshape(requests, tokens, kv_heads, head_dim).transpose(1, 2).contiguous()
    qf = q.reshape(requests, kv_heads, q_heads // kv_heads, head_dim)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return {
        "kernel": median_ms(lambda: tier_attention_cpu(q, store, table, counts, fmt), repeats),
        "tensor": median_ms(
            lambda: tier_attention_torch(q, store, table, counts, fmt), max(repeats // 4, 1)
        ),
        "sdpa": median_ms(lambda: sdpa(qf, kf, vf), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=sorted(SHAPES))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="one small configuration")
    args = parser.parse_args()
    if any(t < 1 for t in args.threads) or args.repeats < 1:
        parser.error("--threads and --repeats take positive integers")
    from sglang_evict_kernels.tier_cpu import cpu_kernel_status

    loaded, why = cpu_kernel_status()
    if not loaded:
        sys.exit(f"bench_tier_cpu: the tier's CPU kernel is not available: {why}")
    grid, shapes, threads = GRID, args.shape, args.threads
    if args.smoke:
        grid, shapes, threads, args.repeats = [(3, 2, 64)], ["smollm2"], [1], 2
    print(
        f"{'shape':>8}{'bits':>5}{'reqs':>6}{'tokens':>8}{'threads':>8}{'kernel ms':>11}"
        f"{'tensor ms':>11}{'SDPA ms':>9}{'kernel/SDPA':>13}{'tensor/kernel':>15}"
    )
    for name in shapes:
        for bits, requests, tokens in grid:
            for count in threads:
                torch.set_num_threads(count)
                r = bench_one(bits, requests, tokens, SHAPES[name], args.repeats)
                print(
                    f"{name:>8}{bits:>5}{requests:>6}{tokens:>8}{count:>8}"
                    f"{r['kernel']:>11.2f}{r['tensor']:>11.2f}{r['sdpa']:>9.2f}"
                    f"{r['kernel'] / r['sdpa']:>13.2f}{r['tensor'] / r['kernel']:>15.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
