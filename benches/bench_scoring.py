"""Scoring cost per pass relative to one decode step's attention, same KV length (GPU).

For one request of N cached tokens (the KV a pass scores: budget + cadence) and a
Llama-8B-like shape (32 layers, 32 query heads, 8 KV heads, head_dim 128, bf16), times
in one run: the pool-reading scoring kernels (knorm; triattention with 17 offsets;
window logits for 32 queries plus the torch softmax), and one decode step's attention
over the same N keys in every layer (torch SDPA, GQA). Prints each as a multiple of
the decode attention: a pass runs once per cadence (128 tokens), so a ratio of r costs
r / 128 of the attention time amortised per decode step.

    python3 benches/bench_scoring.py            # on the GPU machine
    python3 benches/bench_scoring.py --smoke    # tiny, CPU, Triton interpreter: checks the script
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def timed(fn, device: str) -> float:
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=50) / 1e3
    fn()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(tokens: int, shape: tuple, dtype: torch.dtype, device: str) -> tuple[float, list]:
    """Decode-attention seconds and each scorer's time as a multiple of it."""
    from sglang_evict_kernels.scoring import (
        key_norms_triton,
        key_pair_scores_triton,
        query_key_logits_triton,
    )

    layers, q_heads, kv_heads, head_dim, window = shape
    pairs = head_dim // 2
    slots_total = 2 * tokens
    k = [
        torch.randn(slots_total, kv_heads, head_dim, dtype=dtype, device=device)
        for _ in range(layers)
    ]
    v = [torch.randn_like(b) for b in k]
    slots = torch.randperm(slots_total, device=device)[:tokens]
    weights = torch.randn(layers, q_heads, 17, pairs, device=device)
    abs_weight = torch.rand(layers, q_heads, pairs, device=device)
    queries = torch.randn(layers, window, q_heads, head_dim, device=device)
    positions = torch.arange(tokens, device=device)
    query_positions = positions[-window:]

    def decode_attention():
        q = torch.randn(1, q_heads, 1, head_dim, dtype=dtype, device=device)
        for kb, vb in zip(k, v, strict=True):
            keys = kb[slots].transpose(0, 1).unsqueeze(0)
            values = vb[slots].transpose(0, 1).unsqueeze(0)
            torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=True)

    def window_scores():
        logits = query_key_logits_triton(k, slots, queries)
        visible = positions[None, :] <= query_positions[:, None]
        logits.masked_fill_(~visible[None, None], float("-inf"))
        torch.softmax(logits, dim=-1).sum(dim=2)

    attention_s = timed(decode_attention, device)
    return attention_s, [
        timed(lambda: key_norms_triton(k, slots), device) / attention_s,
        timed(
            lambda: key_pair_scores_triton(k, slots, weights, weights, abs_weight, "half"), device
        )
        / attention_s,
        timed(window_scores, device) / attention_s,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, dtype = "cpu", torch.float32
        layers, q_heads, kv_heads, head_dim, sizes, window = 2, 4, 2, 16, [64], 4
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_scoring needs a CUDA GPU (use --smoke to check the script on CPU)")
        device, dtype = "cuda", torch.bfloat16
        layers, q_heads, kv_heads, head_dim, sizes, window = 32, 32, 8, 128, [1024, 4096, 16384], 32
        print(f"device: {torch.cuda.get_device_name()}")
    print(
        f"{'tokens':>7}{'decode attn ms':>16}{'knorm x':>9}{'triattention x':>16}{'window x':>10}"
    )
    shape = (layers, q_heads, kv_heads, head_dim, window)
    for tokens in sizes:
        attention_s, ratios = measure(tokens, shape, dtype, device)
        print(
            f"{tokens:>7}{attention_s * 1e3:>16.3f}{ratios[0]:>9.2f}{ratios[1]:>16.2f}"
            f"{ratios[2]:>10.2f}"
        )


if __name__ == "__main__":
    main()
