"""The tier's attention kernel bodies compiled for an NVIDIA GPU on a machine without
one: registers, shared memory, spills and the SASS instructions of one group's step.

Triton compiles for a named architecture with the ``ptxas`` its wheel carries, so the
machine code a GPU would run can be read here, compiled as a launch compiles it (every
tensor 16-byte aligned, each body's ``tier_attention.NUM_STAGES``). What a step of the
group loop issues predicts what the kernel can read: one group of one KV head (32 tokens, keys and
values, scales) is ``group_bytes``; a warp issues ``loop`` instructions per group, a
program of ``w`` warps ``w x loop``, and an SM issues about 4 warp-instructions per
clock at best. The kernel is bound by issue, not by memory, while

    warp-instructions per group byte  >  (SM issue per clock) / (copy bytes per clock per SM)

which the ``per byte`` column prints (on the H200 of 2026-11-27: about 8 copied bytes
per clock per SM at the bench's sizes, so at ``r`` per byte a kernel issuing at the
SM's full rate reaches at most about ``0.5 / r`` of the copy). Measured, the kernel
read at about ``0.2 / r`` of the copy over 12 configurations (docs/performance.md, "The
tier's attention kernel read without a GPU"): it issues at 1-1.6 warp-instructions per
clock, not 4. This is a static count: loop-carried latency, memory stalls and occupancy
are not in it; only a GPU measures them (``benches/bench_tier.py``).

    python3 scripts/tier_kernel_sass.py [--arch 90] [--bits 3] [--shape llama8b] [--warps 2]
        [--lines words]     # that body's loop instructions by source line (a static profile)

Needs Triton with its NVIDIA backend (the project's pinned torch has it); no GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

SHAPES = {  # (query heads, KV heads, head dim)
    "llama8b": (32, 8, 128),
    "smollm2": (9, 3, 64),
}
GROUP_TOKENS = 32
VALUE_GROUP_CHANNELS = 32
OUTLIERS = 3
SCALE_BYTES = 2  # float16 scales
# (name, jit function attribute, extra constexprs, query heads padded to >= 16, the
# launcher's kernel name: its pipelining stages, tier_attention.NUM_STAGES)
BODIES = (
    ("grouped", "attention_kernel", {}, False, "grouped"),
    ("words", "attention_words_kernel", {"PRECISION": "fp16", "NP": 16}, True, "words"),
    ("words tf32", "attention_words_kernel", {"PRECISION": "tf32", "NP": 16}, True, "words"),
)


def compile_body(fn, *, bits, shape, warps, extra, pad16, arch, stages=3):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_evict_kernels.tier_attention import triton_pow2

    hq, h, d = shape
    signature = {
        "q": "*fp32",
        "group_table": "*i32",
        "num_groups": "*i32",
        "k_codes": "*u8",
        "k_scale": "*fp16",
        "k_zero": "*fp16",
        "v_codes": "*u8",
        "v_scale": "*fp16",
        "v_zero": "*fp16",
        "out_index": "*i16",
        "out_k": "*bf16",
        "out_v": "*bf16",
        "o": "*fp32",
        "lse": "*fp32",
        "sm_scale": "fp32",
        "W": "i32",
    }
    qb = triton_pow2(hq // h)
    constants = {
        "HQ": hq,
        "H": h,
        "D": d,
        "G": GROUP_TOKENS,
        "C": VALUE_GROUP_CHANNELS,
        "BITS": bits,
        "N_OUT": OUTLIERS,
        "QB": max(16, qb) if pad16 else qb,
        "S": 2,
        **extra,
    }
    pointers = {k for k, v in signature.items() if v.startswith("*")}
    for name in constants:
        signature[name] = "constexpr"
    names = list(signature)
    source = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constants.items()},
        # what a launch specialises on: tensors 16-byte aligned, as torch allocates them
        attrs={(i,): [["tt.divisibility", 16]] for i, k in enumerate(names) if k in pointers},
    )
    return triton.compile(
        source,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": warps, "num_stages": stages},
    )


def tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def ptxas_available() -> bool:
    """Triton installed with its NVIDIA backend's tools."""
    try:
        return os.path.exists(tool("ptxas"))
    except ImportError:
        return False


def cubin_text(compiled, *flags: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run(
            [tool("cuobjdump"), *flags, f.name], capture_output=True, text=True, check=True
        ).stdout


def resources(compiled) -> dict:
    text = cubin_text(compiled, "--dump-resource-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if not m:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {text[-300:]}")
    # cuobjdump counts static shared memory; the tl.dot tiles' is dynamic (metadata)
    return {
        "registers": int(m[1]),
        "stack_bytes": int(m[2]),
        "shared_bytes": max(int(m[3]), int(compiled.metadata.shared)),
    }


def group_loop(compiled) -> list[tuple[int, str]]:
    """The SASS instructions of the longest backward branch's span: the group loop."""
    code = []
    for line in cubin_text(compiled, "-sass").splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            code.append((int(m[1], 16), m[2]))
    spans = []
    for address, op in code:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", op)
        if target and int(target[1], 16) < address:
            spans.append((int(target[1], 16), address))
    if not spans:
        return []
    lo, hi = max(spans, key=lambda span: span[1] - span[0])
    return [(a, op) for a, op in code if lo <= a <= hi]


def loop_by_line(compiled) -> list[tuple[int, str, dict]]:
    """The group loop's instructions counted by the source line they came from (the
    line table Triton writes into the cubin), most first: ``(count, "file:line",
    {opcode: count})``."""
    loop = group_loop(compiled)
    if not loop:
        return []
    lo, hi = loop[0][0], loop[-1][0]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run(
            [tool("nvdisasm"), "--print-line-info", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    where = "?"
    by_line: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in text.splitlines():
        source = re.search(r'File "([^"]+)", line (\d+)', line)
        if source:
            where = f"{os.path.basename(source[1])}:{source[2]}"
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m and lo <= int(m[1], 16) <= hi:
            by_line[where][opcode(m[2])] += 1
    rows = [(sum(ops.values()), where, dict(ops.most_common(4))) for where, ops in by_line.items()]
    return sorted(rows, key=lambda row: -row[0])


def source_line(where: str) -> str:
    name, _, number = where.partition(":")
    if name == "standard.py":  # Triton's library, inlined without its caller's line
        return "(Triton's tl.sum / tl.max, inlined)"
    path = os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "kernels", "sglang_evict_kernels", name
    )
    try:
        return open(path).read().splitlines()[int(number) - 1].strip()
    except (OSError, ValueError, IndexError):
        return ""


def opcode(op: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", op).split()[0].split(".")[0]


def group_bytes(bits: int, head_dim: int) -> int:
    """Bytes of one group of one KV head the kernel reads (codes, scales, outliers)."""
    codes = 2 * GROUP_TOKENS * head_dim * bits // 8
    scales = 2 * SCALE_BYTES * head_dim + 2 * SCALE_BYTES * GROUP_TOKENS * (
        head_dim // VALUE_GROUP_CHANNELS
    )
    outliers = OUTLIERS * (2 * head_dim * 2 + 2)
    return codes + scales + outliers


def rows_for(args):
    from sglang_evict_kernels import tier_attention, tier_jit

    for shape_name in args.shape:
        shape = SHAPES[shape_name]
        for bits in args.bits:
            nbytes = group_bytes(bits, shape[2])
            for name, attr, extra, pad16, launcher in BODIES:
                stages = tier_attention.NUM_STAGES[launcher] or 3
                for warps in args.warps:
                    compiled = compile_body(
                        getattr(tier_jit, attr),
                        bits=bits,
                        shape=shape,
                        warps=warps,
                        extra=extra,
                        pad16=pad16,
                        arch=args.arch,
                        stages=stages,
                    )
                    loop = group_loop(compiled)
                    per_group = len(loop) * warps
                    yield {
                        "shape": shape_name,
                        "bits": bits,
                        "body": name,
                        "warps": warps,
                        "stages": stages,
                        **resources(compiled),
                        "loop": len(loop),
                        "per_group": per_group,
                        "per_byte": per_group / nbytes,
                        "issued": collections.Counter(opcode(op) for _, op in loop),
                        "lines": loop_by_line(compiled) if args.lines == name else [],
                    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)"
    )
    parser.add_argument("--bits", type=int, nargs="+", default=[3], choices=[2, 3, 4, 8])
    parser.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=sorted(SHAPES))
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4], choices=[1, 2, 4, 8])
    parser.add_argument(
        "--lines", choices=[b[0] for b in BODIES], help="that body's loop by source line"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        # the interpreter replaces Triton's compiler front end: compile without it
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if not ptxas_available():
        sys.exit("this needs Triton with its NVIDIA backend (ptxas); install the project's torch")
    if not args.json:
        print(
            f"{'shape':>8}{'bits':>5}  {'body':<10}{'warps':>6}{'regs':>6}{'stack':>7}"
            f"{'shared':>8}{'loop':>7}{'per group':>11}{'per byte':>10}  most issued"
        )
    for row in rows_for(args):
        if args.json:
            print(json.dumps({**row, "issued": dict(row["issued"].most_common())}), flush=True)
            continue
        top = ", ".join(f"{k} {v}" for k, v in row["issued"].most_common(5))
        print(
            f"{row['shape']:>8}{row['bits']:>5}  {row['body']:<10}{row['warps']:>6}"
            f"{row['registers']:>6}{row['stack_bytes']:>7}{row['shared_bytes']:>8}"
            f"{row['loop']:>7}{row['per_group']:>11}{row['per_byte']:>10.2f}  {top}",
            flush=True,
        )
        for count, where, ops in row["lines"][:20]:
            text = source_line(where)[:70]
            print(f"    {count:>5}  {where:<16} {text:<70} {ops}")


if __name__ == "__main__":
    main()
