"""Per-pass overhead of the compactor sidecar vs the in-process compactor, side by side.

Both apply the same batch of plans (planner output for ``--requests`` requests with
scattered eviction) to the same pool: in-process over the pool's own buffers, the
sidecar (``python -m compactor_service`` on a Unix socket, started here) over the same
memory mapped through shared memory (CPU) or CUDA IPC (GPU). Calls alternate, so both
see the same machine state. A plan is idempotent (sources are never written), so one
batch can be applied over and over.

Prints p50/p99 per pass for each and the sidecar's added time (target on the GPU:
<= 1 ms p50, <= 3 ms p99 added).

With ``--tier-bits``, a demotion pass: each request's evicted tokens (whole groups of
``--tier-group``) are quantized into a tier arena before the moves, in-process (one
call, the tier's quantizer over the pool's buffers) and over the sidecar (its two calls,
demotions then moves, into the arena shared with it; CPU only). Target on CPU: the
sidecar at most 1.5x the in-process pass.

    python3 benches/bench_compactor.py                 # CPU, or the GPU when present
    python3 benches/bench_compactor.py --smoke         # a few passes, to check the script
    python3 benches/bench_compactor.py --tier-bits 3 --passes 20   # demotion passes
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

from compactor_service.client import GrpcCompactor  # noqa: E402
from compactor_service.compactor import InProcessCompactor  # noqa: E402
from compactor_service.cuda_ipc import export_cuda_buffers  # noqa: E402
from compactor_service.health import check_health, socket_target  # noqa: E402
from compactor_service.runtime_dir import default_pool_dir  # noqa: E402
from compactor_service.shared_arena import create_shared_arena  # noqa: E402
from compactor_service.shared_pool import create_shared_buffers  # noqa: E402
from sglang_evict.passes.planner import plan_compaction  # noqa: E402
from sglang_evict_kernels.tier_format import TierFormat  # noqa: E402


def make_plans(num_requests: int, tokens: int, keep: float, page_size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    pages_per_request = -(-tokens // page_size)
    plans, evicted = [], []
    for r in range(num_requests):
        first = 1 + r * pages_per_request  # page 0 is SGLang's padding page
        row = torch.arange(first * page_size, first * page_size + tokens, dtype=torch.int64)
        count = max(1, int(tokens * keep))
        survivors = torch.sort(torch.randperm(tokens, generator=generator)[:count]).values
        plans.append(
            plan_compaction(row, survivors, page_size=page_size, positions=torch.arange(tokens))
        )
        evicted.append(row[~torch.isin(torch.arange(tokens), survivors)])
    return plans, 1 + num_requests * pages_per_request, evicted


def with_demotions(plans, evicted: list, group_tokens: int):
    """Each plan demoting its evicted tokens (``evicted[i]``: whole groups, the rest
    evicted) into arena slots of its own; returns the plans and the arena's groups."""
    out, next_slot = [], 0
    for plan, slots in zip(plans, evicted, strict=True):
        groups = slots.numel() // group_tokens
        targets = torch.arange(next_slot, next_slot + groups, dtype=torch.int64)
        next_slot += groups
        out.append(
            dataclasses.replace(
                plan,
                demote_slots=slots[: groups * group_tokens].clone(),
                demote_targets=targets,
                arena_claimed=targets.clone(),
            )
        )
    return out, next_slot


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048, help="KV tokens per request")
    parser.add_argument("--keep", type=float, default=0.5, help="fraction of tokens kept")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--passes", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 5 passes")
    parser.add_argument(
        "--tier-bits",
        type=int,
        choices=(2, 3, 4, 8),
        default=None,
        help="demotion passes: evicted tokens quantized into a tier arena first (CPU)",
    )
    parser.add_argument("--tier-group", type=int, default=32, help="tokens per tier group")
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.tokens, args.layers, args.kv_heads, args.head_dim = 2, 64, 2, 2, 16
        args.passes = 5
    plans, num_pages, evicted = make_plans(args.requests, args.tokens, args.keep, args.page_size, 0)
    num_slots = (num_pages + 1) * args.page_size
    fmt = arena = None
    if args.tier_bits is not None:
        if args.device != "cpu":
            raise SystemExit("--tier-bits: the sidecar demotes into a CPU arena only so far")
        if args.smoke:
            args.head_dim, args.tier_group = 64, 16
        fmt = TierFormat(bits=args.tier_bits, group_tokens=args.tier_group, head_dim=args.head_dim)
        plans, num_groups = with_demotions(plans, evicted, args.tier_group)
    shape = (num_slots, args.kv_heads, args.head_dim)
    shared = None
    # Private (0700), and in memory where serving puts pools (default_pool_dir: a disk
    # file's mapping pays a write fault a page after each writeback).
    shm = default_pool_dir().parent
    pool_dir = tempfile.mkdtemp(prefix="bench-pools-", dir=shm if shm.is_dir() else None)
    if args.device == "cpu":
        shared = create_shared_buffers(
            num_layers=args.layers,
            num_slots=num_slots,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            dtype=torch.bfloat16,
            page_size=args.page_size,
            directory=pool_dir,
        )
        k, v, layout = shared.k, shared.v, shared.layout
        if fmt is not None:
            arena = create_shared_arena(
                fmt,
                num_groups=num_groups,
                num_layers=args.layers,
                kv_heads=args.kv_heads,
                full_dtype=torch.bfloat16,
                directory=pool_dir,
            )
    else:
        k = [
            torch.randn(shape, device=args.device, dtype=torch.bfloat16) for _ in range(args.layers)
        ]
        v = [
            torch.randn(shape, device=args.device, dtype=torch.bfloat16) for _ in range(args.layers)
        ]
        layout = export_cuda_buffers(k, v, args.page_size)
    moves = sum(p.num_moves for p in plans)
    device_name = torch.cuda.get_device_name() if args.device != "cpu" else "CPU"
    print(
        f"device {args.device} ({device_name}); "
        f"{args.requests} requests x {args.tokens} tokens, keep {args.keep:.0%}, page "
        f"{args.page_size}; {args.layers} layers x {args.kv_heads} KV heads x {args.head_dim}; "
        f"{moves} slot moves per pass"
        + (
            f"; {sum(p.num_demoted_groups for p in plans)} groups of {fmt.group_tokens} "
            f"demoted at {fmt.bits} bits first"
            if fmt is not None
            else ""
        )
    )
    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "compactor.sock"
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "compactor_service",
                "--socket",
                str(sock),
                "--pool-dir",
                pool_dir,
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
        )
        try:
            deadline = time.monotonic() + 120
            while not (sock.exists() and check_health(socket_target(str(sock)), 0.5)):
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the compactor did not start")
                time.sleep(0.1)
            sidecar = GrpcCompactor(
                socket_target(str(sock)),
                layout,
                timeout_s=120,
                arena=None if arena is None else arena.layout,
            )
            sidecar.register()
            local = InProcessCompactor(k, v, page_size=args.page_size)
            if arena is not None:
                local.attach_arena(arena.stores, fmt)
            sync = torch.cuda.synchronize if args.device != "cpu" else (lambda: None)
            times = {"in-process": [], "sidecar": []}
            for i in range(args.passes + 3):
                for name, compactor in (("in-process", local), ("sidecar", sidecar)):
                    sync()
                    start = time.perf_counter()
                    compactor.compact(plans)
                    sync()
                    if i >= 3:  # warm-up
                        times[name].append((time.perf_counter() - start) * 1e3)
            sidecar.close()
        finally:
            server.terminate()
            server.wait(30)
            if shared is not None:
                shared.close()
            if arena is not None:
                arena.close()
            Path(pool_dir).rmdir()
    print(f"{'compactor':<12} {'p50 ms':>9} {'p99 ms':>9}")
    for name, values in times.items():
        print(f"{name:<12} {percentile(values, 0.5):>9.3f} {percentile(values, 0.99):>9.3f}")
    added = [s - i for s, i in zip(times["sidecar"], times["in-process"], strict=True)]
    print(
        f"{'added':<12} {percentile(added, 0.5):>9.3f} {percentile(added, 0.99):>9.3f}"
        f"   (sidecar - in-process, per pass; ratio of medians "
        f"{statistics.median(times['sidecar']) / statistics.median(times['in-process']):.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
