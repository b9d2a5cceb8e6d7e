"""``sglang-evict demo``: SGLang's real engine on this machine, with eviction and without,
side by side in one run, on the small model the project builds offline.

Two engines start at once (``sglang.Engine``, radix cache and overlap scheduler on; on a
machine without a GPU with the CPU settings of ``engine_runner.cpu_engine_kwargs``): one
with ``--radix-cache-backend sglang-evict`` and the policy from the flags, one plain.
Both generate the same requests (sharing a system prompt). What is printed and plotted
is read off SGLang's own accounting, its decode log (``#token``: the KV tokens held by
running requests, every decode step); passes and pages freed are the plugin's report
in SGLang's ``get_server_info``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from sglang_evict.cli import _use_triton_interpreter_without_gpu
from sglang_evict.cli_flags import config_from_args

DEFAULT_PLOT = "sglang-evict-demo.png"


def run(args: argparse.Namespace) -> int:
    _use_triton_interpreter_without_gpu()
    from transformers import AutoTokenizer

    from sglang_evict.engine_model import ensure_engine_model
    from sglang_evict.srt.engine_runner import (
        EngineError,
        EngineProcess,
        cpu_engine_kwargs,
        server_flags,
    )
    from sglang_evict.srt.server_args import (
        check_startup,
        model_facts_from_server_args,
        parse_server_args,
    )

    config = config_from_args(args)
    model_path = ensure_engine_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    prompts = _prompts(tokenizer, args.requests, args.prompt_tokens)
    page_size = config.page_size
    pool_tokens = args.requests * (args.prompt_tokens + args.new_tokens + 2 * page_size) + 256
    # As many request slots as requests: the query ring of window/rkv holds one row each.
    kwargs = cpu_engine_kwargs(
        model_path,
        page_size=page_size,
        max_total_tokens=pool_tokens,
        max_running_requests=args.requests,
    )
    if not _cpu_only():
        kwargs.update(device="cuda", attention_backend=None, dtype="auto", model_impl="auto")
    # The server's own startup checks, before anything starts (one line on a refusal).
    server_args = parse_server_args(server_flags(kwargs), dry_run=True)
    check_startup(server_args, config, model_facts_from_server_args(server_args))
    print(
        f"demo: SGLang's engine with and without eviction, {args.requests} requests sharing a "
        f"system prompt, {len(prompts[0])}-token prompts, {args.new_tokens} new tokens each; "
        f"page size {page_size}, budget {config.kv_budget_tokens}, cadence "
        f"{config.cadence_tokens}, scorer {config.scorer}, compaction {config.compaction}"
    )
    log_dir = Path(args.log_dir) if args.log_dir else Path.cwd()
    evicting = EngineProcess(kwargs, policy=config, log_path=log_dir / "demo-evicting.log")
    plain = EngineProcess(kwargs, policy=None, log_path=log_dir / "demo-plain.log")
    started = time.monotonic()
    print("starting both engines (about a minute on 2 CPU cores) ...", flush=True)
    try:
        for engine in (evicting, plain):
            engine.launch()
        for engine in (evicting, plain):
            engine.wait_ready()
        print(f"engines ready after {time.monotonic() - started:.0f} s", flush=True)
        sampling = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
        named = {"with eviction": evicting, "without (plain SGLang)": plain}
        marks = {name: engine.mark() for name, engine in named.items()}
        _generate_with_progress(named, prompts, sampling, args.new_tokens)
        runs = {}
        for name, engine in named.items():
            steps = engine.decode_steps(marks[name])
            while steps and steps[-1].tokens_held == 0:  # logged after the batch finished
                steps.pop()
            runs[name] = (steps, engine.plugin_state())
    except EngineError as error:
        print(f"sglang-evict demo: error: {error}", file=sys.stderr)
        return 2
    finally:
        for engine in (evicting, plain):
            engine.close()
    _report(runs, page_size, args)
    return 0


def _cpu_only() -> bool:
    import torch

    return not torch.cuda.is_available()


def _prompts(tokenizer, num_requests: int, prompt_tokens: int) -> list[list[int]]:
    system = tokenizer("You are a helpful assistant. Answer step by step.")["input_ids"]
    filler = tokenizer(" Explain the cache, the pages and the budget.")["input_ids"]
    system = (system + filler * prompt_tokens)[: max(1, prompt_tokens // 2)]
    prompts = []
    for i in range(num_requests):
        question = tokenizer(f" Question {i}: tell me a long story.")["input_ids"]
        tail = (question * prompt_tokens)[: prompt_tokens - len(system)]
        prompts.append(system + tail)
    return prompts


def _generate_with_progress(engines: dict, prompts, sampling, new_tokens: int) -> None:
    """Generate on every engine at once (one worker thread each: the engines are separate
    processes, so on 2 cores the two runs take the time of one); one bar per engine
    follows its SGLang decode log."""
    from tqdm import tqdm

    from sglang_evict.srt.engine_runner import parse_decode_steps

    errors: list[BaseException] = []

    def work(engine):
        try:
            engine.generate(prompts, sampling)
        except BaseException as error:  # re-raised in the caller's thread
            errors.append(error)

    starts = {name: engine.log_path.stat().st_size for name, engine in engines.items()}
    workers = [threading.Thread(target=work, args=(e,), daemon=True) for e in engines.values()]
    bars = {
        name: tqdm(
            total=new_tokens,
            desc=f"{name:<24}",
            unit="step",
            leave=False,
            position=position,
            file=sys.stdout,
            mininterval=1.0,
        )
        for position, name in enumerate(engines)
    }
    for worker in workers:
        worker.start()
    try:
        while any(worker.is_alive() for worker in workers):
            time.sleep(0.5)
            for name, engine in engines.items():
                with open(engine.log_path, "rb") as log:
                    log.seek(starts[name])
                    steps = len(parse_decode_steps(log.read().decode(errors="replace")))
                bars[name].update(min(steps, new_tokens) - bars[name].n)
    finally:
        for bar in bars.values():
            bar.close()
    if errors:
        raise errors[0]


def _report(runs: dict, page_size: int, args: argparse.Namespace) -> None:
    (with_name, (with_steps, report)), (without_name, (without_steps, _)) = runs.items()
    num_requests = args.requests

    def peaks(steps):
        busy = [s for s in steps if s.running_requests == num_requests] or steps
        total = max(s.tokens_held for s in busy)
        per_request = max(s.tokens_held / s.running_requests for s in busy)
        return total, per_request

    total_on, per_on = peaks(with_steps)
    total_off, per_off = peaks(without_steps)
    print(
        f"passes {report['passes']}, tokens evicted {report['tokens_evicted']}, "
        f"pages freed {report['pages_freed']} (plugin's report in SGLang's get_server_info)"
    )
    compactor = report.get("compactor")
    if compactor:
        print(
            f"compactor: {compactor['sidecar_passes']} passes by the sidecar, "
            f"{compactor['fallback_passes']} completed in-process"
        )
    print("peak KV held, from SGLang's decode log (#token: running requests + radix tree):")
    print(f"  {'':<24}{'total tokens':>14}{'per request':>13}{'pages':>8}")
    for name, total, per in ((with_name, total_on, per_on), (without_name, total_off, per_off)):
        print(f"  {name:<24}{total:>14}{per:>13.0f}{-(-total // page_size):>8}")
    print(f"  with eviction: {total_on / total_off:.2f} of the full cache")
    plot_path = Path(args.plot)
    if _plot(plot_path, runs, page_size):
        print(f"plot of KV held per decode step: {plot_path.resolve()}")


def _plot(path: Path, runs: dict, page_size: int) -> bool:
    from sglang_evict.plotting import pyplot_or_none, save_figure

    plt = pyplot_or_none()
    if plt is None:
        return False
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for name, (steps, _) in runs.items():
        axis.plot([s.tokens_held for s in steps], label=name)
    axis.set_xlabel("decode step")
    axis.set_ylabel("KV tokens held (SGLang #token)")
    axis.set_title(f"KV held per decode step, page size {page_size}")
    axis.grid(alpha=0.3)
    axis.legend()
    save_figure(plt, figure, path)
    return True
