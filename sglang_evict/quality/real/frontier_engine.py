"""The frontier's needle task through SGLang's real engine (``eval-tier --engine``):
plain SGLang, eviction and the quantized tier at the same KV-bytes fractions, on the
frontier's prompts, through the path a user runs (``sglang_evict.srt``: the arena
carved from SGLang's KV pool, the tier's attention merged in the decode step).

Two engines, one at a time (2 cores), the CPU settings on a machine without a GPU:

    plain    SGLang without the plugin: the full cache
    plugin   the tier on (the tier candidate's bits, group and scorer; the bound and the
             budget the largest any request needs), the prompt evictable; every request
             brings its own split of the bytes (``frontier.spend``) as ``custom_params``:
             ``kv_budget_tokens`` and ``tier_tokens`` (0 for eviction alone) and its
             scorer

A request's prompt is compressed at its first pass, from its second decode step on:
the first two answer tokens come from the full cache, every later one from what the
pass kept. Bytes held are read off each request's report when it ends
(``kv_tokens_held``, ``tier_tokens_held``), counted in bfloat16 as the frontier counts
them, over the request's tokens then.

Answers land in ``results["engine_needle"]`` keyed by what decides them, so a run
resumes where it stopped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from sglang_evict.quality.real.frontier import Candidate, Shape, spend, tier_ratio

ENGINE_CANDIDATES = ("evict:rkv", "3:32/rkv")  # eviction's best scorer and the rule's tier
MAX_RUNNING_REQUESTS = 8
CADENCE_TOKENS = 64
QUERY_WINDOW_TOKENS = 32
TIER_POOL_SHARE = 0.25
PLAIN = "plain"


def engine_key(sample, name: str, fraction: float | None, max_new_tokens: int) -> str:
    return f"{sample.key}|engine|{name}|{fraction}|{max_new_tokens}"


def _tier_candidate(candidates: Sequence[Candidate]) -> Candidate:
    tiers = {c for c in candidates if c.bits is not None}
    if len(tiers) != 1:
        raise ValueError(
            f"--engine-candidates: exactly one tier candidate (one engine runs one tier "
            f"format); got {sorted(c.name for c in tiers) or 'none'}"
        )
    return tiers.pop()


def plan_requests(samples, candidates, fractions, shape: Shape, *, min_budget: int):
    """``(sample, candidate or None, fraction, Spend or None, skipped reason)`` for plain
    and every candidate x fraction."""
    plans = [(s, None, None, None, None) for s in samples]
    for sample in samples:
        length = len(sample.prompt_ids) + 1  # the pass runs with the first answer token
        for candidate in candidates:
            for fraction in fractions:
                try:
                    spent = spend(
                        candidate,
                        fraction=fraction,
                        length=length,
                        shape=shape,
                        min_budget=min_budget,
                    )
                except ValueError as error:
                    plans.append((sample, candidate, fraction, None, str(error)))
                    continue
                plans.append((sample, candidate, fraction, spent, None))
    return plans


def server_config(tier: Candidate, plans, *, page_size: int, sink_tokens: int, window_tokens: int):
    from sglang_evict.config import EvictionConfig

    spends = [p[3] for p in plans if p[3] is not None]
    g = tier.group_tokens
    max_tier = max((s.tier_tokens for s in spends), default=g)
    return EvictionConfig(
        kv_budget_tokens=max(s.budget_tokens for s in spends),
        cadence_tokens=CADENCE_TOKENS,
        sink_tokens=sink_tokens,
        window_tokens=window_tokens,
        scorer=tier.scorer,
        evict_prompt=True,
        page_size=page_size,
        query_window_tokens=QUERY_WINDOW_TOKENS,
        tier_bits=tier.bits,
        tier_group_tokens=g,
        tier_outlier_tokens=tier.outlier_tokens,
        tier_value_group_channels=tier.value_group_channels,
        tier_max_tokens=max(g, -(-max_tier // g) * g),
        tier_pool_share=TIER_POOL_SHARE,
    )


def run_engine_needles(
    model_path: Path,
    tokenizer,
    samples,
    shape: Shape,
    settings,
    results: dict,
    save,
    *,
    page_size: int,
    sink_tokens: int,
    window_tokens: int,
    progress: bool = True,
    log_dir: Path | None = None,
) -> dict:
    """Fill ``results["engine_needle"]`` for plain SGLang and every engine candidate x
    fraction of ``settings``; ``save()`` after each batch."""
    from tqdm import tqdm

    from sglang_evict.srt.engine_runner import EngineProcess, cpu_engine_kwargs

    answers = results.setdefault("engine_needle", {})
    candidates = [Candidate.parse(c) for c in settings.engine_candidates]
    tier = _tier_candidate(candidates)
    if tier is not None:  # one server window: a tier server's covers the model's windows
        window_tokens = max(window_tokens, shape.window_tokens)
    plans = plan_requests(
        samples,
        candidates,
        settings.fractions,
        shape,
        min_budget=sink_tokens + window_tokens + 1,
    )
    new_tokens = settings.max_new_tokens
    for sample, candidate, fraction, _, skipped in plans:
        if skipped:
            answers[engine_key(sample, candidate.name, fraction, new_tokens)] = {
                "sample": sample.key,
                "candidate": candidate.name,
                "fraction": fraction,
                "skipped": skipped,
            }
    todo = [
        p
        for p in plans
        if p[4] is None
        and engine_key(p[0], p[1].name if p[1] else PLAIN, p[2], new_tokens) not in answers
    ]
    config = server_config(
        tier, plans, page_size=page_size, sink_tokens=sink_tokens, window_tokens=window_tokens
    )
    longest = max(len(s.prompt_ids) for s in samples)
    tokens = MAX_RUNNING_REQUESTS * (longest + new_tokens + 2 * page_size) + 512
    bar = tqdm(total=len(todo), desc="engine needle", unit="answer", disable=not progress)
    try:
        for name, engine_config, runs in (
            (PLAIN, None, [p for p in todo if p[1] is None]),
            ("plugin", config, [p for p in todo if p[1] is not None]),
        ):
            if not runs:
                continue
            pool = tokens if engine_config is None else int(tokens / (1 - TIER_POOL_SHARE))
            kwargs = cpu_engine_kwargs(
                model_path,
                page_size=page_size,
                max_total_tokens=pool,
                max_running_requests=MAX_RUNNING_REQUESTS,
            )
            log = (log_dir or Path.cwd()) / f"engine-needle-{name}.log"
            bar.set_postfix_str(f"starting the {name} engine")
            engine = EngineProcess(kwargs, policy=engine_config, log_path=log).start()
            try:
                for start in range(0, len(runs), MAX_RUNNING_REQUESTS):
                    chunk = runs[start : start + MAX_RUNNING_REQUESTS]
                    _answer(engine, tokenizer, chunk, answers, shape, new_tokens)
                    bar.update(len(chunk))
                    save()
            finally:
                engine.close()
    finally:
        bar.close()
    return answers


def _answer(engine, tokenizer, chunk, answers: dict, shape: Shape, new_tokens: int) -> None:
    from sglang_evict.quality.real.needle import found
    from sglang_evict.request_policy import report_of

    sampling = []
    for _, candidate, _, spent, _ in chunk:
        params = {"max_new_tokens": new_tokens, "temperature": 0}
        if candidate is not None:
            overrides = {
                "kv_budget_tokens": spent.budget_tokens,
                "scorer": candidate.scorer,
                "tier_tokens": spent.tier_tokens if candidate.bits is not None else 0,
            }
            params["custom_params"] = {"sglang_evict": overrides}
        sampling.append(params)
    started = time.perf_counter()
    outputs = engine.generate([list(p[0].prompt_ids) for p in chunk], sampling)
    seconds = (time.perf_counter() - started) / len(chunk)
    for (sample, candidate, fraction, spent, _), output in zip(chunk, outputs, strict=True):
        text = tokenizer.decode(output["output_ids"], skip_special_tokens=True)
        report = report_of(output["meta_info"]) or {}
        total = len(sample.prompt_ids) + len(output["output_ids"]) - 1  # KV of all but the last
        held = 1.0
        if candidate is not None:
            r = tier_ratio(candidate, shape) if candidate.bits is not None else 0.0
            full = report.get("kv_tokens_held", total)
            held = (full + report.get("tier_tokens_held", 0) * r) / total
        name = PLAIN if candidate is None else candidate.name
        answers[engine_key(sample, name, fraction, new_tokens)] = {
            "sample": sample.key,
            "kind": sample.needle.kind,
            "prompt_tokens": len(sample.prompt_ids),
            "candidate": "full" if candidate is None else candidate.name,
            "fraction": fraction,
            "planned_fraction": 1.0 if spent is None else round(spent.fraction, 4),
            "held_fraction_at_end": round(held, 4),
            "budget_tokens": spent and spent.budget_tokens,
            "tier_tokens": spent and spent.tier_tokens,
            "kv_tokens_held": report.get("kv_tokens_held"),
            "tier_tokens_held": report.get("tier_tokens_held"),
            "passes": report.get("passes", 0),
            "found": found(sample.needle, text),
            "answer": text[:120],
            "seconds": round(seconds, 2),
        }


def summarise(answers: dict, max_new_tokens: int) -> list[dict]:
    """Per (candidate, fraction): answers, needles found, mean planned and at-end bytes
    held; plain SGLang's row first."""
    rows: dict[tuple, list[dict]] = {}
    for key, answer in answers.items():
        if not key.endswith(f"|{max_new_tokens}") or "found" not in answer:
            continue
        rows.setdefault((answer["candidate"], answer["fraction"]), []).append(answer)
    table = []
    for (name, fraction), items in sorted(
        rows.items(), key=lambda kv: (kv[0][0] != "full", -(kv[0][1] or 1.0), kv[0][0])
    ):
        table.append(
            {
                "candidate": name,
                "fraction": fraction,
                "answers": len(items),
                "needles": round(sum(a["found"] for a in items) / len(items), 3),
                "planned_fraction": round(
                    sum(a["planned_fraction"] for a in items) / len(items), 3
                ),
                "held_fraction_at_end": round(
                    sum(a["held_fraction_at_end"] for a in items) / len(items), 3
                ),
            }
        )
    return table


def markdown(table: list[dict]) -> str:
    lines = [
        "| through SGLang's engine | KV bytes | needles found | bytes held (planned, at the end) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for row in table:
        fraction = "full" if row["fraction"] is None else f"{row['fraction']:g}"
        lines.append(
            f"| {row['candidate']} | {fraction} | {row['needles']:.2f} ({row['answers']}) | "
            f"{row['planned_fraction']:.3f}, {row['held_fraction_at_end']:.3f} |"
        )
    return "\n".join(lines)
