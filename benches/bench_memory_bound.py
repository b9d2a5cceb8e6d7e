"""Memory-bound serving in SGLang's real engine: how many long generations run at once
when the pool, not the batch size, is the limit.

One run starts three engines, one after another over the same checkpoint (the model
``sglang-evict demo`` builds offline), pool and workload, and gives each the machine
alone:

    plain      SGLang as shipped (no --radix-cache-backend)
    evict      --radix-cache-backend sglang-evict --kv-admission sglang: eviction, with
               SGLang's admission arithmetic (it reserves the rest of max_new_tokens)
    bounded    --radix-cache-backend sglang-evict (--kv-admission bounded, the default):
               admission sees each evicting request's bounded KV

The pool holds about ``--pool-requests`` full-length requests (prompt + max_new_tokens);
``--requests`` requests each generate ``--new-tokens`` tokens (EOS ignored), many times
the budget. Everything reported is read off SGLang: its decode log every step
(``#running-req``, ``#token``, ``#queue-req``), each output's ``meta_info``
(``num_retractions``, ``finish_reason``) and its idle memory check (strict, SGLang's
default: an engine whose check fails dies, and the bench says so). Steady state: the
decode steps with requests waiting in the queue (admission is what limits them).

    python3 benches/bench_memory_bound.py                 # about 4 minutes on 2 cores
    python3 benches/bench_memory_bound.py --requests 32 --new-tokens 256   # shorter

It prints a table and the ratios against plain SGLang, writes ``--json`` and a plot
(``--plot``: running requests and KV held over time, the three side by side), and
checks that eviction with and without budget-aware admission produced the same tokens
for every request, and that the first ``--check-alone`` requests produce them run one
at a time: admission changes when a request runs, not what it produces.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

RUNS = ("plain", "evict", "bounded")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=1024, help="max_new_tokens of each")
    parser.add_argument(
        "--pool-requests", type=int, default=4, help="full-length requests the pool holds"
    )
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--cadence", type=int, default=16)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--scorer", default="streaming")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--check-alone", type=int, default=4, help="requests rerun one at a time")
    parser.add_argument("--model", default=None, help="engine model directory (default: built)")
    parser.add_argument("--json", default="bench_memory_bound.json")
    parser.add_argument("--plot", default="bench_memory_bound.png")
    parser.add_argument("--log-dir", default=None, help="engine logs (default: the current dir)")
    return parser.parse_args(argv)


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
    top.set_title(title)
    for axis in (top, bottom):
        axis.grid(alpha=0.3)
        axis.legend()
    save_figure(plt, figure, path)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from sglang_evict.config import EvictionConfig
    from sglang_evict.engine_model import ensure_engine_model
    from sglang_evict.srt.engine_runner import EngineError, EngineProcess, cpu_engine_kwargs
    from sglang_evict.triton_env import use_triton_interpreter_without_gpu

    use_triton_interpreter_without_gpu()
    model_path = ensure_engine_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    prompts = prompts_for(tokenizer, args.requests, args.prompt_tokens)
    page = args.page_size
    pool_tokens = args.pool_requests * (args.prompt_tokens + args.new_tokens + page)
    bound_tokens = args.prompt_tokens + args.budget + args.cadence + page
    kwargs = cpu_engine_kwargs(
        model_path,
        page_size=page,
        max_total_tokens=pool_tokens,
        max_running_requests=args.requests,
    )
    policy = dict(
        kv_budget_tokens=args.budget,
        cadence_tokens=args.cadence,
        window_tokens=args.window,
        sink_tokens=args.sinks,
        scorer=args.scorer,
        page_size=page,
    )
    policies = {
        "plain": None,
        "evict": EvictionConfig(**policy, admission="sglang"),
        "bounded": EvictionConfig(**policy, admission="bounded"),
    }
    sampling = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
    print(
        f"bench_memory_bound: pool {pool_tokens} tokens (~{args.pool_requests} full-length "
        f"requests), {args.requests} requests x ({args.prompt_tokens} prompt + "
        f"{args.new_tokens} new) tokens; budget {args.budget}, cadence {args.cadence}, "
        f"page {page}; bound per evicting request ~{bound_tokens} tokens",
        flush=True,
    )
    log_dir = Path(args.log_dir) if args.log_dir else Path.cwd()
    rows, series, outputs = {}, {}, {}
    for name in RUNS:
        log_path = log_dir / f"bench-memory-bound-{name}.log"
        try:
            with EngineProcess(kwargs, policy=policies[name], log_path=log_path) as engine:
                mark = engine.mark()
                plugin = policies[name] is not None
                checks_before = engine.plugin_state()["idle_checks"] if plugin else 0
                facts, steps, stamps, outs = run_one(
                    name, engine, prompts, sampling, args.check_alone if name == "bounded" else 0
                )
                idle_ok = idle_check_passed(engine, mark, plugin, checks_before)
                state = engine.plugin_state() if plugin else None
        except EngineError as error:
            print(f"bench_memory_bound: {name}: engine error: {error}", file=sys.stderr)
            return 2
        row = summarise(steps, outs, facts["wall_s"], pool_tokens, bound_tokens)
        row["idle_check_ok"] = bool(idle_ok)
        if state is not None:
            row["passes"] = state.get("passes")
            row["pressure_passes"] = state.get("pressure_passes")
            row["plugin_idle_checks"] = state.get("idle_checks")
        rows[name] = row
        series[name] = (stamps, steps)
        outputs[name] = [o["output_ids"] for o in outs]
        if facts["alone"]:
            row["same_alone"] = all(
                a == b for a, b in zip(facts["alone"], outputs[name], strict=False)
            )
    same_tokens = outputs["evict"] == outputs["bounded"]
    _print_table(rows)
    plain, bounded = rows["plain"], rows["bounded"]
    print(
        f"bounded / plain: mean running {bounded['mean_running'] / plain['mean_running']:.2f}x, "
        f"output tokens per minute "
        f"{bounded['output_tokens_per_min'] / plain['output_tokens_per_min']:.2f}x"
    )
    steady = bounded["steady_mean_running"]
    if steady is not None:
        print(
            f"bounded at steady state: {steady:.1f} running (goal >= 0.9 x pool / (prompt + "
            f"budget + cadence + page) = {bounded['steady_target']:.1f}), retractions "
            f"{bounded['retractions']}"
        )
    print(
        f"same tokens with and without budget-aware admission: {same_tokens}; first "
        f"{args.check_alone} requests alone: {bounded.get('same_alone')}"
    )
    Path(args.json).write_text(
        json.dumps(
            {
                "args": vars(args),
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
        f"{args.requests} requests x {args.new_tokens} tokens, pool {pool_tokens} tokens, "
        f"budget {args.budget}"
    )
    if plot(Path(args.plot), series, title):
        print(f"plot: {Path(args.plot).resolve()}")
    return 0


def _print_table(rows: dict) -> None:
    columns = [
        ("peak run", "peak_running", "{:d}"),
        ("mean run", "mean_running", "{:.1f}"),
        ("steady run", "steady_mean_running", "{:.1f}"),
        ("retract", "retractions", "{:d}"),
        ("done", "completed", "{:d}"),
        ("tok/min", "output_tokens_per_min", "{:.0f}"),
        ("peak KV", "peak_tokens_held", "{:d}"),
        ("pressure", "pressure_passes", "{:d}"),
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
