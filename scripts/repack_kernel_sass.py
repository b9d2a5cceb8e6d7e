"""The repack kernel compiled for an NVIDIA GPU on a machine without one: its SASS
instructions per moved byte, registers, spills and loads in flight, and the fraction of
a device-to-device copy they predict.

A repack program moves ``MOVES`` rows of one buffer: it loads them as one tile, then
stores it, in straight-line code (no loop for rows up to ``CHUNK_BYTES``). Two static
bounds follow from the compiled code:

    issue     warp-instructions per moved byte ``r``: by the rule the tier's attention
              kernel followed on the H200 of 2026-11-27/28, a kernel reads at most about
              ``0.2 / r`` of the copy (docs/performance.md). That rule was fitted on an
              issue-bound kernel, not on a copy, so for a copy it is a floor of what
              issue allows, not a measurement.
    in flight bytes of loads a streaming multiprocessor has outstanding (resident
              programs x the bytes each loads before its first store) against what the
              copy keeps in flight (about 8 copied bytes per clock per SM, over an
              assumed 1,000-clock loaded memory latency: 8 KiB).

The prediction is the smaller of the two, capped at 1. Neither bound sees DRAM page
locality of scattered rows or the launcher's host work; only a GPU measures those
(``benches/bench_repack.py``).

    python3 scripts/repack_kernel_sass.py [--arch 90] [--rows 128 512 2048] [--json]

Needs Triton with its NVIDIA backend (the project's pinned torch has it); no GPU.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

ROWS = (128, 256, 512, 1024, 2048, 4096)
# sm_90 (H100/H200): what bounds resident programs per SM
SM_WARPS = 64
SM_PROGRAMS = 32
SM_REGISTERS = 65536
REGISTER_UNIT = 256  # registers are allocated per warp in units of 256
SM_SHARED_BYTES = 228 * 1024
# The copy's pace per SM (H200 bench, 2026-11-27) and an assumed loaded latency
COPY_BYTES_PER_CLOCK = 8
LATENCY_CLOCKS = 1000
ISSUE_RULE = 0.2  # fraction of the copy ~ ISSUE_RULE / (warp-instructions per byte)


def _tier_sass():
    """The attention script's compiler tools (ptxas, cuobjdump), loaded by path."""
    path = Path(__file__).resolve().parent / "tier_kernel_sass.py"
    spec = importlib.util.spec_from_file_location("tier_kernel_sass", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sass = _tier_sass()
ptxas_available = sass.ptxas_available


def compile_repack(row_bytes: int, *, arch: int, skip_self: bool = True):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_evict_kernels import repack

    shape = repack.launch_shape(row_bytes, 8)
    signature = {
        "anchor_ptr": "*i64",
        "read_table_ptr": "*i64",
        "write_table_ptr": "*i64",
        "src_ptr": "*i64",
        "dst_ptr": "*i64",
        "num_moves": "i32",
    }
    constants = {**shape, "SKIP_SELF": skip_self}
    for name in constants:
        signature[name] = "constexpr"
    names = list(signature)
    source = ASTSource(
        fn=repack._kernel(),
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constants.items()},
        # what a launch specialises on: torch allocations are 16-byte aligned
        attrs={(i,): [["tt.divisibility", 16]] for i, k in enumerate(names) if k.endswith("_ptr")},
    )
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": repack.NUM_WARPS},
    )
    return compiled, shape


def program_code(compiled) -> list[str]:
    """Every SASS instruction of the kernel but the trailing self-branch and padding."""
    ops = []
    for line in sass.cubin_text(compiled, "-sass").splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            ops.append(m[2])
    while ops and (ops[-1].startswith("NOP") or ops[-1].startswith("BRA")):
        ops.pop()
    return ops


def resident_programs(registers: int, shared_bytes: int, warps: int) -> int:
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_registers = SM_REGISTERS // (per_warp * warps)
    by_shared = SM_SHARED_BYTES // shared_bytes if shared_bytes else SM_PROGRAMS
    return max(0, min(SM_PROGRAMS, SM_WARPS // warps, by_registers, by_shared))


def row_for(row_bytes: int, arch: int) -> dict:
    from sglang_evict_kernels import repack

    compiled, shape = compile_repack(row_bytes, arch=arch)
    code = program_code(compiled)
    used = sass.resources(compiled)
    warps = repack.NUM_WARPS
    moved = shape["MOVES"] * row_bytes
    per_byte = len(code) * warps / moved
    issued = collections.Counter(sass.opcode(op) for op in code)
    vector = sum(n for op, n in collections.Counter(code).items() if ".128" in op)
    programs = resident_programs(used["registers"], used["shared_bytes"], warps)
    loaded = min(moved, repack.CHUNK_BYTES * shape["MOVES"])
    in_flight = programs * loaded
    need = COPY_BYTES_PER_CLOCK * LATENCY_CLOCKS
    issue_bound = ISSUE_RULE / per_byte
    flight_bound = in_flight / need
    return {
        "row_bytes": row_bytes,
        **shape,
        "warps": warps,
        **used,
        "instructions": len(code),
        "vector_accesses": vector,
        "per_byte": per_byte,
        "resident_programs": programs,
        "in_flight_bytes": in_flight,
        "issue_bound": issue_bound,
        "flight_bound": flight_bound,
        "predicted": min(1.0, issue_bound, flight_bound),
        "issued": dict(issued.most_common()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="row bytes")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if not ptxas_available():
        sys.exit("this needs Triton with its NVIDIA backend (ptxas); install the project's torch")
    bad = [r for r in args.rows if r <= 0 or r % 8]
    if bad:
        sys.exit(f"--rows: row bytes must be positive multiples of 8 (got {bad})")
    if not args.json:
        print(
            f"{'row B':>6}{'moves':>6}{'regs':>6}{'stack':>6}{'instr':>7}{'128-bit':>8}"
            f"{'per byte':>10}{'programs/SM':>12}{'in flight':>10}{'issue':>7}{'flight':>7}"
            f"{'predicted':>10}  (a static prediction, not a measurement)"
        )
    for rows in args.rows:
        row = row_for(rows, args.arch)
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        print(
            f"{row['row_bytes']:>6}{row['MOVES']:>6}{row['registers']:>6}{row['stack_bytes']:>6}"
            f"{row['instructions']:>7}{row['vector_accesses']:>8}{row['per_byte']:>10.4f}"
            f"{row['resident_programs']:>12}{row['in_flight_bytes'] // 1024:>8}Ki"
            f"{min(row['issue_bound'], 99):>7.1f}{min(row['flight_bound'], 99):>7.1f}"
            f"{row['predicted']:>10.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
