"""What ``bench_memory_bound.py`` runs: the model, each run's policy at the same
per-request KV bytes, and the needle task each configuration keeps.

Per-request KV bytes are planned as the frontier plans them (``quality.real.frontier.
spend``, bytes counted in bfloat16, the serving dtype): ``--kv-fraction`` of a
full-length request's (prompt + ``--new-tokens``). Eviction keeps that many tokens
(``--budget`` overrides); the tier splits the bytes between full-precision tokens and
quantized groups (``--tier``, ``BITS:G/SCORER``). The tier's arena is carved from the
same pool (``--kv-tier-pool-share``) in proportion to what a request holds in each, in
the engine's own KV dtype, so the pool and the arena fill together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

RUNS = ("plain", "ample", "evict", "bounded", "tier")
# ``ample`` (plain SGLang with a pool that holds every request whole: what this machine
# serves when memory does not bind) is asked for by name.
DEFAULT_RUNS = ("plain", "evict", "bounded", "tier")
MODELS = ("tiny", "smollm2")
NEEDLE_NEW_TOKENS = 24
NEEDLE_KINDS = ("code7", "code5", "word", "time")
NEEDLE_DEPTHS = (0.2, 0.5, 0.8)
# Needle prompts the frontier's evaluation does not use (its own start at 1000, its
# development at 0).
NEEDLE_FIRST_INDEX = 3000


@dataclass(frozen=True)
class RunPlan:
    name: str
    config: object | None  # EvictionConfig; None: plain SGLang
    kv_fraction: float  # planned bytes per request over a full-length request's (bf16)
    budget_tokens: int | None
    tier_tokens: int
    whole_pool: bool = False  # a pool holding every request whole, not the bench's


def resolve_model(name: str) -> tuple[Path, str]:
    """``(folder, label)`` of ``--model``: ``tiny`` (the random-weight engine model with
    head dim 64, which the tier's kernels hold), ``smollm2`` (the real model) or a
    folder."""
    if name == "tiny":
        from sglang_evict.models.engine_model import ensure_engine_model

        return ensure_engine_model(variant="head_dim64"), "tiny random-weight model"
    if name == "smollm2":
        from sglang_evict.models.real_model import WEIGHTS_NOTE, ensure_real_model

        return ensure_real_model(), WEIGHTS_NOTE
    folder = Path(name)
    if not (folder / "config.json").is_file():
        raise SystemExit(
            f"bench_memory_bound: --model {name}: not tiny, smollm2 or a model folder "
            f"holding config.json"
        )
    return folder, folder.name


def shape_of(model_path: Path):
    from sglang_evict.quality.real.frontier import Shape

    return Shape.of_folder(model_path)


def plan_runs(args, shape, runs) -> dict[str, RunPlan]:
    """Each run's policy; raises ``SystemExit`` naming the flag when the bytes cannot
    hold a configuration."""
    import torch

    from sglang_evict.config import EvictionConfig
    from sglang_evict.quality.real.frontier import Candidate, spend, tier_ratio

    length = args.prompt_tokens + args.new_tokens
    min_budget = args.sinks + args.window + 1
    common = dict(
        cadence_tokens=args.cadence,
        window_tokens=args.window,
        sink_tokens=args.sinks,
        page_size=args.page_size,
        evict_prompt=True,
        query_window_tokens=args.query_window,
    )
    plans = {
        "plain": RunPlan("plain", None, 1.0, None, 0),
        "ample": RunPlan("ample", None, 1.0, None, 0, whole_pool=True),
    }
    evict = Candidate.parse(f"evict:{args.scorer}")
    try:
        tier = Candidate.parse(args.tier, scorer=args.scorer)
        if tier.bits is None:
            raise ValueError("name a tier format, BITS:G[/SCORER]")
        if args.budget is not None:
            budget = args.budget
        else:
            budget = spend(
                evict, fraction=args.kv_fraction, length=length, shape=shape, min_budget=min_budget
            ).budget_tokens
        tier_spend = spend(
            tier, fraction=args.kv_fraction, length=length, shape=shape, min_budget=min_budget
        )
    except ValueError as error:
        raise SystemExit(f"bench_memory_bound: --tier / --kv-fraction: {error}") from None
    for name, admission in (("evict", "sglang"), ("bounded", "bounded")):
        config = EvictionConfig(
            kv_budget_tokens=budget, scorer=evict.scorer, admission=admission, **common
        )
        plans[name] = RunPlan(name, config, budget / length, budget, 0)
    if "tier" in runs:
        g = tier.group_tokens
        tier_tokens = max(g, tier_spend.tier_tokens // g * g)
        # The arena's share of the pool: a request's tier bytes over all it holds, in
        # the engine's KV dtype (float32 on CPU), so the arena and the pool fill together.
        ratio = tier_ratio(tier, shape, torch.float32)
        full_bound = tier_spend.budget_tokens + g + 2 * args.page_size
        share = tier_tokens * ratio / (full_bound + tier_tokens * ratio)
        plans["tier"] = RunPlan(
            "tier",
            EvictionConfig(
                kv_budget_tokens=tier_spend.budget_tokens,
                scorer=tier.scorer,
                admission="bounded",
                tier_bits=tier.bits,
                tier_group_tokens=g,
                tier_outlier_tokens=tier.outlier_tokens,
                tier_value_group_channels=tier.value_group_channels,
                tier_max_tokens=tier_tokens,
                tier_pool_share=round(min(0.9, max(0.01, share)), 4),
                **common,
            ),
            round(tier_spend.fraction, 4),
            tier_spend.budget_tokens,
            tier_tokens,
        )
    return {name: plans[name] for name in runs}


def needle_samples(tokenizer, count: int, context_tokens: int):
    """``count`` needle prompts of about ``context_tokens`` tokens over the essays:
    every kind at every depth in turn, indexes the frontier never uses."""
    from sglang_evict.models.real_model import ensure_real_text
    from sglang_evict.quality.real.needle import build_samples

    if count <= 0:
        return []
    text = ensure_real_text().read_text(encoding="utf-8")
    per_depth = -(-count // (len(NEEDLE_KINDS) * len(NEEDLE_DEPTHS)))
    samples = build_samples(
        text,
        tokenizer,
        context_sizes=(context_tokens,),
        depths=NEEDLE_DEPTHS,
        per_depth=per_depth,
        first_index=NEEDLE_FIRST_INDEX,
        kinds=NEEDLE_KINDS,
    )
    # interleave kinds and depths so that a short run still sees each
    samples.sort(key=lambda s: (s.index, s.depth, NEEDLE_KINDS.index(s.needle.kind)))
    return samples[:count]


def run_needles(engine, tokenizer, samples, plan: RunPlan, shape, batch: int) -> dict:
    """The needle task through a started engine under its server policy: found
    fraction, the KV bytes each request held at its end (bf16 accounting) and the
    needles missed (kind, depth, the answer given)."""
    from sglang_evict.quality.real.frontier import Candidate, tier_ratio
    from sglang_evict.quality.real.needle import found
    from sglang_evict.request_policy import report_of

    if not samples:
        return {}
    ratio = tier_ratio(Candidate.of_config(plan.config), shape) if plan.tier_tokens else 0.0
    sampling = {"max_new_tokens": NEEDLE_NEW_TOKENS, "temperature": 0}
    hits, held, missed, started = [], [], [], time.monotonic()
    for start in range(0, len(samples), batch):
        chunk = samples[start : start + batch]
        outputs = engine.generate([list(s.prompt_ids) for s in chunk], [sampling] * len(chunk))
        for sample, output in zip(chunk, outputs, strict=True):
            text = tokenizer.decode(output["output_ids"], skip_special_tokens=True)
            hits.append(found(sample.needle, text))
            if not hits[-1]:
                missed.append(
                    {"kind": sample.needle.kind, "depth": sample.depth, "answer": text.strip()}
                )
            total = len(sample.prompt_ids) + len(output["output_ids"]) - 1
            report = report_of(output["meta_info"]) or {}
            if plan.config is None:
                held.append(1.0)
            else:
                full = report.get("kv_tokens_held", total)
                held.append((full + report.get("tier_tokens_held", 0) * ratio) / total)
    return {
        "needles": len(hits),
        "needle_accuracy": sum(hits) / len(hits),
        "needle_held_fraction": sum(held) / len(held),
        "needle_wall_s": round(time.monotonic() - started, 1),
        "needles_missed": missed,
    }
