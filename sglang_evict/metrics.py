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

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

PASSES_TOTAL = "sglang_evict:passes_total"
TOKENS_EVICTED_TOTAL = "sglang_evict:tokens_evicted_total"
PAGES_FREED_TOTAL = "sglang_evict:pages_freed_total"
SLOT_COPIES_TOTAL = "sglang_evict:slot_copies_total"
BYTES_MOVED_TOTAL = "sglang_evict:bytes_moved_total"
PASS_DURATION_SECONDS = "sglang_evict:pass_duration_seconds"
BUDGET_OCCUPANCY_RATIO = "sglang_evict:budget_occupancy_ratio"
PASS_FAILURES_TOTAL = "sglang_evict:pass_failures_total"
# Failed passes since the last committed one (0 while passes commit): what an alert
# watches (``sglang_evict.passes.failures``; the cause is a label of the counter).
PASS_FAILURE_STREAK = "sglang_evict:pass_failure_streak"
# Of the passes: run early because a decode step could not allocate (before retraction).
PRESSURE_PASSES_TOTAL = "sglang_evict:pressure_passes_total"
# With --kv-compactor grpc: 1 while the sidecar serves passes, 0 while passes fall back.
COMPACTOR_UP = "sglang_evict:compactor_up"
COMPACTOR_FALLBACKS_TOTAL = "sglang_evict:compactor_fallbacks_total"
# Pass leases the lease store did not take back (outage); the passes committed anyway.
LEASE_RELEASE_FAILURES_TOTAL = "sglang_evict:lease_release_failures_total"
# Passes completed in-process after the compactor failed once the pass was sent.
PASS_FORCED_COMPLETIONS_TOTAL = "sglang_evict:pass_forced_completions_total"
# With pass CUDA graphs on (``sglang_evict.passes.graphs``): passes replayed, and passes
# that ran eagerly (a shape past the captured set, or a pass that cannot be captured).
PASS_GRAPH_REPLAYS_TOTAL = "sglang_evict:pass_graph_replays_total"
PASS_GRAPH_MISSES_TOTAL = "sglang_evict:pass_graph_misses_total"
# The group size of passes (``--kv-pass-group-steps``; chosen by the server with auto).
PASS_GROUP_STEPS = "sglang_evict:pass_group_steps"
# The quantized tier (``--kv-tier-bits``): tokens and bytes its arena holds now, tokens
# passes quantized into it (whole groups), and tokens it gave up (evicted beyond it).
TIER_TOKENS = "sglang_evict:tier_tokens"
TIER_BYTES = "sglang_evict:tier_bytes"
TIER_TOKENS_QUANTIZED_TOTAL = "sglang_evict:tier_tokens_quantized_total"
TIER_TOKENS_DROPPED_TOTAL = "sglang_evict:tier_tokens_dropped_total"

# Host time of one batched pass (every due request of a decode step): benches/bench_pass.py
# measures 0.3-30 ms on CPU tensors (the device work included there), less on a GPU host.
_DURATION_BUCKETS_S = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 1.0)
# KV held / budget, observed when a pass runs: 1 + cadence/budget is the steady state.
_OCCUPANCY_BUCKETS = (0.25, 0.5, 0.75, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0)


class DeviceTally:
    """Sums of device counters, folded into host ints without the host ever waiting.

    ``add`` queues a non-blocking copy of a device scalar into pinned host memory and
    records an event after it; ``poll`` folds every copy whose event has completed
    (``Event.query`` never blocks) and leaves the rest for a later poll. A pass's slot
    copies are data the pass never reads on the host, so their count reaches
    ``/metrics`` a decode step or two late, never at the cost of a synchronisation.
    Host (CPU) values are folded at once.
    """

    def __init__(self) -> None:
        self._pending: deque = deque()
        self._ready = 0

    def add(self, value: Tensor) -> None:
        if value.device.type != "cuda":
            self._ready += int(value)
            return
        host = torch.empty((), dtype=value.dtype, pin_memory=True)
        host.copy_(value, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._pending.append((done, host))

    def poll(self) -> int:
        """Counts that reached the host since the last poll."""
        total, self._ready = self._ready, 0
        while self._pending and self._pending[0][0].query():
            total += int(self._pending.popleft()[1])
        return total


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
    pass_failure_streak: Any
    pressure_passes: Any
    compactor_up: Any
    compactor_fallbacks: Any
    lease_release_failures: Any
    forced_completions: Any
    graph_replays: Any
    graph_misses: Any
    group_steps: Any
    tier_tokens: Any
    tier_bytes: Any
    tier_tokens_quantized: Any
    tier_tokens_dropped: Any
    scorer: str
    _fallbacks_seen: int = 0
    _release_failures_seen: int = 0
    _forced_seen: int = 0
    _replays_seen: int = 0
    _misses_seen: int = 0
    # strategy -> (slot copies on their way from the device, bytes per slot)
    _copies: dict = field(default_factory=dict)
    _children: dict = field(default_factory=dict)  # (metric id, label values) -> child

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
                "Host time of one batched pass (every due request of a decode step)",
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
            pass_failures=Counter(
                PASS_FAILURES_TOTAL.removesuffix("_total"),
                "Passes that failed and were skipped, by cause (sglang_evict.passes.failures)",
                (*labels, "cause"),
                registry=registry,
            ),
            pass_failure_streak=Gauge(
                PASS_FAILURE_STREAK,
                "Failed passes since the last committed pass (0 while passes commit)",
                registry=registry,
                multiprocess_mode="max",
            ),
            pressure_passes=counter(
                PRESSURE_PASSES_TOTAL,
                "Passes run early because a decode step could not allocate (also in passes)",
            ),
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
            lease_release_failures=Counter(
                LEASE_RELEASE_FAILURES_TOTAL.removesuffix("_total"),
                "Pass leases the lease store did not release (the passes committed)",
                registry=registry,
            ),
            forced_completions=Counter(
                PASS_FORCED_COMPLETIONS_TOTAL.removesuffix("_total"),
                "Passes completed in-process after the compactor failed mid-call",
                registry=registry,
            ),
            graph_replays=Counter(
                PASS_GRAPH_REPLAYS_TOTAL.removesuffix("_total"),
                "Passes replayed as a captured CUDA graph",
                registry=registry,
            ),
            graph_misses=Counter(
                PASS_GRAPH_MISSES_TOTAL.removesuffix("_total"),
                "Passes run eagerly although pass CUDA graphs are on",
                registry=registry,
            ),
            group_steps=Gauge(
                PASS_GROUP_STEPS,
                "Decode steps one pass serves (--kv-pass-group-steps; auto: the choice)",
                registry=registry,
                multiprocess_mode="max",
            ),
            tier_tokens=Gauge(
                TIER_TOKENS,
                "Tokens the quantized tier holds (every running request)",
                registry=registry,
                multiprocess_mode="max",
            ),
            tier_bytes=Gauge(
                TIER_BYTES,
                "Bytes of the quantized tier's groups in use (every layer)",
                registry=registry,
                multiprocess_mode="max",
            ),
            tier_tokens_quantized=Counter(
                TIER_TOKENS_QUANTIZED_TOTAL.removesuffix("_total"),
                "Tokens passes quantized into the tier (whole groups)",
                registry=registry,
            ),
            tier_tokens_dropped=Counter(
                TIER_TOKENS_DROPPED_TOTAL.removesuffix("_total"),
                "Tokens a full tier gave up (evicted beyond the tier)",
                registry=registry,
            ),
            scorer=scorer,
        )

    def record_batch(self, results: list, duration_s: float, *, pressure: bool = False) -> None:
        """Record one batched pass: its ``PassResult``s (one per request) and host time;
        ``pressure``: its passes ran early, for a step that could not allocate.
        Each request's pass counts under the scorer that ranked it and its occupancy
        against its own budget (a per-request policy); the batch's host time, slot
        copies and bytes moved under the server's scorer. Slot copies and bytes moved
        are device counts: queued here, folded in by ``fold_device_counts`` once they
        reached the host."""
        if not results:
            return
        strategy = results[0].strategy
        # Summed per scorer first: a counter moves once per pass, not once per request.
        sums: dict[str, list] = {}
        for result in results:
            scorer = result.scorer or self.scorer
            acc = sums.get(scorer)
            if acc is None:
                acc = sums[scorer] = [0, 0, 0, self._child(self.budget_occupancy, scorer)]
            acc[0] += 1
            acc[1] += result.tokens_evicted
            acc[2] += result.pages_freed
            acc[3].observe(result.tokens_before / result.budget_tokens)
        demoted = sum(r.tokens_demoted for r in results)
        if demoted:
            self.tier_tokens_quantized.inc(demoted)
            self.tier_tokens_dropped.inc(sum(r.tokens_dropped for r in results))
        for scorer, (passes, evicted, freed, _) in sums.items():
            self._child(self.passes, strategy, scorer).inc(passes)
            if pressure:
                self._child(self.pressure_passes, strategy, scorer).inc(passes)
            self._child(self.tokens_evicted, strategy, scorer).inc(evicted)
            self._child(self.pages_freed, strategy, scorer).inc(freed)
        self._child(self.pass_duration, strategy, self.scorer).observe(duration_s)
        tally, _ = self._copies.setdefault(strategy, (DeviceTally(), results[0].bytes_per_slot))
        batches = {id(r.batch_slot_copies): r.batch_slot_copies for r in results}
        for copies in batches.values():  # one tensor per batched pass
            tally.add(copies.sum())
        self.fold_device_counts()

    def _child(self, metric: Any, *label_values: str) -> Any:
        """``metric.labels(*label_values)``, looked up once (a pass's metrics are on the
        decode step's host path; labelled children are never removed)."""
        key = (id(metric), label_values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*label_values)
        return child

    def fold_device_counts(self) -> None:
        """Add the slot copies (and bytes: read + written) that reached the host."""
        for strategy, (tally, bytes_per_slot) in self._copies.items():
            copies = tally.poll()
            self._child(self.slot_copies, strategy, self.scorer).inc(copies)
            self._child(self.bytes_moved, strategy, self.scorer).inc(2 * copies * bytes_per_slot)

    def record_manager(self, manager: Any) -> None:
        """Lease releases that failed and passes completed in-process (host counters of
        an ``EvictionManager``), and the compactor's state."""
        self.pass_failure_streak.set(manager.failures.streak)
        failures = manager.lease.release_failures
        if failures > self._release_failures_seen:
            self.lease_release_failures.inc(failures - self._release_failures_seen)
            self._release_failures_seen = failures
        forced = manager.forced_completions
        if forced > self._forced_seen:
            self.forced_completions.inc(forced - self._forced_seen)
            self._forced_seen = forced
        if manager.compactor is not None:
            self.record_compactor(manager.compactor)
        graphs = manager.graphs
        if graphs is not None:
            if graphs.replays > self._replays_seen:
                self.graph_replays.inc(graphs.replays - self._replays_seen)
                self._replays_seen = graphs.replays
            if graphs.misses > self._misses_seen:
                self.graph_misses.inc(graphs.misses - self._misses_seen)
                self._misses_seen = graphs.misses
        self.group_steps.set(manager.pass_group_steps)
        arena = manager.tier_arena
        if arena is not None:
            held = arena.num_groups - arena.free_groups
            self.tier_tokens.set(held * arena.fmt.group_tokens)
            self.tier_bytes.set(held * arena.nbytes() // (arena.num_groups + 1))

    def record_compactor(self, compactor: Any) -> None:
        """Sidecar health and fallbacks of a ``FallbackCompactor`` (no-op otherwise)."""
        if not hasattr(compactor, "sidecar_up"):
            return
        self.compactor_up.set(1 if compactor.sidecar_up else 0)
        total = compactor.fallback_passes + compactor.skipped_passes
        if total > self._fallbacks_seen:
            self.compactor_fallbacks.labels(mode=compactor.mode).inc(total - self._fallbacks_seen)
            self._fallbacks_seen = total

    def record_failure(self, strategy: str, cause: str) -> None:
        self.pass_failures.labels(strategy=strategy, scorer=self.scorer, cause=cause).inc()
