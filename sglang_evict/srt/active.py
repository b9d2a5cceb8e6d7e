"""What every integration surface of the plugin shares inside one scheduler process: the
active manager, its metrics and pass totals (``Active``), and the marker every evicting
radix cache derives from (``EvictingCache``). Imports nothing of ``sglang_evict.srt``,
so the surfaces reach this state without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field


class EvictingCache:
    """Marker base of the plugin's radix cache (``backend.EvictingRadixCache``): a
    surface asks ``isinstance(cache, EvictingCache)`` without importing the backend."""


@dataclass
class PassTotals:
    """Running totals of this scheduler's passes."""

    passes: int = 0
    tokens_evicted: int = 0
    pages_freed: int = 0
    pass_failures: int = 0  # requests of failed passes
    # Failed passes by cause (``sglang_evict.passes.failures``).
    pass_failure_causes: dict = field(default_factory=dict)
    idle_checks: int = 0  # idle-time checks passed (SGLang's own check runs just before)
    pressure_passes: int = 0  # of ``passes``: run early, for a step that could not allocate
    pressure_steps: int = 0  # decode steps that could not allocate with passes to run
    pressure_steps_relieved: int = 0  # of those: the step fitted after them, no retraction
    tier_admission_waits: int = 0  # admissions refused: the tier's arena was promised out
    query_slot_waits: int = 0  # admissions refused: every query slot was held

    def add(self, results, *, pressure: bool = False) -> None:
        for result in results:
            self.passes += 1
            self.pressure_passes += int(pressure)
            self.tokens_evicted += result.tokens_evicted
            self.pages_freed += result.pages_freed


class Active:
    """The manager of this process's evicting cache (one scheduler per process), set by
    the backend's factory."""

    manager = None
    metrics = None
    totals = PassTotals()
