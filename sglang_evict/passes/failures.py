"""Passes that fail: why (a cause an operator can act on, with the knob), and when the
requests of a failed pass may be tried again.

A pass that fails before anything moved leaves its requests with their full KV; trying
the same requests again at the very next decode step would redo the same scoring for
the same refusal, step after step. So each request of a failed pass backs off: after
its n-th consecutive failure it is not due again for ``2**n`` decode steps (at most
``MAX_BACKOFF_STEPS``); a pass that commits it clears its count. Each cause is logged
once at ERROR with what to change, then counted (``FailureTracker.counts``, the
``cause`` label of ``sglang_evict:pass_failures_total``) and summarised at most every
``SUMMARY_INTERVAL_S``; ``streak`` (``sglang_evict:pass_failure_streak``) is the number
of failed passes since the last committed one, what an alert watches.

Bookkeeping and its log lines: no tensor, no engine; the ``EvictionManager`` owns one.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from compactor_service.compactor import CompactionSkipped, CompactorUnavailable, LeaseRefused
from compactor_service.plan import PlanError
from compactor_service.redis_leases import LeaseStoreUnavailable

logger = logging.getLogger(__name__)

MAX_BACKOFF_STEPS = 256
SUMMARY_INTERVAL_S = 60.0


class LeaseBusy(RuntimeError):
    """The pass lease is held by another grant: the pass did not start moving."""


# (cause, what to change). Order matters: LeaseRefused is a PlanError.
_CAUSES: tuple[tuple[type[BaseException], str, str], ...] = (
    (
        LeaseStoreUnavailable,
        "lease-store-unavailable",
        "the lease store (--kv-lease-store redis) is unreachable; passes resume when it "
        "is back (check the Redis URL and the server), or use --kv-lease-store inprocess",
    ),
    (
        LeaseBusy,
        "lease-busy",
        "another grant holds this scheduler's pass lease: two schedulers share a holder "
        "name in one lease store; give each its own --kv-lease-namespace",
    ),
    (
        LeaseRefused,
        "lease-refused",
        "the compactor refused the pass's lease (a pinned shared page, or a lease that "
        "expired): check that scheduler and compactor use the same --kv-lease-namespace",
    ),
    (
        CompactionSkipped,
        "compactor-down-skipped",
        "the compactor sidecar is down and --kv-compactor-fallback is skip: restart it "
        "(sglang-evict compactor --supervise) or use --kv-compactor-fallback inprocess",
    ),
    (
        CompactorUnavailable,
        "compactor-unavailable",
        "the compactor sidecar did not answer (--kv-compactor-socket/--kv-compactor-"
        "address, --kv-compactor-timeout-ms)",
    ),
    (
        PlanError,
        "plan-refused",
        "a plan was refused as invalid: this is a defect, please report it with the log",
    ),
)
OTHER_CAUSE = ("error", "an unexpected error; please report it with the log")


def classify(error: BaseException) -> tuple[str, str]:
    """``(cause, hint)`` of a failed pass's error."""
    for kind, cause, hint in _CAUSES:
        if isinstance(error, kind):
            return cause, hint
    return OTHER_CAUSE


@dataclass
class FailureTracker:
    """Per-request backoff and per-cause counts of failed passes."""

    clock_s: Callable[[], float] = time.monotonic
    # rid -> (consecutive failures, first decode step at which it may be due again)
    backoff: dict[str, tuple[int, int]] = field(default_factory=dict)
    # rid -> its failed passes since it was admitted (or re-admitted after a retraction):
    # its report's ``passes_failed``. A request with one evicted later than it would have
    # alone, so its tokens may differ from a run without the fault.
    failed_passes: Counter = field(default_factory=Counter)
    counts: Counter = field(default_factory=Counter)
    streak: int = 0
    _logged: set = field(default_factory=set)
    _since_summary: Counter = field(default_factory=Counter)
    _last_summary_s: float = 0.0

    def may_run(self, rid: str, step: int) -> bool:
        entry = self.backoff.get(rid)
        return entry is None or step >= entry[1]

    def failed(self, rids: Iterable[str], error: BaseException, step: int) -> tuple[str, str, bool]:
        """Record a failed pass at decode ``step``; returns ``(cause, hint, first)``,
        ``first`` when this cause was never seen before (log it loudly)."""
        cause, hint = classify(error)
        for rid in rids:
            failures = self.backoff.get(rid, (0, 0))[0] + 1
            self.backoff[rid] = (failures, step + min(2**failures, MAX_BACKOFF_STEPS))
            self.failed_passes[rid] += 1
        self.counts[cause] += 1
        self._since_summary[cause] += 1
        self.streak += 1
        first = cause not in self._logged
        self._logged.add(cause)
        return cause, hint, first

    def succeeded(self, rids: Iterable[str]) -> None:
        for rid in rids:
            self.backoff.pop(rid, None)
        self.streak = 0

    def forget(self, rid: str) -> None:
        self.backoff.pop(rid, None)
        self.failed_passes.pop(rid, None)

    def summary_due(self) -> dict[str, int] | None:
        """The failures by cause since the last summary, once ``SUMMARY_INTERVAL_S``
        has passed since it (None otherwise, or when there were none)."""
        now = self.clock_s()
        if not self._since_summary or now - self._last_summary_s < SUMMARY_INTERVAL_S:
            return None
        summary, self._since_summary = dict(self._since_summary), Counter()
        self._last_summary_s = now
        return summary

    def note_failure(self, rids: list[str], error: Exception, step: int) -> None:
        """Record a failed pass of ``rids`` at decode ``step`` (``failed``) and say it:
        loudly, with the knob, the first time its cause is seen; afterwards at most in
        a periodic summary."""
        cause, hint, first = self.failed(rids, error, step)
        if first:
            logger.error(
                "sglang-evict: a pass of %d request(s) failed (%s): %s. Fix: %s. Its "
                "requests keep their full KV and back off; further failures of this cause "
                "are counted (pass_failures_total{cause=%r}) and summarised every minute",
                len(rids),
                cause,
                error,
                hint,
                cause,
            )
        summary = self.summary_due()
        if summary and not first:
            logger.warning(
                "sglang-evict: passes failed in the last minute, by cause: %s (%d failed "
                "passes in a row now)",
                summary,
                self.streak,
            )
