"""Eviction metrics, exported on SGLang's ``/metrics`` when it runs with
``--enable-metrics``.

SGLang aggregates every process's metrics through Prometheus' multiprocess directory
(``PROMETHEUS_MULTIPROC_DIR``, set before its subprocesses start); metrics created in
the scheduler process on the default registry land there. ``prometheus_client`` is
imported only when metrics are created, after that variable is set. Names are defined
once here and never reuse SGLang's own (``sglang:*evict*`` are its radix-cache
eviction metrics).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PASSES_TOTAL = "sglang_evict:passes_total"
TOKENS_EVICTED_TOTAL = "sglang_evict:tokens_evicted_total"
PAGES_FREED_TOTAL = "sglang_evict:pages_freed_total"
SLOT_COPIES_TOTAL = "sglang_evict:slot_copies_total"
BYTES_MOVED_TOTAL = "sglang_evict:bytes_moved_total"
PASS_DURATION_SECONDS = "sglang_evict:pass_duration_seconds"
BUDGET_OCCUPANCY_RATIO = "sglang_evict:budget_occupancy_ratio"
PASS_FAILURES_TOTAL = "sglang_evict:pass_failures_total"
# With --kv-compactor grpc: 1 while the sidecar serves passes, 0 while passes fall back.
COMPACTOR_UP = "sglang_evict:compactor_up"
COMPACTOR_FALLBACKS_TOTAL = "sglang_evict:compactor_fallbacks_total"

# Pass durations: a CPU pass over a few thousand tokens takes ~1-50 ms, a GPU pass less.
_DURATION_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
# KV held / budget, observed when a pass runs: 1 + cadence/budget is the steady state.
_OCCUPANCY_BUCKETS = (0.25, 0.5, 0.75, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0)


@dataclass
class EvictionMetrics:
    """Prometheus metrics of one scheduler process (labels: strategy, scorer)."""

    passes: Any
    tokens_evicted: Any
    pages_freed: Any
    slot_copies: Any
    bytes_moved: Any
    pass_duration: Any
    budget_occupancy: Any
    pass_failures: Any
    compactor_up: Any
    compactor_fallbacks: Any
    scorer: str
    _fallbacks_seen: int = 0

    @classmethod
    def create(cls, scorer: str, registry: Any = None) -> EvictionMetrics:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        registry = REGISTRY if registry is None else registry
        labels = ("strategy", "scorer")

        def counter(name: str, doc: str) -> Any:
            return Counter(name.removesuffix("_total"), doc, labels, registry=registry)

        return cls(
            passes=counter(PASSES_TOTAL, "Eviction passes run"),
            tokens_evicted=counter(TOKENS_EVICTED_TOTAL, "KV tokens evicted by passes"),
            pages_freed=counter(PAGES_FREED_TOTAL, "KV pages returned to the allocator"),
            slot_copies=counter(SLOT_COPIES_TOTAL, "KV slots copied by compaction"),
            bytes_moved=counter(BYTES_MOVED_TOTAL, "KV bytes read + written by compaction"),
            pass_duration=Histogram(
                PASS_DURATION_SECONDS,
                "Duration of one request's pass",
                labels,
                buckets=_DURATION_BUCKETS_S,
                registry=registry,
            ),
            budget_occupancy=Histogram(
                BUDGET_OCCUPANCY_RATIO,
                "Request KV tokens / budget when its pass runs",
                ("scorer",),
                buckets=_OCCUPANCY_BUCKETS,
                registry=registry,
            ),
            pass_failures=counter(PASS_FAILURES_TOTAL, "Passes that failed and were skipped"),
            compactor_up=Gauge(
                COMPACTOR_UP,
                "1 while the compactor sidecar serves passes, 0 while they fall back",
                registry=registry,
                multiprocess_mode="max",
            ),
            compactor_fallbacks=Counter(
                COMPACTOR_FALLBACKS_TOTAL.removesuffix("_total"),
                "Passes the sidecar could not serve (completed in-process or skipped)",
                ("mode",),
                registry=registry,
            ),
            scorer=scorer,
        )

    def record(self, result: Any, budget_tokens: int) -> None:
        """Record one ``PassResult``."""
        labels = {"strategy": result.strategy, "scorer": self.scorer}
        self.passes.labels(**labels).inc()
        self.tokens_evicted.labels(**labels).inc(result.tokens_evicted)
        self.pages_freed.labels(**labels).inc(result.pages_freed)
        self.slot_copies.labels(**labels).inc(result.slot_copies)
        self.bytes_moved.labels(**labels).inc(result.bytes_moved)
        self.pass_duration.labels(**labels).observe(result.duration_s)
        self.budget_occupancy.labels(scorer=self.scorer).observe(
            result.tokens_before / budget_tokens
        )

    def record_compactor(self, compactor: Any) -> None:
        """Sidecar health and fallbacks of a ``FallbackCompactor`` (no-op otherwise)."""
        if not hasattr(compactor, "sidecar_up"):
            return
        self.compactor_up.set(1 if compactor.sidecar_up else 0)
        total = compactor.fallback_passes + compactor.skipped_passes
        if total > self._fallbacks_seen:
            self.compactor_fallbacks.labels(mode=compactor.mode).inc(total - self._fallbacks_seen)
            self._fallbacks_seen = total

    def record_failure(self, strategy: str) -> None:
        self.pass_failures.labels(strategy=strategy, scorer=self.scorer).inc()
