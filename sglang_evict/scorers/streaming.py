"""``streaming``: sinks + recency only (StreamingLLM, Xiao et al. 2024; tinfer mode 1).

The score is the logical position: selection keeps the protected sinks and window and
fills the rest of the budget with the most recent tokens, so a pass keeps exactly the
sinks plus the newest ``budget - sinks`` tokens. Reads no key, no query.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from sglang_evict.scorers.base import BatchKVView, KVView, Scorer


@dataclass(frozen=True, kw_only=True)
class StreamingScorer(Scorer):
    name = "streaming"
    graph_safe = True

    def score(self, view: KVView) -> Tensor:
        # Positions are exact in float32 up to 2**24 tokens; no normalisation needed.
        return view.positions.float()

    def batch_scores(self, view: BatchKVView) -> Tensor:
        return view.positions.float()
