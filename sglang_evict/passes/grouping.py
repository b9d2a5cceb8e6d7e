"""How many decode steps one pass serves: fixed, or chosen by the server (``auto``).

A pass costs the host about the same whether one request or sixty-four are due
(``docs/performance.md``), and SGLang's scheduler waits for it between two decode steps.
Running passes on every N-th step only (``--kv-pass-group-steps N``) divides that cost
by up to N, and a request due in between holds up to N-1 more tokens, which bounded
admission counts (``sglang_evict.admission``).

``auto`` picks N from what the server measures: the mean host time of its passes and
of its decode steps. The pass's share of step time with group size N is

    share(N) = pass_s / (N * step_s)

and ``auto`` picks the smallest N with ``share(N) <= TARGET_SHARE`` (1 %), at most
``AUTO_MAX_GROUP_STEPS``: the bound admission counts for ``auto``, so any N it picks is
already paid for. It starts at 1, re-chooses every ``RECHOOSE_STEPS`` decode steps once
it has seen a pass, and says each change in the log (``GroupChoice``).

This module is policy: arithmetic over what the mechanism
(``sglang_evict.passes.manager.EvictionManager.open_pass_step``) measures, and the log
line of each change.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

AUTO = "auto"
TARGET_SHARE = 0.01  # the pass's share of decode-step time auto keeps under
AUTO_MAX_GROUP_STEPS = 32  # the most steps auto groups (admission counts this bound)
RECHOOSE_STEPS = 64  # decode steps between two choices
_EMA = 0.2  # weight of the newest sample in the running means

logger = logging.getLogger(__name__)


def choose_group_steps(
    pass_s: float, step_s: float, *, max_steps: int = AUTO_MAX_GROUP_STEPS
) -> int:
    """The smallest N in ``[1, max_steps]`` with ``pass_s / (N * step_s) <= TARGET_SHARE``
    (``max_steps`` when none is)."""
    if pass_s <= 0:
        return 1
    if step_s <= 0:
        return max_steps
    return max(1, min(max_steps, math.ceil(pass_s / (TARGET_SHARE * step_s))))


@dataclass
class GroupChoice:
    """The running means and the current choice of an ``auto`` server."""

    steps: int = 1
    pass_s: float = 0.0  # mean host time of a pass
    step_s: float = 0.0  # mean host time of a decode step, passes excluded
    passes_seen: int = 0
    steps_seen: int = 0
    last_step_at_s: float | None = None  # host clock at the last decode step
    pass_s_since_step: float = 0.0  # passes' host time since then (not a step's)

    def note_pass(self, seconds: float, *, captured: bool = False) -> None:
        """Count a pass's host time; a pass that captured a CUDA graph (a one-off
        cost) is left out of the mean, never counted as a decode step's time."""
        if not captured:
            self.pass_s = seconds if not self.passes_seen else _mix(self.pass_s, seconds)
            self.passes_seen += 1
        self.pass_s_since_step += seconds

    def step_at(self, now_s: float) -> None:
        """A decode step starts at host time ``now_s``: the time since the last one,
        passes left out, is a step's; each change of the choice is logged."""
        if self.last_step_at_s is not None:
            if self.note_step(now_s - self.last_step_at_s - self.pass_s_since_step):
                logger.info(
                    "sglang-evict: pass group steps (auto) now %d: passes %.3f ms, "
                    "decode steps %.3f ms of host time on average (%s)",
                    self.steps,
                    self.pass_s * 1e3,
                    self.step_s * 1e3,
                    "pass share of step time under 1 %"
                    if self.steps < AUTO_MAX_GROUP_STEPS
                    else f"the largest group auto takes, {AUTO_MAX_GROUP_STEPS}",
                )
        self.last_step_at_s, self.pass_s_since_step = now_s, 0.0

    def note_step(self, seconds: float) -> bool:
        """Count a decode step's host time; True when the choice changed."""
        if seconds > 0:
            self.step_s = seconds if not self.steps_seen else _mix(self.step_s, seconds)
        self.steps_seen += 1
        if not self.passes_seen or self.steps_seen % RECHOOSE_STEPS:
            return False
        chosen = choose_group_steps(self.pass_s, self.step_s)
        changed, self.steps = chosen != self.steps, chosen
        return changed

    def report(self) -> dict:
        share = self.pass_s / (self.steps * self.step_s) if self.step_s > 0 else None
        return {
            "pass_group_steps": self.steps,
            "mean_pass_host_ms": round(self.pass_s * 1e3, 4),
            "mean_step_host_ms": round(self.step_s * 1e3, 4),
            "pass_share_of_step": None if share is None else round(share, 5),
        }


def _mix(mean: float, sample: float) -> float:
    return (1 - _EMA) * mean + _EMA * sample
