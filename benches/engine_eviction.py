"""SGLang's real engine on a GPU: decode step time with eviction on vs off, side by side.

Starts ``sglang.Engine`` (radix cache on, overlap scheduler on, CUDA graphs on) three
times over the same model and prompts, one engine at a time, in the project's engine
host process (``sglang_evict.srt.engine_runner``):

    plain   SGLang as shipped (no --radix-cache-backend)
    off     --radix-cache-backend sglang-evict, budget larger than any request (no pass)
    on      --radix-cache-backend sglang-evict, evicting (--budget, --cadence)
    on:N    the same with passes on every N-th decode step only (--kv-pass-group-steps
            N; plain ``on`` takes --pass-group-steps), so one run compares groupings:
            --modes off,on:1,on:8,on:32
    on:auto the server picks the group (--kv-pass-group-steps auto)
    +graph  suffix of an ``on`` mode: passes replayed as CUDA graphs
            (--kv-pass-cuda-graph); without it passes run eagerly
            (--no-kv-pass-cuda-graph), so --modes off,on:1,on:1+graph,on:auto+graph
            compares eager, replayed and auto-grouped passes in one run
    +tier   suffix of an ``on`` mode: the quantized tier on (--tier-bits, --tier-group,
            --tier-tokens): what a pass does not keep enters the tier, and every decode
            layer merges the tier's attention, so --modes plain,on,on+tier compares
            plain SGLang, eviction and the tier in one run. On a GPU the tier with
            ``triton`` is a trial (the server refuses it until it has passed there:
            ``server_args.TIER_GPU_TRIAL_ENV``, which this bench sets)
    +tier-tensor  the same, the engine's CPU merge in its tensor form
            (``SGLANG_EVICT_TIER_CPU_KERNEL=0``) instead of the compiled kernel, so
            --modes on+tier,on+tier-tensor compares the two

``--paired`` adds, inside every ``on`` mode's engine, the same generation with every
request turning eviction off for itself (``custom_params`` ``{"enabled": false}``,
the server started with ``request_allow_disable``), alternating with the evicting
generations (off, on, on, off, off, on, ...): the ratio "paired" compares the two in
one engine, so differences between engine instances (memory layout, clocks, a machine
that drifts over a run) do not enter it.

Decode step time is read off SGLang's own decode log line, written after every step
(``decode_log_interval=1``): ``gen throughput`` is the tokens generated since the last
line over the time since it, so one step of N running requests took N / throughput.
Steps count only while all ``--batch`` requests run (the steady state); prompt lengths
are spread over [in_len/2, 3 in_len/2] so requests fall due at different steps, as in
a server. The plugin's pass lines (``SGLANG_EVICT_LOG_PASSES=1``) give the passes, the
due requests per pass and each pass's host time. Each mode generates ``--repeats``
times; the figures are the median over the repeats of each repeat's mean.

    . .gpu_carry/env.sh && python3 -m pip install -q --no-deps --no-build-isolation -e . \\
      && python3 benches/engine_eviction.py --model /tmp/llama_rand --page-size 16

CPU machines cannot start the engine with these settings (SGLang's CUDA kernels);
``--smoke`` runs a tiny configuration on SGLang's CPU engine with the project's model
(``--device cpu``), which checks the script, not the timing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

STEP_LINE = re.compile(
    r"Decode batch[^#]*#running-req: (\d+), #token: (\d+)[^\n]*?"
    r"gen throughput \(token/s\): ([0-9.]+)"
)


def decode_step_ms(log: str, batch: int) -> list[float]:
    """Milliseconds of each decode step that ran ``batch`` requests (one log line per
    step: the step generated ``batch`` tokens in ``batch / throughput`` seconds)."""
    steps = []
    for running, _tokens, throughput in STEP_LINE.findall(log):
        if int(running) == batch and float(throughput) > 0:
            steps.append(1e3 * batch / float(throughput))
    return steps


def peak_tokens(log: str) -> int:
    """The most KV tokens SGLang held at any decode step (its ``#token``)."""
    from sglang_evict.srt.engine_runner import parse_decode_steps

    return max((step.tokens_held for step in parse_decode_steps(log)), default=0)


def vocab_size(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def prompts_for(batch: int, in_len: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    lengths = [in_len // 2 + (in_len * i) // max(1, batch - 1) for i in range(batch)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def engine_kwargs(args: argparse.Namespace) -> dict:
    if args.device == "cpu":  # checks the script: SGLang's CPU settings, no timing worth reading
        from sglang_evict.srt.engine_runner import cpu_engine_kwargs

        kwargs = cpu_engine_kwargs(
            args.model, page_size=args.page_size, max_running_requests=args.batch
        )
        if args.no_overlap:
            kwargs["disable_overlap_schedule"] = True
        return kwargs
    kwargs = dict(
        model_path=args.model,
        skip_tokenizer_init=True,
        attention_backend=args.attention_backend,
        sampling_backend="pytorch",
        grammar_backend="none",
        page_size=args.page_size,
        random_seed=0,
        log_level="info",
        decode_log_interval=1,
        # SGLang keeps one of max_running_requests back (63 of 64 ran, the last alone
        # after them): room for the whole batch.
        max_running_requests=2 * args.batch,
        cuda_graph_max_bs_decode=args.batch,
        mem_fraction_static=args.mem_fraction,
        # The bench times decode steps; SGLang 0.5.17 captures prefill graphs for 58
        # token counts by default, over a minute per engine on an H200 (2026-11-28).
        # --prefill-graphs keeps them (scripts/gpu_check.sh stall: the tier engine's
        # prefill capture stalled at 960 tokens that day).
        disable_prefill_cuda_graph=not args.prefill_graphs,
    )
    if args.cuda_graph == "off":
        kwargs["disable_cuda_graph"] = True
    if args.no_overlap:
        kwargs["disable_overlap_schedule"] = True
    return kwargs


def parse_modes(text: str) -> list[str]:
    """``--modes``: comma-separated ``plain``, ``off``, ``on``, ``on:N`` (N >= 1) or
    ``on:auto``, an ``on`` mode optionally with ``+graph``, each at most once; raises
    ``ValueError`` naming the bad one."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for mode in modes:
        base, _, suffix = mode.partition("+")
        name, _, group = base.partition(":")
        if name in ("plain", "off") and not group and not suffix:
            continue
        group_ok = not group or group == "auto" or (group.isdigit() and int(group) >= 1)
        if name == "on" and group_ok and suffix in ("", "graph", "tier", "tier-tensor"):
            continue
        raise ValueError(
            f"--modes: {mode!r} is not one of plain, off, on, on:N (N >= 1 decode steps), "
            f"on:auto, each on mode optionally +graph, +tier or +tier-tensor"
        )
    if not modes or len(set(modes)) != len(modes):
        raise ValueError(f"--modes: give each mode once, at least one: {text!r}")
    return modes


def group_steps(args: argparse.Namespace, mode: str) -> int | str:
    """The pass group of ``mode``: N of ``on:N`` (or ``auto``), else --pass-group-steps."""
    _, _, group = mode.partition("+")[0].partition(":")
    if group == "auto":
        return group
    return int(group) if group else args.pass_group_steps


def policy_for(args: argparse.Namespace, mode: str) -> dict | None:
    if mode == "plain":
        return None
    budget = 1 << 30 if mode == "off" else args.budget
    return {
        "kv_budget_tokens": budget,
        "cadence_tokens": args.cadence,
        "scorer": args.scorer,
        "compaction": args.compaction,
        "window_tokens": args.window,
        "pass_group_steps": group_steps(args, mode),
        "pass_cuda_graph": mode.endswith("+graph"),
        "request_allow_disable": bool(args.paired) and mode.startswith("on"),
        **(
            {
                "tier_bits": args.tier_bits,
                "tier_group_tokens": args.tier_group,
                "tier_max_tokens": args.tier_tokens,
            }
            if mode.endswith(("+tier", "+tier-tensor"))
            else {}
        ),
    }


def engine_env_for(args: argparse.Namespace, mode: str) -> dict | None:
    """The environment ``mode``'s engine starts with (None: this process's)."""
    env = {"SGLANG_EVICT_TIER_CPU_KERNEL": "0"} if mode.endswith("+tier-tensor") else {}
    if mode.endswith(("+tier", "+tier-tensor")) and args.device == "cuda":
        from sglang_evict.srt.server_args import TIER_GPU_TRIAL_ENV

        # the tier with triton on a GPU is refused until proven there: this bench is a trial
        env[TIER_GPU_TRIAL_ENV] = "1"
    return env or None


PAIRED_OFF = {"custom_params": {"sglang_evict": {"enabled": False}}}


def run_mode(args: argparse.Namespace, mode: str, log_dir: Path) -> dict:
    from sglang_evict.srt.engine_runner import EngineProcess

    vocab = vocab_size(args.model)
    prompts = prompts_for(args.batch, args.in_len, vocab)
    sampling = {"max_new_tokens": args.out_len, "ignore_eos": True, "temperature": 0.0}
    log_path = log_dir / f"engine_{mode.replace(':', '_group').replace('+', '_')}.log"
    log_path.unlink(missing_ok=True)
    with EngineProcess(
        engine_kwargs(args),
        policy=policy_for(args, mode),
        log_path=log_path,
        env=engine_env_for(args, mode),
    ) as e:
        info = e.server_info()
        warm = [[(7 * i + j) % (vocab - 3) + 3 for j in range(32)] for i in range(args.batch)]
        e.generate(warm, {"max_new_tokens": 16, "ignore_eos": True})  # compiles, captures
        repeats, outputs, paired = [], None, []
        group = group_steps(args, mode)
        paired_run = bool(args.paired) and mode.startswith("on")
        for repeat in range(args.repeats):
            # paired: off first on even repeats, last on odd ones (order cancels out)
            order = ["off", "mode"] if repeat % 2 == 0 else ["mode", "off"]
            for which in order if paired_run else ["mode"]:
                extra = PAIRED_OFF if which == "off" else {}
                e.flush_cache()  # every repeat prefills its prompts afresh
                mark = e.mark()
                start = time.perf_counter()
                generated = e.generate(prompts, {**sampling, **extra})
                wall_s = time.perf_counter() - start
                log = e.log_since(mark)
                record = measure(generated, wall_s, log, args.batch, group)
                if which == "off":
                    paired.append(record)
                else:
                    repeats.append(record)
                    outputs = generated
        state = e.plugin_state()
    summary = medians(repeats)
    if paired:
        off = medians(paired)
        summary["paired_off_step_ms_mean"] = off["step_ms_mean"]
        summary["paired_step_ratio"] = statistics.median(
            on["step_ms_mean"] / o["step_ms_mean"] for on, o in zip(repeats, paired, strict=True)
        )
    return {
        "mode": mode,
        "pass_group_steps": None if mode == "plain" else group_steps(args, mode),
        "attention_backend": info.get("attention_backend"),
        "max_total_num_tokens": info.get("max_total_num_tokens"),
        "repeats": repeats,
        "paired_off_repeats": paired,
        "summary": summary,
        "output_ids": [o["output_ids"] for o in outputs],
        "plugin": state,
    }


def measure(outputs: list[dict], wall_s: float, log: str, batch: int, group) -> dict:
    """One generation's figures, from its outputs, wall time and log."""
    steps = decode_step_ms(log, batch)
    return {
        "wall_s": wall_s,
        "tokens_per_s": sum(len(o["output_ids"]) for o in outputs) / wall_s,
        "steps": len(steps),
        "step_ms_mean": statistics.fmean(steps) if steps else float("nan"),
        "step_ms_p50": statistics.median(steps) if steps else float("nan"),
        "step_ms_p99": _percentile(steps, 0.99),
        "peak_tokens": peak_tokens(log),
        **parse_passes(log, 1 if group == "auto" else group),
    }


def medians(records: list[dict]) -> dict:
    """The median of each numeric figure over ``records``."""
    return {
        key: statistics.median(r[key] for r in records)
        for key in records[0]
        if isinstance(records[0][key], (int, float))
    }


def parse_passes(log: str, pass_group_steps: int = 1) -> dict:
    from sglang_evict.srt.engine_runner import parse_pass_lines

    records = [r for r in parse_pass_lines(log) if not r.get("pressure")]
    due = [len(r["requests"]) for r in records]
    host_ms = [r["duration_ms"] for r in records if "duration_ms" in r]
    return {
        "pass_steps": len(records),
        "requests_passed": sum(due),
        "due_per_pass_mean": statistics.fmean(due) if due else 0.0,
        "pass_host_ms_mean": statistics.fmean(host_ms) if host_ms else 0.0,
        "pass_host_ms_per_request": sum(host_ms) / max(1, sum(due)),
        "pages_freed": sum(q["pages_freed"] for r in records for q in r["requests"]),
        # passes on a step the group does not open (must be 0)
        "passes_off_group": sum(r["decode_step"] % pass_group_steps != 0 for r in records),
    }


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def preflight_modes(args: argparse.Namespace, modes: list[str]) -> int:
    """``--preflight``: each mode's problems, one line each; 1 when any mode has one."""
    from sglang_evict.srt.engine_runner import EngineProcess
    from sglang_evict.srt.preflight import preflight

    failed = 0
    for mode in modes:
        engine = EngineProcess(
            engine_kwargs(args),
            policy=policy_for(args, mode),
            log_path=os.devnull,  # never started
            env=engine_env_for(args, mode),
        )
        problems = preflight(engine)
        print(f"{mode}: {'would start' if not problems else '; '.join(problems)}")
        failed += bool(problems)
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a HF model folder (GPU machine)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64, help="requests running together")
    parser.add_argument("--in-len", type=int, default=256, help="mean prompt tokens")
    parser.add_argument("--out-len", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--cadence", type=int, default=128)
    parser.add_argument("--scorer", default="knorm")
    parser.add_argument("--window", type=int, default=128, help="recent tokens always kept")
    parser.add_argument(
        "--pass-group-steps",
        type=int,
        default=1,
        help="passes on every N-th decode step only (--kv-pass-group-steps)",
    )
    parser.add_argument("--compaction", default="hole_fill", choices=["hole_fill", "repack"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--paired",
        action="store_true",
        help="in each on mode's engine, also generate with eviction off per request, "
        "alternating (module docstring)",
    )
    parser.add_argument("--tier-bits", type=int, default=3, help="+tier modes: bits")
    parser.add_argument("--tier-group", type=int, default=32, help="+tier modes: group tokens")
    parser.add_argument("--tier-tokens", type=int, default=1024, help="+tier modes: bound")
    parser.add_argument("--cuda-graph", choices=["off", "default"], default="default")
    parser.add_argument("--no-overlap", action="store_true", help="overlap scheduler off")
    parser.add_argument(
        "--prefill-graphs",
        action="store_true",
        help="keep SGLang's prefill CUDA graphs (off by default: the bench times decode)",
    )
    parser.add_argument("--attention-backend", default="triton")
    parser.add_argument("--mem-fraction", type=float, default=0.6)
    parser.add_argument(
        "--modes", default="plain,off,on", help="plain, off, on, on:N (module docstring)"
    )
    parser.add_argument("--out", default="benches/results/engine_eviction.json")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--preflight",
        action="store_true",
        help="start no engine: check that every mode's engine would start (SGLang's "
        "arguments, the plugin's refusals; sglang_evict.srt.preflight), then exit",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny run on SGLang's CPU engine with the project's model (checks the script)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        from sglang_evict.models.engine_model import ensure_engine_model

        args.device, args.page_size, args.batch, args.repeats = "cpu", 1, 2, 1
        args.in_len, args.out_len, args.budget, args.cadence = 16, 24, 16, 4
        args.window = 4
        args.model = args.model or str(ensure_engine_model())
    if not args.model:
        parser.error("--model is required (a HF model folder), unless --smoke")
    try:
        modes = parse_modes(args.modes)
    except ValueError as error:
        parser.error(str(error))
    if args.pass_group_steps < 1:
        parser.error("--pass-group-steps must be at least 1")
    if args.preflight:
        return preflight_modes(args, modes)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {}
    for mode in modes:
        results[mode] = run_mode(args, mode, out.parent)
        print(f"{mode}: {json.dumps(results[mode]['summary'])}", flush=True)
    print(
        f"\npage size {args.page_size}, batch {args.batch}, prompts ~{args.in_len} + "
        f"{args.out_len} out, budget {args.budget}, cadence {args.cadence}, {args.scorer}, "
        f"{args.compaction}, pass group {args.pass_group_steps} step(s) unless on:N, "
        f"overlap {'off' if args.no_overlap else 'on'}, CUDA graphs "
        f"{args.cuda_graph}, {args.repeats} repeats (medians)"
    )
    print(
        f"{'mode':<14} {'backend':>12} {'steps':>6} {'step ms':>8} {'p50':>8} {'p99':>8} "
        f"{'tok/s':>8} {'peak #token':>11} {'pass steps':>10} {'due/pass':>8} {'host ms/req':>11}"
    )
    for mode, r in results.items():
        s = r["summary"]
        print(
            f"{mode:<14} {r['attention_backend']!s:>12} {s['steps']:>6.0f} "
            f"{s['step_ms_mean']:>8.3f} {s['step_ms_p50']:>8.3f} {s['step_ms_p99']:>8.3f} "
            f"{s['tokens_per_s']:>8.0f} {s['peak_tokens']:>11.0f} {s['pass_steps']:>10.0f} "
            f"{s['due_per_pass_mean']:>8.1f} {s['pass_host_ms_per_request']:>11.3f}"
        )
    summaries = {m: r["summary"] for m, r in results.items()}
    for mode in (m for m in modes if m.startswith("on") and "off" in summaries):
        ratio = summaries[mode]["step_ms_mean"] / summaries["off"]["step_ms_mean"]
        group = group_steps(args, mode)
        if group == "auto":
            chosen = (results[mode].get("plugin") or {}).get("pass_grouping") or {}
            group = f"auto, chose {chosen.get('pass_group_steps')}"
        print(
            f"decode step time, eviction {mode} (group {group}) / off: {ratio:.3f} (goal <= 1.03)"
        )
    for mode in (m for m in modes if "paired_step_ratio" in summaries[m]):
        print(
            f"decode step time, eviction {mode} / eviction off per request, same engine, "
            f"alternating (median of {args.repeats} pairs): "
            f"{summaries[mode]['paired_step_ratio']:.3f} (goal <= 1.03)"
        )
    if "off" in summaries and "plain" in summaries:
        ratio = summaries["off"]["step_ms_mean"] / summaries["plain"]["step_ms_mean"]
        print(f"decode step time, plugin with budget off / plain SGLang: {ratio:.3f}")
        same = results["off"]["output_ids"] == results["plain"]["output_ids"]
        print(f"outputs, budget off vs plain SGLang: identical = {same}")
    for mode in (m for m in modes if m.startswith("on") and "plain" in summaries):
        ratio = summaries[mode]["peak_tokens"] / max(1, summaries["plain"]["peak_tokens"])
        print(f"peak KV tokens, eviction {mode} / plain: {ratio:.2f}")
    for mode in (m for m in modes if "+tier" in m and "plain" in summaries):
        ratio = summaries[mode]["step_ms_mean"] / summaries["plain"]["step_ms_mean"]
        print(f"decode step time, {mode} / plain SGLang: {ratio:.3f} (goal <= 1.10)")
    for r in results.values():
        r.pop("output_ids")
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
