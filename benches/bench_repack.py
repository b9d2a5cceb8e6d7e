"""Repack bandwidth, side by side in one run (GPU).

For each (row bytes, moved slots, layers) it times, on the same buffers:

    triton      sglang_evict_kernels.repack_kv_triton: the moves checked (one host read),
                then one launch over all layers' K and V
    launch      sglang_evict_kernels.repack_kv_independent: the launch alone, no host
                read (how the batched pass moves a plan made on the device)
    copy        one contiguous device-to-device copy of the same number of bytes
    per-layer   torch index_select + index_copy_ per buffer (how TriAttention compacts)

and prints bytes moved (read + written) per second and the ratios triton / copy,
launch / copy and triton / per-layer. ``scripts/repack_kernel_sass.py`` predicts the
launch's ratio from its sm_90 code without a GPU. Targets: >= 0.92 of copy at 2 KiB
rows, >= 0.75 at 128 B rows, >= 3x per-layer. Configurations whose buffers exceed
--max-gib are listed as skipped. ``--smoke`` runs one tiny configuration on CPU
(Triton's interpreter) to check the script itself; its figures mean nothing.

    python3 benches/bench_repack.py                # on the GPU machine
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROW_BYTES = (128, 1024, 2048, 4096)
MOVES = (1024, 16384, 262144)
LAYERS = (32, 80)


def timed(fn, device: str) -> float:
    """Median seconds of ``fn`` (CUDA events via triton.testing.do_bench on GPU)."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=50) / 1e3
    fn()  # CPU smoke: one warm call, one timed call
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_one(row_bytes: int, moves: int, layers: int, device: str) -> dict:
    from sglang_evict_kernels import repack_kv_independent, repack_kv_triton

    heads, dtype = 1, torch.bfloat16
    head_dim = row_bytes // 2
    slots = 2 * moves
    k = [torch.randn(slots, heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]
    v = [torch.randn(slots, heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]
    order = torch.randperm(slots, device=device)
    src, dst = order[:moves].contiguous(), order[moves:].contiguous()
    payload = moves * row_bytes * 2 * layers  # bytes copied: every moved row of K and V
    total_bytes = 2 * payload  # read + written
    flat_src = torch.empty(payload, dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat_src)

    def per_layer():
        for buf in (*k, *v):
            buf.index_copy_(0, dst, buf.index_select(0, src))

    seconds = {
        "triton": timed(lambda: repack_kv_triton(k, v, src, dst), device),
        "launch": timed(lambda: repack_kv_independent(k, v, src, dst), device),
        "copy": timed(lambda: flat_dst.copy_(flat_src), device),
        "per-layer": timed(per_layer, device),
    }
    return {name: total_bytes / s for name, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-gib", type=float, default=60.0, help="skip larger buffer sets")
    parser.add_argument("--smoke", action="store_true", help="one tiny CPU configuration")
    parser.add_argument(
        "--quick", action="store_true", help="the goals' rows only: 128 B and 2 KiB, 16,384 moves"
    )
    args = parser.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, grid = "cpu", [(128, 8, 2)]
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_repack needs a CUDA GPU (use --smoke to check the script on CPU)")
        device = "cuda"
        grid = [(r, m, layer) for layer in LAYERS for r in ROW_BYTES for m in MOVES]
        if args.quick:
            grid = [(r, 16384, layer) for layer in LAYERS for r in (128, 2048)]
        print(f"device: {torch.cuda.get_device_name()}")
    print(
        f"{'row B':>6}{'moves':>8}{'layers':>7}{'triton GB/s':>13}{'copy GB/s':>11}"
        f"{'launch GB/s':>13}{'per-layer GB/s':>16}{'tri/copy':>10}{'launch/copy':>13}"
        f"{'tri/layer':>11}",
        flush=True,
    )
    for row_bytes, moves, layers in grid:
        # K and V pools of 2 x moves slots per layer, plus the two flat copy buffers.
        need_gib = 8 * moves * row_bytes * layers / 2**30
        if need_gib > args.max_gib:
            print(
                f"{row_bytes:>6}{moves:>8}{layers:>7}  skipped: needs {need_gib:.0f} GiB",
                flush=True,
            )
            continue
        rates = bench_one(row_bytes, moves, layers, device)
        print(
            f"{row_bytes:>6}{moves:>8}{layers:>7}{rates['triton'] / 1e9:>13.1f}"
            f"{rates['copy'] / 1e9:>11.1f}{rates['launch'] / 1e9:>13.1f}"
            f"{rates['per-layer'] / 1e9:>16.1f}{rates['triton'] / rates['copy']:>10.2f}"
            f"{rates['launch'] / rates['copy']:>13.2f}"
            f"{rates['triton'] / rates['per-layer']:>11.2f}",
            flush=True,
        )
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
