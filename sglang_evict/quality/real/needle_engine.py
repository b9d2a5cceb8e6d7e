"""The needle task in SGLang's real engine on the real model: plain SGLang against every
server scorer at every budget, on the same prompts, through the path a user runs.

Engines (``srt.engine_runner.EngineProcess``, the CPU settings on a machine without a
GPU), one at a time (2 cores: two at once only slow each other):

    plain          SGLang without the plugin: the full cache
    evicting       ``--kv-evict-prompt``, the server's scorer ``rkv`` (query capture on),
                   so each request may choose any scorer that reads captured queries or
                   none, and its own budget (per-request policy: ``custom_params``)
    triattention   its own engine with the model's calibrated statistics (a request
                   cannot bring a statistics file)

A request's budget is a fraction of its own prompt's length. Its prompt is compressed
at its first pass, from its second decode step on (the overlap scheduler inserts the
prompt after the first decode batch is launched): the first two answer tokens are
decoded from the full cache, every later one from the survivors. The answer is the
greedy continuation (``MAX_NEW_TOKENS``), found when it contains the needle's code.

Every answer is kept in ``answers`` keyed by ``(method, budget, sample)``, so a run
resumes where it stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sglang_evict.quality.real.needle import NeedleSample, found
from sglang_evict.request_policy import report_of

PLAIN = "plain"
MAX_NEW_TOKENS = 32
QUERY_SERVER_SCORER = "rkv"
MAX_RUNNING_REQUESTS = 8


@dataclass(frozen=True)
class NeedlePolicy:
    """What every evicting run shares (the budget aside)."""

    page_size: int = 16
    sink_tokens: int = 4
    window_tokens: int = 32
    cadence_tokens: int = 16
    query_window_tokens: int = 32


def budget_for(sample: NeedleSample, fraction: float) -> int:
    return max(1, round(fraction * len(sample.prompt_ids)))


def answer_key(method: str, fraction: float, sample: NeedleSample) -> str:
    return f"{method}|{fraction:g}|{sample.key}"


def _engine_kwargs(model_path: Path, policy: NeedlePolicy, samples: Sequence[NeedleSample]):
    from sglang_evict.srt.engine_runner import cpu_engine_kwargs

    longest = max(len(s.prompt_ids) for s in samples)
    tokens = MAX_RUNNING_REQUESTS * (longest + MAX_NEW_TOKENS + 2 * policy.page_size) + 512
    kwargs = cpu_engine_kwargs(
        model_path,
        page_size=policy.page_size,
        max_total_tokens=tokens,
        max_running_requests=MAX_RUNNING_REQUESTS,
    )
    import torch

    if torch.cuda.is_available():
        kwargs.update(device="cuda", attention_backend=None, dtype="auto", model_impl="auto")
    return kwargs


def _server_config(policy: NeedlePolicy, scorer: str, max_budget: int, stats: str | None):
    from sglang_evict.config import EvictionConfig

    return EvictionConfig(
        kv_budget_tokens=max_budget,
        cadence_tokens=policy.cadence_tokens,
        sink_tokens=policy.sink_tokens,
        window_tokens=policy.window_tokens,
        scorer=scorer,
        scorer_params={"stats_path": stats} if stats else {},
        evict_prompt=True,
        page_size=policy.page_size,
        query_window_tokens=policy.query_window_tokens,
    )


def run_needle(
    model_path: Path,
    samples: Sequence[NeedleSample],
    methods: Sequence[str],
    fractions: Sequence[float],
    answers: dict,
    *,
    policy: NeedlePolicy = NeedlePolicy(),
    triattention_stats: str | None = None,
    save: Callable[[], None] = lambda: None,
    progress: bool = True,
    log_dir: Path | None = None,
) -> dict:
    """Fill ``answers`` (``answer_key`` -> record) for plain SGLang and every method x
    fraction over ``samples``; calls ``save`` after each engine's batch. Returns
    ``answers``."""
    from tqdm import tqdm

    from sglang_evict.srt.engine_runner import EngineProcess

    groups: list[tuple[str, object, list[tuple[str, float]]]] = [(PLAIN, None, [(PLAIN, 1.0)])]
    query_methods = [m for m in methods if m != "triattention"]
    max_fraction = max(fractions)
    max_budget = max(budget_for(s, max_fraction) for s in samples)
    if query_methods:
        config = _server_config(policy, QUERY_SERVER_SCORER, max_budget, None)
        groups.append(("evicting", config, [(m, f) for m in query_methods for f in fractions]))
    if "triattention" in methods:
        if triattention_stats is None:
            raise ValueError("triattention needs statistics of the model (--triattention-stats)")
        config = _server_config(policy, "triattention", max_budget, triattention_stats)
        groups.append(("triattention", config, [("triattention", f) for f in fractions]))
    total = sum(len(runs) for *_, runs in groups) * len(samples)
    bar = tqdm(
        total=total,
        initial=sum(1 for k in answers if k.split("|")[0] in {*methods, PLAIN}),
        desc="needle",
        unit="answer",
        disable=not progress,
        dynamic_ncols=True,
    )
    kwargs = _engine_kwargs(model_path, policy, samples)
    try:
        for name, config, runs in groups:
            todo = [
                (method, fraction, sample)
                for method, fraction in runs
                for sample in samples
                if answer_key(method, fraction, sample) not in answers
            ]
            if not todo:
                continue
            log = (log_dir or Path.cwd()) / f"needle-{name}.log"
            bar.set_postfix_str(f"starting the {name} engine")
            engine = EngineProcess(kwargs, policy=config, log_path=log).start()
            try:
                for start in range(0, len(todo), MAX_RUNNING_REQUESTS):
                    chunk = todo[start : start + MAX_RUNNING_REQUESTS]
                    bar.set_postfix_str(f"{name}: {chunk[0][0]} budget {chunk[0][1]:g}")
                    answer_batch(engine, chunk, answers)
                    bar.update(len(chunk))
                    save()
            finally:
                engine.close()
    finally:
        bar.close()
    return answers


def answer_batch(engine, chunk, answers: dict) -> None:
    """One batch of requests on ``engine``; records each answer."""
    from transformers import AutoTokenizer

    tokenizer = _tokenizer(engine, AutoTokenizer)
    sampling = []
    for method, fraction, sample in chunk:
        params = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}
        if method != PLAIN:
            overrides = {"kv_budget_tokens": budget_for(sample, fraction)}
            if method != "triattention":
                overrides["scorer"] = method
            params["custom_params"] = {"sglang_evict": overrides}
        sampling.append(params)
    started = time.perf_counter()
    outputs = engine.generate([list(s.prompt_ids) for _, _, s in chunk], sampling)
    seconds = (time.perf_counter() - started) / len(chunk)
    for (method, fraction, sample), output in zip(chunk, outputs, strict=True):
        text = tokenizer.decode(output["output_ids"], skip_special_tokens=True)
        report = report_of(output["meta_info"]) or {}
        answers[answer_key(method, fraction, sample)] = {
            "method": method,
            "budget_fraction": fraction,
            "budget_tokens": None if method == PLAIN else budget_for(sample, fraction),
            "context_tokens": sample.context_tokens,
            "prompt_tokens": len(sample.prompt_ids),
            "depth": sample.depth,
            "index": sample.index,
            "code": sample.needle.code,
            "found": found(sample.needle, text),
            "answer": text[:200],
            "passes": report.get("passes", 0),
            "peak_kv_tokens": report.get("peak_kv_tokens"),
            "seconds": round(seconds, 2),
        }


_TOKENIZERS: dict = {}


def _tokenizer(engine, auto):
    path = engine.engine_kwargs["model_path"]
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = auto.from_pretrained(path)
    return _TOKENIZERS[path]


def summarise(answers: dict, methods: Sequence[str], fractions: Sequence[float]) -> list[dict]:
    """Accuracy per (method, fraction, context size) and over every context size, with
    plain SGLang's on the same prompts."""
    rows = []
    contexts = sorted({a["context_tokens"] for a in answers.values()})
    for method, fraction in [(PLAIN, 1.0)] + [(m, f) for m in methods for f in fractions]:
        for context in [*contexts, None]:
            chosen = [
                a
                for a in answers.values()
                if a["method"] == method
                and a["budget_fraction"] == fraction
                and (context is None or a["context_tokens"] == context)
            ]
            if not chosen:
                continue
            rows.append(
                {
                    "task": "needle",
                    "engine": "sglang-evict" if method != PLAIN else "sglang",
                    "method": method,
                    "budget_fraction": fraction,
                    "context_tokens": context,
                    "accuracy": sum(a["found"] for a in chosen) / len(chosen),
                    "num_prompts": len(chosen),
                    "mean_peak_kv_tokens": _mean(a["peak_kv_tokens"] for a in chosen),
                }
            )
    return rows


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None
