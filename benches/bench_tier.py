"""The quantized tier's kernels, side by side with a device-to-device copy in one run
(GPU): quantize-and-pack (``tier_quant``) and decode attention over the tier
(``tier_attention``).

For each (bits, requests, groups per request) it times, on the same tensors:

    quantize    quantize_into_triton: a pass's worth of groups from the KV buffers into
                the tier (reads the full-precision rows, writes codes and scales)
    attention   tier_attention_triton: one decode query per request and query head over
                its tier groups (reads the packed bytes, scales and outlier rows), with
                its defaults, then with each of VARIANTS' launch settings and bodies
    copy        one contiguous device-to-device copy of the bytes the kernel reads

and prints each kernel's bytes read per second as a ratio to the copy's (the variants'
columns are ratios too), and on a GPU each attention body's registers per thread, spilled
registers and shared memory as Triton compiled them. The goal (issue): attention >= 0.70
of the copy on its packed bytes. ``scripts/tier_kernel_sass.py`` reads the same bodies'
machine code without a GPU. ``--smoke`` runs one tiny configuration on CPU (Triton's
interpreter) to check the script; its figures mean nothing. Shapes (``--shape``): a
Llama-8B layer (8 KV heads, 32 query heads, head dim 128) or SmolLM2-135M's (3, 9, 64);
groups of 32 tokens, 3 outlier tokens.

    python3 benches/bench_tier.py [--shape smollm2]     # on the GPU machine
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_repack import timed

BITS = (2, 3, 4)
REQUESTS = (16, 64)
GROUPS = (32, 128)  # tier groups per request (1,024 and 4,096 tokens)
SHAPES = {
    "llama8b": {"kv_heads": 8, "q_heads": 32, "head_dim": 128},
    "smollm2": {"kv_heads": 3, "q_heads": 9, "head_dim": 64},
}
# The attention kernel's launch settings besides its defaults (the `grouped` body,
# splits from the GPU's size, NUM_WARPS): one split; 4 warps; replayed from a CUDA graph
# (no host work); then the `words` body (tier_attention.KERNELS) with its defaults
# (half-precision products, one pipelining stage), with tf32 products, with 4 warps,
# with 16 splits (8x the programs: does occupancy bind?) and with Triton's 3 stages
# (does the prefetch pay for its spills?).
VARIANTS = {
    "1 split": {"splits": 1},
    "4 warps": {"num_warps": 4},
    "graph": {"graph": True},
    "words": {"kernel": "words"},
    "words tf32": {"kernel": "words", "precision": "tf32"},
    "words w4": {"kernel": "words", "num_warps": 4},
    "words s16": {"kernel": "words", "splits": 16},
    "words st3": {"kernel": "words", "num_stages": 3},
}
# Bodies whose compiled resources (registers, spills, shared memory) are printed.
RESOURCES = {"grouped": {}, "words": {"kernel": "words"}}


def timed_variant(fn, device: str, graph: bool) -> float:
    """``timed``; with ``graph`` (CUDA) the call replayed from a CUDA graph, so the
    host's launch work is not in the time."""
    try:
        fn()
    except Exception as exc:  # a variant the GPU cannot hold (shared memory): no figure
        print(f"  variant failed: {type(exc).__name__}: {str(exc)[:80]}")
        return float("inf")
    if not graph or device != "cuda":
        return timed(fn, device)
    fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return timed(g.replay, device)


def bench_one(bits: int, requests: int, groups: int, device: str, shape: dict) -> dict:
    from sglang_evict_kernels.tier_attention import tier_attention_triton
    from sglang_evict_kernels.tier_format import TierFormat, TierStore
    from sglang_evict_kernels.tier_quant import quantize_into_triton

    kv_heads, q_heads, head_dim = shape["kv_heads"], shape["q_heads"], shape["head_dim"]
    fmt = TierFormat(bits=bits, group_tokens=32, head_dim=head_dim, outlier_tokens=3)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    slots = requests * groups
    store = TierStore.empty(fmt, slots, kv_heads, dtype, device)
    tokens = slots * fmt.group_tokens
    k_buf = torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device=device)
    v_buf = torch.randn_like(k_buf)
    token_slots = torch.randperm(tokens, device=device).reshape(slots, fmt.group_tokens)
    group_slots = torch.arange(slots, device=device)
    quantize_into_triton(store, group_slots, k_buf, v_buf, token_slots, fmt)
    table = group_slots.reshape(requests, groups).to(torch.int32)
    counts = torch.full((requests,), groups, dtype=torch.int32, device=device)
    q = torch.randn(requests, q_heads, head_dim, dtype=dtype, device=device)

    # Bytes each kernel must read at least: the rows it quantizes; the store it attends.
    quantize_bytes = 2 * tokens * kv_heads * head_dim * k_buf.element_size()
    attention_bytes = store.nbytes() - store.out_index.numel() * 2  # indices are tiny
    flat = torch.empty(max(quantize_bytes, attention_bytes), dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat)
    seconds = {
        "quantize": timed(
            lambda: quantize_into_triton(store, group_slots, k_buf, v_buf, token_slots, fmt),
            device,
        ),
        "attention": timed(lambda: tier_attention_triton(q, store, table, counts, fmt), device),
        **{
            f"variant {name}": timed_variant(
                lambda kw=kw: tier_attention_triton(
                    q, store, table, counts, fmt, **{k: v for k, v in kw.items() if k != "graph"}
                ),
                device,
                graph=kw.get("graph", False),
            )
            for name, kw in VARIANTS.items()
        },
        "copy_quantize": timed(
            lambda: flat_dst[:quantize_bytes].copy_(flat[:quantize_bytes]), device
        ),
        "copy_attention": timed(
            lambda: flat_dst[:attention_bytes].copy_(flat[:attention_bytes]), device
        ),
    }
    resources = {}
    for name, kw in RESOURCES.items():
        stats: dict = {}
        tier_attention_triton(q, store, table, counts, fmt, stats=stats, **kw)
        resources[name] = stats
    return {
        "resources": resources,
        "quantize": quantize_bytes / seconds["quantize"],
        "attention": attention_bytes / seconds["attention"],
        "copy_quantize": quantize_bytes / seconds["copy_quantize"],
        "copy_attention": attention_bytes / seconds["copy_attention"],
        "attention_mib": attention_bytes / 2**20,
        **{
            name: attention_bytes / seconds[name] / (attention_bytes / seconds["copy_attention"])
            for name in seconds
            if name.startswith("variant ")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one tiny CPU configuration")
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="llama8b",
        help="a layer's KV heads, query heads and head dim",
    )
    args = parser.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, grid = "cpu", [(3, 2, 2)]
        shape = {"kv_heads": 2, "q_heads": 4, "head_dim": 64}
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_tier needs a CUDA GPU (use --smoke to check the script on CPU)")
        device = "cuda"
        grid = [(b, r, g) for b in BITS for r in REQUESTS for g in GROUPS]
        shape = SHAPES[args.shape]
        print(f"device: {torch.cuda.get_device_name()}, shape {args.shape}: {shape}")
    print(
        f"{'bits':>5}{'reqs':>6}{'groups':>8}{'tier MiB':>10}{'quant GB/s':>12}"
        f"{'attn GB/s':>11}{'copy GB/s':>11}{'quant/copy':>12}{'attn/copy':>11}"
        + "".join(f"{name:>10}" for name in VARIANTS)
    )
    for bits, requests, groups in grid:
        r = bench_one(bits, requests, groups, device, shape)
        print(
            f"{bits:>5}{requests:>6}{groups:>8}{r['attention_mib']:>10.1f}"
            f"{r['quantize'] / 1e9:>12.2f}{r['attention'] / 1e9:>11.2f}"
            f"{r['copy_attention'] / 1e9:>11.2f}"
            f"{r['quantize'] / r['copy_quantize']:>12.2f}"
            f"{r['attention'] / r['copy_attention']:>11.2f}"
            + "".join(f"{r['variant ' + name]:>10.2f}" for name in VARIANTS)
        )
        if any(r["resources"].values()):  # Triton reports them on a GPU, not the interpreter
            print(
                "      "
                + "; ".join(
                    f"{name}: " + ", ".join(f"{k} {v}" for k, v in stats.items())
                    for name, stats in r["resources"].items()
                )
            )
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
