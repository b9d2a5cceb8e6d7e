"""The tier's compiled CPU kernels beside what they replace, side by side in one run.

``--part attention``: the decode attention SGLang's CPU engine runs over the tier
(``tier_attention_cpu``), the tensor form it falls back to (``tier_attention_torch``),
and, for scale, float32 SDPA over the same tokens held in full precision (what plain
SGLang's ``torch_native`` backend computes for them): median milliseconds per layer,
kernel / SDPA and tensor form / kernel.

``--part merge``: a decode layer's whole tier work in the engine, the backend's output
merged with the tier's attention. ``fused`` is ``tier_decode_merge_cpu`` (one call);
``split`` is the same done in tensor operations around the attention kernel (the full
side's log-sum-exp gathered from the pool, ``merge_attention_states``), the engine's
path before the fused call; ``tensor`` is all of it in tensor operations (the fallback).

``--part quantize``: a pass's quantize-and-pack of one layer, ``quantize_into_cpu``
against ``quantize_into_reference`` (the same bytes), bfloat16 KV.

Shapes: SmolLM2-135M's layer (3 KV heads, 9 query heads, head dim 64; 13 requests x 768
tier tokens is the memory-bound bench's steady state) and a Llama-8B layer (8, 32, 128).
Groups of 32 tokens, no outlier tokens in the attention (the recommended
configuration), 3 in the quantize part (its harder case). The kernels are built on
first use (about half a minute). ``--smoke`` runs one small configuration per part.

    python3 benches/bench_tier_cpu.py [--part merge] [--shape smollm2] [--threads 1 2]
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
PARTS = ("attention", "merge", "quantize")


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


MERGE_GRID = [(3, 13, 768, 256), (3, 4, 256, 64)]  # bits, requests, tier, full tokens
QUANT_GRID = [1, 4, 16]  # groups a pass quantizes per layer


def bench_merge(bits: int, requests: int, tokens: int, full: int, shape: dict, repeats: int):
    from sglang_evict_kernels.tier_attention import (
        full_precision_lse_reference,
        merge_attention_states,
        tier_attention_torch,
    )
    from sglang_evict_kernels.tier_cpu import tier_attention_cpu, tier_decode_merge_cpu
    from sglang_evict_kernels.tier_format import TierFormat, quantize_groups_reference

    kv_heads, q_heads, head_dim = shape["kv_heads"], shape["q_heads"], shape["head_dim"]
    fmt = TierFormat(bits=bits, group_tokens=32, head_dim=head_dim)
    groups = tokens // fmt.group_tokens
    gen = torch.Generator().manual_seed(bits * 1000 + requests)
    shape_kv = (requests * groups, fmt.group_tokens, kv_heads, head_dim)
    store = quantize_groups_reference(
        torch.randn(shape_kv, generator=gen), torch.randn(shape_kv, generator=gen), fmt
    )
    table = torch.randperm(requests * groups, generator=gen).reshape(requests, groups)
    counts = torch.full((requests,), groups)
    q = torch.randn(requests, q_heads, head_dim, generator=gen)
    # the pool: each request's ``full`` tokens at scattered slots, bfloat16 as served
    pool = requests * full * 2
    k_buffer = torch.randn(pool, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    req_to_token = torch.randperm(pool, generator=gen)[: requests * full].view(requests, full)
    req_to_token = req_to_token.int()
    rows, lens = torch.arange(requests), torch.full((requests,), full)
    o_full = torch.randn(requests, q_heads * head_dim, generator=gen).to(torch.bfloat16)
    scale = 1.0 / head_dim**0.5

    def split(attention):
        o_tier, lse_tier = attention(q, store, table, counts, fmt, sm_scale=scale)
        lse_full = full_precision_lse_reference(q, k_buffer, req_to_token, rows, lens, scale)
        merged, _ = merge_attention_states(
            o_full.reshape(requests, q_heads, head_dim).float(), lse_full, o_tier, lse_tier
        )
        return merged.to(o_full.dtype).reshape(o_full.shape)

    args = (q, o_full, k_buffer, req_to_token, rows, lens, store, table, counts, fmt)
    return {
        "fused": median_ms(lambda: tier_decode_merge_cpu(*args, sm_scale=scale), repeats),
        "split": median_ms(lambda: split(tier_attention_cpu), repeats),
        "tensor": median_ms(lambda: split(tier_attention_torch), max(repeats // 4, 1)),
    }


def bench_quantize(groups: int, shape: dict, repeats: int) -> dict:
    from sglang_evict_kernels.tier_cpu import quantize_into_cpu
    from sglang_evict_kernels.tier_format import TierFormat, TierStore
    from sglang_evict_kernels.tier_quant import quantize_into_reference

    kv_heads, head_dim = shape["kv_heads"], shape["head_dim"]
    fmt = TierFormat(bits=3, group_tokens=32, head_dim=head_dim, outlier_tokens=3)
    gen = torch.Generator().manual_seed(groups)
    pool = 4096
    k = torch.randn(pool, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(pool, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    token_slots = torch.randperm(pool, generator=gen)[: groups * 32].view(groups, 32)
    group_slots = torch.arange(groups)
    store = TierStore.empty(fmt, groups, kv_heads, torch.bfloat16)
    args = (store, group_slots, k, v, token_slots, fmt)
    return {
        "kernel": median_ms(lambda: quantize_into_cpu(*args), repeats),
        "reference": median_ms(lambda: quantize_into_reference(*args), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--part", choices=PARTS, nargs="+", default=list(PARTS), help="which tables to print"
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=sorted(SHAPES))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="one small configuration a part")
    args = parser.parse_args()
    if any(t < 1 for t in args.threads) or args.repeats < 1:
        parser.error("--threads and --repeats take positive integers")
    from sglang_evict_kernels.tier_cpu import cpu_kernel_status

    loaded, why = cpu_kernel_status()
    if not loaded:
        sys.exit(f"bench_tier_cpu: the tier's CPU kernel is not available: {why}")
    grid, merge_grid, quant_grid = GRID, MERGE_GRID, QUANT_GRID
    shapes, threads = args.shape, args.threads
    if args.smoke:
        grid, merge_grid, quant_grid = [(3, 2, 64)], [(3, 2, 64, 16)], [1]
        shapes, threads, args.repeats = ["smollm2"], [1], 2
    configs = [(name, count) for name in shapes for count in threads]
    if "attention" in args.part:
        print(
            f"{'shape':>8}{'bits':>5}{'reqs':>6}{'tokens':>8}{'threads':>8}{'kernel ms':>11}"
            f"{'tensor ms':>11}{'SDPA ms':>9}{'kernel/SDPA':>13}{'tensor/kernel':>15}"
        )
        for name, count in configs:
            for bits, requests, tokens in grid:
                torch.set_num_threads(count)
                r = bench_one(bits, requests, tokens, SHAPES[name], args.repeats)
                print(
                    f"{name:>8}{bits:>5}{requests:>6}{tokens:>8}{count:>8}"
                    f"{r['kernel']:>11.2f}{r['tensor']:>11.2f}{r['sdpa']:>9.2f}"
                    f"{r['kernel'] / r['sdpa']:>13.2f}{r['tensor'] / r['kernel']:>15.2f}",
                    flush=True,
                )
    if "merge" in args.part:
        print(
            f"{'shape':>8}{'bits':>5}{'reqs':>6}{'tier':>6}{'full':>6}{'threads':>8}"
            f"{'fused ms':>10}{'split ms':>10}{'tensor ms':>11}{'split/fused':>13}"
            f"{'tensor/fused':>14}"
        )
        for name, count in configs:
            for bits, requests, tokens, full in merge_grid:
                torch.set_num_threads(count)
                r = bench_merge(bits, requests, tokens, full, SHAPES[name], args.repeats)
                print(
                    f"{name:>8}{bits:>5}{requests:>6}{tokens:>6}{full:>6}{count:>8}"
                    f"{r['fused']:>10.3f}{r['split']:>10.3f}{r['tensor']:>11.3f}"
                    f"{r['split'] / r['fused']:>13.2f}{r['tensor'] / r['fused']:>14.2f}",
                    flush=True,
                )
    if "quantize" in args.part:
        print(
            f"{'shape':>8}{'groups':>8}{'threads':>8}{'kernel ms':>11}{'reference ms':>14}"
            f"{'reference/kernel':>18}"
        )
        for name, count in configs:
            for groups in quant_grid:
                torch.set_num_threads(count)
                r = bench_quantize(groups, SHAPES[name], args.repeats)
                print(
                    f"{name:>8}{groups:>8}{count:>8}{r['kernel']:>11.3f}"
                    f"{r['reference']:>14.3f}{r['reference'] / r['kernel']:>18.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
