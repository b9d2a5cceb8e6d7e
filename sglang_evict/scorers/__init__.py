"""Scorers: one small file each, one contract (``base.Scorer.score(view) -> [tokens]``).

A new scorer goes in its own module here: a frozen dataclass subclassing ``Scorer``
with a ``name``, its parameters as fields, and ``head_scores`` (or ``score``); then add
it to ``SCORERS`` below. Selection, budgets and protection are not a scorer's business.

    module              scorer
    base                the contract: ``KVView``, ``Scorer``, head aggregation
    streaming           ``streaming``: sinks and the most recent tokens (StreamingLLM)
    knorm               ``knorm``: keys of low L2 norm kept (Devoto et al. 2024)
    triattention        ``triattention``: RoPE-aware query-statistics scores
    triattention_stats  its calibrated statistics: format, loading, checks
    window              ``window``: attention of the last W queries (SnapKV, TOVA, H2O)
    rkv                 ``rkv``: attention and redundancy (R-KV)
    random_baseline     ``random``: a seeded baseline
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sglang_evict.scorers.base import KVView, Scorer, aggregate_head_scores
from sglang_evict.scorers.knorm import KNormScorer
from sglang_evict.scorers.random_baseline import RandomScorer
from sglang_evict.scorers.rkv import RKVScorer
from sglang_evict.scorers.streaming import StreamingScorer
from sglang_evict.scorers.triattention import TriAttentionScorer
from sglang_evict.scorers.window import WindowScorer

SCORERS: dict[str, type[Scorer]] = {
    cls.name: cls
    for cls in (
        StreamingScorer,
        KNormScorer,
        TriAttentionScorer,
        WindowScorer,
        RKVScorer,
        RandomScorer,
    )
}


def scorer_parameters(name: str) -> list[str]:
    """Parameter names the scorer ``name`` accepts."""
    return [f.name for f in dataclasses.fields(SCORERS[name]) if f.init and f.name != "stats"]


def needs_calibration(name: str) -> bool:
    """Whether scorer ``name`` reads an offline statistics file (``stats_path``, from
    ``sglang-evict calibrate``) and so cannot run without one."""
    return name in SCORERS and "stats_path" in scorer_parameters(name)


def build_scorer(name: str, params: Mapping[str, Any] | None = None) -> Scorer:
    """Construct a registered scorer; unknown names or parameters raise ``ValueError``."""
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; known: {sorted(SCORERS)}")
    params = dict(params or {})
    allowed = scorer_parameters(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"scorer {name!r} has no parameter(s) {unknown}; allowed: {allowed}")
    return SCORERS[name](**params)


__all__ = [
    "SCORERS",
    "KVView",
    "Scorer",
    "aggregate_head_scores",
    "build_scorer",
    "needs_calibration",
    "scorer_parameters",
]
