"""Real SGLang engine with the plugin, on a GPU: eviction on vs off, side by side.

For each page size, starts ``sglang.Engine`` (radix cache on, overlap scheduler on) in a
child process three times over the same random-weight Llama and prompts:

    plain   SGLang as shipped (no --radix-cache-backend)
    off     --radix-cache-backend sglang-evict, budget larger than any request (no-op)
    on      --radix-cache-backend sglang-evict, evicting (default budget 256)

and reports, from SGLang's own decode log lines (``#running-req: N, #token: T``), the
peak KV tokens in use per running request, output agreement of plain vs off, the
attention backend each engine chose, and decode throughput ratios measured in the
same run. Needs a GPU machine with SGLang 0.5.17 (and its CUDA kernels) installed, and the
project installed there with ``pip install --no-deps --no-build-isolation -e .``::

    . .gpu_carry/env.sh && python3 -m pip install -q --no-deps --no-build-isolation -e . \\
      && python3 benches/engine_eviction.py --model /tmp/llama_rand --page-size 16

CPU machines cannot start the engine (its CUDA kernels do not load there).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

DECODE_LINE = re.compile(r"Decode batch.*?#running-req: (\d+), #token: (\d+)")
RESULT_PREFIX = "ENGINE_RESULT "


def peak_tokens_per_request(log: str) -> tuple[int, float]:
    """(peak ``#token``, peak ``#token / #running-req``) over SGLang's decode log lines."""
    peak_tokens, peak_per_request = 0, 0.0
    for running, tokens in DECODE_LINE.findall(log):
        running_count, token_count = int(running), int(tokens)
        peak_tokens = max(peak_tokens, token_count)
        if running_count:
            peak_per_request = max(peak_per_request, token_count / running_count)
    return peak_tokens, peak_per_request


def child(args: argparse.Namespace) -> None:
    """One engine: generate, print a JSON result line (runs in its own process)."""
    import random
    import time

    import sglang as sgl

    kwargs = dict(
        model_path=args.model,
        skip_tokenizer_init=True,
        attention_backend=args.attention_backend,
        sampling_backend="pytorch",
        grammar_backend="none",
        page_size=args.page_size,
        random_seed=0,
        log_level="info",
        decode_log_interval=16,
    )
    if args.cuda_graph == "off":
        kwargs["disable_cuda_graph"] = True
    if args.mode != "plain":
        kwargs["radix_cache_backend"] = "sglang-evict"
    engine = sgl.Engine(**kwargs)
    info = engine.get_server_info()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(args.in_len)] for _ in range(args.n)]
    params = {"max_new_tokens": args.out_len, "ignore_eos": True, "temperature": 0.0}
    engine.generate(input_ids=[p[:32] for p in prompts], sampling_params={"max_new_tokens": 8})
    start = time.perf_counter()
    outputs = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    engine.shutdown()
    print(
        RESULT_PREFIX
        + json.dumps(
            {
                "mode": args.mode,
                "attention_backend": info.get("attention_backend"),
                "output_ids": [o["output_ids"] for o in outputs],
                "tokens_per_s": sum(len(o["output_ids"]) for o in outputs) / elapsed,
            }
        ),
        flush=True,
    )


def run_mode(args: argparse.Namespace, mode: str) -> dict:
    env = dict(os.environ)
    budget = args.budget if mode == "on" else 1 << 30
    env["SGLANG_EVICT_CONFIG"] = json.dumps(
        {"kv_budget_tokens": budget, "cadence_tokens": args.cadence, "scorer": args.scorer}
    )
    argv = [sys.executable, __file__, "--child", "--mode", mode]
    argv += [a for a in sys.argv[1:] if a != "--child"]
    completed = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=args.timeout_s
    )
    log = completed.stdout + completed.stderr
    results = [line for line in log.splitlines() if line.startswith(RESULT_PREFIX)]
    if completed.returncode != 0 or not results:
        print(log[-4000:])
        raise SystemExit(f"engine in mode {mode!r} failed (exit {completed.returncode})")
    result = json.loads(results[-1][len(RESULT_PREFIX) :])
    result["peak_tokens"], result["peak_tokens_per_request"] = peak_tokens_per_request(log)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--cadence", type=int, default=128)
    parser.add_argument("--scorer", default="knorm")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--in-len", type=int, default=256)
    parser.add_argument("--out-len", type=int, default=1024)
    parser.add_argument("--cuda-graph", choices=["off", "default"], default="default")
    parser.add_argument("--attention-backend", default="triton")
    parser.add_argument("--timeout-s", type=int, default=540)
    parser.add_argument("--modes", default="plain,off,on")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="plain", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    results = {mode: run_mode(args, mode) for mode in args.modes.split(",")}
    print(
        f"page size {args.page_size}, {args.n} requests x ({args.in_len} in, {args.out_len} "
        f"out), budget {args.budget}, cadence {args.cadence}, scorer {args.scorer}"
    )
    print(f"{'mode':<7}{'attention':>12}{'peak #token':>13}{'peak/request':>14}{'tok/s':>9}")
    for mode, r in results.items():
        print(
            f"{mode:<7}{r['attention_backend']!s:>12}{r['peak_tokens']:>13}"
            f"{r['peak_tokens_per_request']:>14.0f}{r['tokens_per_s']:>9.0f}"
        )
    if "plain" in results and "off" in results:
        same = results["plain"]["output_ids"] == results["off"]["output_ids"]
        print(f"budget off vs plain SGLang: outputs identical = {same}")
    if "plain" in results and "on" in results:
        ratio = results["on"]["tokens_per_s"] / results["plain"]["tokens_per_s"]
        print(
            f"throughput on / plain = {ratio:.2f}; peak KV on / plain = "
            f"{results['on']['peak_tokens'] / max(1, results['plain']['peak_tokens']):.2f}"
        )


if __name__ == "__main__":
    main()
