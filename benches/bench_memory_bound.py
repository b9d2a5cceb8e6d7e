"""Memory-bound serving in SGLang's real engine: how many long generations run at once
when the pool, not the batch size, is the limit, and what each configuration keeps of
the answers.

One run starts up to four engines, one after another over the same checkpoint, pool
and workload, and gives each the machine alone:

    plain      SGLang as shipped (no --radix-cache-backend)
    evict      --radix-cache-backend sglang-evict --kv-admission sglang: eviction, with
               SGLang's admission arithmetic (it reserves the rest of max_new_tokens)
    bounded    --radix-cache-backend sglang-evict (--kv-admission bounded, the default):
               admission sees each evicting request's bounded KV
    tier       bounded, with the quantized tier (--kv-tier-bits ...): what a pass would
               evict is kept at 2-4 bits in an arena carved from the same pool

Eviction and the tier hold the same KV bytes per request: ``--kv-fraction`` (1/4 by
default) of a full-length request's (prompt + max_new_tokens), split as the frontier
splits them (``memory_bound_setup``). The pool holds about ``--pool-requests``
full-length requests; ``--requests`` requests each generate ``--new-tokens`` tokens
(EOS ignored), many times the budget. Everything reported is read off SGLang: its
decode log every step (``#running-req``, ``#token``, ``#queue-req``), each output's
``meta_info`` (``num_retractions``, ``finish_reason``, the plugin's per-request
report) and its idle memory check (strict, SGLang's default: an engine whose check
fails dies, and the bench says so). Steady state: the decode steps with requests
waiting in the queue (admission is what limits them).

On the real model (``--model smollm2``; weights 4-bit Q4_1 dequantised) each engine
then answers ``--needles`` needle prompts (the essays, about a full-length request
long) under the same server configuration, so throughput and quality are read off one
table:

    python3 benches/bench_memory_bound.py                  # tiny model, ~6 min on 2 cores
    python3 benches/bench_memory_bound.py --model smollm2 --runs plain,bounded,tier

``--runs`` may add ``ample``: plain SGLang again, with a pool that holds every request
whole, so nothing waits for memory. Its rate is what this machine serves when memory
does not bind, the yardstick for what a memory saving can buy here.

It prints a table and the ratios against plain SGLang, writes ``--json`` and a plot
(``--plot``: running requests and KV held over time, side by side), and checks that
eviction with and without budget-aware admission produced the same tokens for every
request, and that the first ``--check-alone`` requests produce them run one at a time:
admission changes when a request runs, not what it produces.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import threading
import time
from pathlib import Path

from memory_bound_setup import (
    DEFAULT_RUNS,
    MODELS,
    RUNS,
    needle_samples,
    plan_runs,
    resolve_model,
    run_needles,
    shape_of,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="tiny",
        help=f"{' or '.join(MODELS)} (4-bit weights dequantised) or a model folder",
    )
    parser.add_argument(
        "--runs",
        default=",".join(DEFAULT_RUNS),
        help=(
            f"comma-separated, of {','.join(RUNS)} (default: {','.join(DEFAULT_RUNS)}; "
            f"ample: plain SGLang with a pool holding every request whole, the machine's "
            f"rate when memory does not bind)"
        ),
    )
    parser.add_argument("--requests", type=int, default=None, help="default 96; smollm2 16")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        help="max_new_tokens of each (1024; smollm2 992, the frontier's 1k with the prompt)",
    )
    parser.add_argument(
        "--pool-requests", type=int, default=4, help="full-length requests the pool holds"
    )
    parser.add_argument(
        "--kv-fraction",
        type=float,
        default=0.25,
        help="KV bytes per request for eviction and the tier, over a full-length request's",
    )
    parser.add_argument(
        "--budget", type=int, default=None, help="eviction's budget (default: --kv-fraction's)"
    )
    parser.add_argument(
        "--tier", default=None, help="the tier's format BITS:G[/SCORER] (default 3:32/--scorer)"
    )
    parser.add_argument("--cadence", type=int, default=None, help="16; smollm2 64")
    parser.add_argument("--window", type=int, default=None, help="16; smollm2 32")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--query-window", type=int, default=None, help="16; smollm2 32")
    parser.add_argument("--scorer", default=None, help="default streaming; smollm2 rkv")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument(
        "--check-alone", type=int, default=None, help="requests rerun one at a time (4; smollm2 2)"
    )
    parser.add_argument(
        "--needles", type=int, default=None, help="needle prompts per engine (0; smollm2 24)"
    )
    parser.add_argument("--json", default="bench_memory_bound.json")
    parser.add_argument("--plot", default="bench_memory_bound.png")
    parser.add_argument("--log-dir", default=None, help="engine logs (default: the current dir)")
    args = parser.parse_args(argv)
    real = args.model == "smollm2"
    # The real model runs the frontier's settings (quality.real.frontier_engine): its 1k
    # contexts, window and cadence, and eviction's best scorer on it.
    defaults = dict(
        requests=(16, 96),
        new_tokens=(992, 1024),
        scorer=("rkv", "streaming"),
        cadence=(64, 16),
        window=(32, 16),
        query_window=(32, 16),
        check_alone=(2, 4),
        needles=(24, 0),
    )
    for key, (if_real, otherwise) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, if_real if real else otherwise)
    if args.tier is None:
        args.tier = f"3:32/{args.scorer}"
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown or not runs or len(set(runs)) != len(runs):
        parser.error(f"--runs {args.runs}: each of {', '.join(RUNS)} at most once")
    args.runs = [r for r in RUNS if r in runs]
    if not 0.0 < args.kv_fraction < 1.0:
        parser.error(f"--kv-fraction {args.kv_fraction:g}: between 0 and 1")
    if args.needles and not real:
        parser.error("--needles: the needle task needs the real model (--model smollm2)")
    return args


def prompts_for(tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` distinct prompts of ``length`` tokens (no shared prefix beyond chance)."""
    prompts = []
    for i in range(count):
        text = f"Request {i}: write a long story about the number {i * 7919 % 1000}."
        ids = tokenizer(text)["input_ids"]
        prompts.append((ids * length)[:length])
    return prompts


class DecodeLogClock:
    """Stamps SGLang's decode log lines with wall time (the log is polled every 0.25 s
    while an engine generates; the steps a poll finds are spread evenly since the
    last): the plot's time axis."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.start_offset = engine.log_path.stat().st_size
        self.stamps: list[float] = []  # seconds since start, one per decode step
        self.steps: list = []  # SGLang's decode log lines read so far (DecodeStep)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self.started = time.monotonic()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._read()

    def _poll(self) -> None:
        while not self._stop.wait(0.25):
            self._read()

    def _read(self) -> None:
        from sglang_evict.srt.engine_runner import parse_decode_steps

        with open(self.engine.log_path, "rb") as log:  # the file: the engine's
            log.seek(self.start_offset)  # connection is busy with the generate call
            self.steps = parse_decode_steps(log.read().decode(errors="replace"))
        now = time.monotonic() - self.started
        new = len(self.steps) - len(self.stamps)
        last = self.stamps[-1] if self.stamps else 0.0
        # Steps first seen in this poll ran since the last one: spread them evenly.
        self.stamps += [last + (now - last) * (i + 1) / new for i in range(new)]


def summarise(steps, outputs, wall_s: float, pool_tokens: int, bound_tokens: int) -> dict:
    """The table's row of one run (``steps``: SGLang's decode log, trailing idle lines
    dropped; ``outputs``: its outputs)."""
    steady = [s for s in steps if s.queued_requests > 0]
    running = [s.running_requests for s in steps]
    output_tokens = sum(len(o["output_ids"]) for o in outputs)
    return {
        "peak_running": max(running, default=0),
        "mean_running": sum(running) / len(running) if running else 0.0,
        "steady_steps": len(steady),
        "steady_mean_running": (
            sum(s.running_requests for s in steady) / len(steady) if steady else None
        ),
        "steady_target": 0.9 * pool_tokens / bound_tokens,
        "peak_tokens_held": max((s.tokens_held for s in steps), default=0),
        "retractions": sum(o["meta_info"].get("num_retractions", 0) for o in outputs),
        "completed": sum(
            1
            for o in outputs
            if (o["meta_info"].get("finish_reason") or {}).get("type") == "length"
        ),
        "output_tokens": output_tokens,
        "wall_s": wall_s,
        "output_tokens_per_min": 60.0 * output_tokens / wall_s if wall_s else 0.0,
    }


def run_one(name, engine, prompts, sampling, check_alone: int) -> tuple[dict, list, list, list]:
    """Generate the workload on a started engine; returns ``(facts, steps, stamps,
    outputs)`` and, for ``check_alone`` > 0, the first requests rerun one at a time."""
    from tqdm import tqdm

    mark = engine.mark()
    total = len(prompts) * sampling["max_new_tokens"]
    with DecodeLogClock(engine) as clock:
        done = threading.Event()
        result: dict = {}

        def work():
            try:
                result["outputs"] = engine.generate(prompts, sampling)
            except BaseException as error:  # re-raised below
                result["error"] = error
            done.set()

        started = time.monotonic()
        threading.Thread(target=work, daemon=True).start()
        with tqdm(
            total=total, desc=f"{name:<8}", unit="tok", file=sys.stdout, mininterval=1.0
        ) as bar:
            while not done.wait(0.5):
                generated = sum(s.running_requests for s in clock.steps)
                bar.update(min(generated, total) - bar.n)
        wall_s = time.monotonic() - started
    if "error" in result:
        raise result["error"]
    steps = engine.decode_steps(mark)
    stamps = clock.stamps[: len(steps)]
    while steps and steps[-1].tokens_held == 0:
        steps.pop()
    alone = []
    for prompt in prompts[:check_alone]:
        alone.append(engine.generate([prompt], sampling)[0]["output_ids"])
    return {"wall_s": wall_s, "alone": alone}, steps, stamps[: len(steps)], result["outputs"]


def idle_check_passed(engine, mark: int, plugin: bool, checks_before: int) -> bool:
    """SGLang's idle memory check ran after the workload and passed: strict (its
    default), a failure kills the scheduler and logs the leak. With the plugin its idle
    hook, which runs after SGLang's check, counts the checks passed."""
    deadline = time.monotonic() + 60
    while plugin and time.monotonic() < deadline:
        if engine.plugin_state()["idle_checks"] > checks_before:
            break
        time.sleep(0.5)
    else:
        if plugin:
            return False
        time.sleep(3.0)  # plain SGLang: give the idle check its turn
    log = engine.log_since(mark)
    return engine.alive and "memory leak detected" not in log and "Traceback" not in log


def plot(path: Path, series: dict, title: str) -> bool:
    from sglang_evict.plotting import pyplot_or_none, save_figure

    plt = pyplot_or_none()
    if plt is None:
        return False
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name, (stamps, steps) in series.items():
        top.plot(stamps, [s.running_requests for s in steps], label=name)
        bottom.plot(stamps, [s.tokens_held for s in steps], label=name)
    top.set_ylabel("running requests")
    bottom.set_ylabel("KV tokens held (#token)")
    bottom.set_xlabel("seconds since the workload started")
    top.set_title(textwrap.fill(title, 90), fontsize=10)
    for axis in (top, bottom):
        axis.grid(alpha=0.3)
        axis.legend()
    save_figure(plt, figure, path)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from sglang_evict.srt.engine_runner import EngineError, EngineProcess, cpu_engine_kwargs
    from sglang_evict.triton_env import use_triton_interpreter_without_gpu

    use_triton_interpreter_without_gpu()
    model_path, model_label = resolve_model(args.model)
    shape = shape_of(model_path)
    plans = plan_runs(args, shape, args.runs)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    prompts = prompts_for(tokenizer, args.requests, args.prompt_tokens)
    length = args.prompt_tokens + args.new_tokens
    needles = needle_samples(tokenizer, args.needles, length)
    page = args.page_size
    pool_tokens = args.pool_requests * (length + page)
    longest_needle = max((len(s.prompt_ids) for s in needles), default=0)
    if longest_needle + 64 + 2 * page > pool_tokens:
        raise SystemExit(
            f"bench_memory_bound: a needle prompt of {longest_needle} tokens does not fit a "
            f"pool of {pool_tokens}; raise --pool-requests"
        )
    whole_pool_tokens = args.requests * (length + page)
    sampling = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
    print(
        f"bench_memory_bound ({model_label}): pool {pool_tokens} tokens (~{args.pool_requests} "
        f"full-length requests), {args.requests} requests x ({args.prompt_tokens} prompt + "
        f"{args.new_tokens} new) tokens; KV bytes per request (bf16 accounting): "
        + "; ".join(_describe(plan) for plan in plans.values())
        + (f"; then {len(needles)} needle prompts of ~{length} tokens each" if needles else ""),
        flush=True,
    )
    log_dir = Path(args.log_dir) if args.log_dir else Path.cwd()
    log_dir.mkdir(parents=True, exist_ok=True)
    rows, series, outputs = {}, {}, {}
    for name, plan in plans.items():
        log_path = log_dir / f"bench-memory-bound-{name}.log"
        bound_tokens = max(args.prompt_tokens, plan.budget_tokens or 0) + args.cadence + page
        run_pool = whole_pool_tokens if plan.whole_pool else pool_tokens
        kwargs = cpu_engine_kwargs(
            model_path,
            page_size=page,
            max_total_tokens=run_pool,
            max_running_requests=args.requests,
        )
        # ``ample`` answers no needles: its configuration is plain's.
        run_samples = [] if plan.whole_pool else needles
        try:
            with EngineProcess(kwargs, policy=plan.config, log_path=log_path) as engine:
                mark = engine.mark()
                plugin = plan.config is not None
                checks_before = engine.plugin_state()["idle_checks"] if plugin else 0
                facts, steps, stamps, outs = run_one(
                    name, engine, prompts, sampling, args.check_alone if name == "bounded" else 0
                )
                idle_ok = idle_check_passed(engine, mark, plugin, checks_before)
                state = engine.plugin_state() if plugin else None
                needle = run_needles(
                    engine, tokenizer, run_samples, plan, shape, args.pool_requests
                )
        except EngineError as error:
            print(f"bench_memory_bound: {name}: engine error: {error}", file=sys.stderr)
            return 2
        row = summarise(steps, outs, facts["wall_s"], run_pool, bound_tokens)
        row["pool_tokens"] = run_pool
        row.update(needle)
        row["idle_check_ok"] = bool(idle_ok)
        row["kv_fraction"] = plan.kv_fraction
        row["budget_tokens"] = plan.budget_tokens
        row["tier_tokens"] = plan.tier_tokens
        if state is not None:
            row["passes"] = state.get("passes")
            row["pressure_passes"] = state.get("pressure_passes")
            row["plugin_idle_checks"] = state.get("idle_checks")
            tier = state.get("tier") or {}
            if tier:
                row["tier_pool_tokens_after"] = tier.get("pool_tokens_after")
                row["tier_groups"] = tier.get("num_groups")
        rows[name] = row
        series[name] = (stamps, steps)
        outputs[name] = [o["output_ids"] for o in outs]
        if facts["alone"]:
            row["same_alone"] = all(
                a == b for a, b in zip(facts["alone"], outputs[name], strict=False)
            )
    same_tokens = (
        outputs["evict"] == outputs["bounded"] if {"evict", "bounded"} <= set(outputs) else None
    )
    _print_table(rows)
    _print_ratios(rows, args)
    if same_tokens is not None:
        print(
            f"same tokens with and without budget-aware admission: {same_tokens}; first "
            f"{args.check_alone} requests alone: {rows['bounded'].get('same_alone')}"
        )
    Path(args.json).write_text(
        json.dumps(
            {
                "args": vars(args),
                "model": model_label,
                "pool_tokens": pool_tokens,
                "runs": rows,
                "same_tokens": same_tokens,
            },
            indent=2,
            sort_keys=True,
        )
    )
    print(f"results: {Path(args.json).resolve()}")
    title = (
        f"{model_label}: {args.requests} requests x {args.new_tokens} tokens, pool "
        f"{pool_tokens} tokens, {args.kv_fraction:g} of the KV bytes per request"
    )
    if plot(Path(args.plot), series, title):
        print(f"plot: {Path(args.plot).resolve()}")
    return 0


def _describe(plan) -> str:
    if plan.config is None:
        whole = ", every request whole in its pool" if plan.whole_pool else ""
        return f"{plan.name} 1.00 (full{whole})"
    tail = f" + tier {plan.tier_tokens} at {plan.config.tier_bits} bits" if plan.tier_tokens else ""
    return f"{plan.name} {plan.kv_fraction:.2f} ({plan.budget_tokens} tokens{tail})"


def _print_ratios(rows: dict, args) -> None:
    plain = rows.get("plain")
    ample = rows.get("ample")
    if plain is not None and ample is not None and plain["output_tokens_per_min"]:
        print(
            f"ample / plain: output tokens per minute "
            f"{ample['output_tokens_per_min'] / plain['output_tokens_per_min']:.2f}x at "
            f"{ample['mean_running'] / plain['mean_running']:.2f}x the running requests "
            f"(plain SGLang, a pool of {ample['pool_tokens']} tokens holding all "
            f"{args.requests} requests whole: this machine's rate when memory does not bind)"
        )
    for name in ("bounded", "tier"):
        row = rows.get(name)
        if plain is None or row is None or not plain["output_tokens_per_min"]:
            continue
        line = (
            f"{name} / plain: mean running {row['mean_running'] / plain['mean_running']:.2f}x, "
            f"output tokens per minute "
            f"{row['output_tokens_per_min'] / plain['output_tokens_per_min']:.2f}x, "
            f"retractions {row['retractions']}"
        )
        if "needle_accuracy" in row and "needle_accuracy" in plain:
            diff = row["needle_accuracy"] - plain["needle_accuracy"]
            line += (
                f"; needles {row['needle_accuracy']:.2f} vs {plain['needle_accuracy']:.2f} "
                f"({diff:+.2f}) at {row['kv_fraction']:.2f} of the KV bytes"
            )
        print(line)
    for name, row in rows.items():
        if row.get("needles_missed"):
            missed = ", ".join(
                f"{m['kind']} at {m['depth']:.1f} ({' '.join(m['answer'].split())[:60]!r})"
                for m in row["needles_missed"]
            )
            print(f"needles {name} missed: {missed}")
    bounded = rows.get("bounded")
    steady = bounded and bounded["steady_mean_running"]
    if steady is not None and bounded:
        print(
            f"bounded at steady state: {steady:.1f} running (goal >= 0.9 x pool / (prompt + "
            f"budget + cadence + page) = {bounded['steady_target']:.1f}), retractions "
            f"{bounded['retractions']}"
        )


def _print_table(rows: dict) -> None:
    columns = [
        ("KV/req", "kv_fraction", "{:.2f}"),
        ("peak run", "peak_running", "{:d}"),
        ("mean run", "mean_running", "{:.1f}"),
        ("steady run", "steady_mean_running", "{:.1f}"),
        ("retract", "retractions", "{:d}"),
        ("done", "completed", "{:d}"),
        ("tok/min", "output_tokens_per_min", "{:.0f}"),
        ("peak KV", "peak_tokens_held", "{:d}"),
        ("pressure", "pressure_passes", "{:d}"),
        ("needles", "needle_accuracy", "{:.2f}"),
        ("idle ok", "idle_check_ok", "{}"),
    ]
    print(f"{'run':<9}" + "".join(f"{title:>11}" for title, _, _ in columns))
    for name, row in rows.items():
        cells = []
        for _, key, fmt in columns:
            value = row.get(key)
            cells.append(f"{'-' if value is None else fmt.format(value):>11}")
        print(f"{name:<9}" + "".join(cells))


if __name__ == "__main__":
    sys.exit(main())
