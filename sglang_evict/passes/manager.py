"""The eviction mechanism: owns per-request state and runs batched passes on a paged
KV pool.

Policy (scorers, selection, planning: ``sglang_evict.passes.batch``) is pure; this module
(with ``sglang_evict.passes.device_work``, a pass's device work, and ``sglang_evict.passes.graphs``,
its replay as a CUDA graph) is where state changes: it reads the due requests' rows,
has the policy choose and plan on the device, moves the slots, commits the new rows and
frees pages. It talks to the
engine only through ``KVPoolAccess``, which the SGLang adapter implements.

One pass per decode step, for every due request
-----------------------------------------------
``run_batch_pass`` costs the host O(1) per request and never reads device data:

    host                                        device (the pool's stream)
    counts per request (``passes.batch.counts``)
    one packed copy of the per-request ints ->  rows, positions, protection masks
                                                scores [R, N] -> keep [R, N]
    staging pages claimed (repack)          ->  plan [R, K]: new rows, moves, releases
    one lease for the moves                     one repack launch (padding moves skipped)
    lease released (a failure is logged and counted, never skips the commit)
    commit: lengths, state                  ->  rows, positions table, offsets written;
                                                pages released to the allocator

The pass lease (fencing token) is taken only around the moves, after scoring and
planning, so a pass never loses it to its own scoring time, however long: in-process
the moves follow the grant at once; with the sidecar its TTL covers a call's deadline
(``sglang_evict.passes.lease``) and it is renewed before each further call of a split pass.
A pass that fails before anything moved leaves its requests with their full KV and
backs them off (``sglang_evict.passes.failures``: not due again for 2, 4, 8 ... decode
steps), so a refusal never repeats the same work at every step; each cause is logged
once with the knob that fixes it.

Moving the slots, in-process or through the gRPC sidecar, and completing a pass a
sidecar failure cut short: ``sglang_evict.passes.moves``.

Per-request state and positions
-------------------------------
A request that never had a pass has no state: row entry i holds logical position i.
After a pass, the first ``compacted_len`` row entries have their logical positions in
``positions_by_row`` (a device table shaped like SGLang's ``req_to_token``: one row per
request-pool row); entries appended later continue from there:

    row index:   0 .. compacted_len-1          | compacted_len .. kv_len-1
    position:    positions_by_row[row, i]      | i + position_offset

so the next token's logical position is ``kv_len + position_offset``: the offset the
decode hook adds to SGLang's positions (``offsets_by_row``). The table is int32, the
same bytes as ``req_to_token`` (positions stay below 2^31, as SGLang's slot indices
do): ``[request rows, context]`` x 4 bytes, 16 MiB for 256 rows of 16k tokens. Reading
it on the host (``positions``, ``intact_prefix_len``) synchronises: tests, and the
finish path, never the pass.

Captured queries and carried scores
-----------------------------------
Query-reading scorers (``window``, ``rkv``) read the requests' last ``W`` queries from
the ``query_ring`` (``sglang_evict.query_capture``), indexed by request-pool row: the
server's attention writes it (``sglang_evict.srt.capture``), the CPU loop through
``record_queries``. A scorer that adds scores across passes (``window`` mode
``cumulative``) gets each entry's carried score from ``accumulated_by_row`` (float32,
shaped like the positions table, valid for the first ``compacted_len`` entries); a
pass stores every survivor's score there, moved with it.

Invariants (tests call ``check_request`` after every operation): positions are
distinct and below the next position; the appended tail is contiguous; the
protected ranges the host counts rely on (``passes.batch.counts``) are held in full;
and a request's tier groups hold distinct positions below the next, none of them also
held in full precision.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from compactor_service import tracing
from compactor_service.compactor import Compactor, LeaseClaim
from compactor_service.leases import LeaseStore
from sglang_evict.config import EvictionConfig
from sglang_evict.passes.batch import (
    BatchPlan,
    PassCounts,
    batch_strategy,
    pass_counts,
)
from sglang_evict.passes.batch.counts import BatchCounts, protected_count
from sglang_evict.passes.batch.inputs import host_columns
from sglang_evict.passes.batch.shapes import pass_shape
from sglang_evict.passes.device_work import (
    PassStep,
    commit_writes,
    device_pass,
    pad_claimed,
    score_and_plan,
)
from sglang_evict.passes.failures import FailureTracker
from sglang_evict.passes.graphs import PassGraphs, PassKey
from sglang_evict.passes.grouping import AUTO, GroupChoice
from sglang_evict.passes.host_work import (
    PassWork,
    check_rows,
    commit_states,
    pass_results,
    pass_work,
)
from sglang_evict.passes.lease import PassLease
from sglang_evict.passes.moves import claim_staging, move_slots
from sglang_evict.passes.state import (
    DueRequest,
    KVPoolAccess,
    PassResult,
    RequestState,
)
from sglang_evict.query_capture import QueryRing
from sglang_evict.request_policy import RequestLimits, RequestPolicy, default_policy
from sglang_evict.scorers import Scorer, build_scorer
from sglang_evict.tier import demotion as tier_demotion
from sglang_evict.tier.arena import TierArena
from sglang_evict.tier.policy import TierPolicy, due_cold_tokens
from sglang_evict_kernels import device_int64

__all__ = [
    "DueRequest",
    "EvictionManager",
    "KVPoolAccess",
    "PassResult",
    "RequestState",
]


@dataclass
class EvictionManager:
    """Runs batched passes and keeps every running request's ``RequestState``, keyed by
    request id. ``pool`` is the engine's; the manager never holds KV tensors.

    ``compactor``: None moves slots in-process on the pool's device (the default);
    otherwise a ``Compactor`` taking host plans (the gRPC sidecar with its fallback).
    """

    config: EvictionConfig
    pool: KVPoolAccess
    compactor: Compactor | None
    num_request_rows: int
    row_capacity: int  # columns of the request-to-token pool (longest row)
    device: str | torch.device = "cpu"
    # Combines this rank's [R, N] scores with the other tensor-parallel ranks' (each
    # holds different KV heads) so every rank keeps the same survivors; None: one rank.
    score_reducer: Callable[[Tensor], Tensor] | None = None
    # Score with the scorer's pool-reading kernel when it has one (no key gather);
    # None: when the pool is on a GPU (on CPU Triton runs only under its interpreter).
    use_pool_kernels: bool | None = None
    # Pass leases (fencing tokens) and shared-page pins; None: off (``self.lease``).
    leases: LeaseStore | None = None
    lease_holder: str = "scheduler"
    # The stream the model's forward runs on (SGLang's forward_stream); a pass orders
    # itself after the in-flight forward on it (``order_after_forward``).
    forward_stream: object | None = None
    forced_completions: int = 0  # passes completed in-process after a failure mid-RPC
    # What a request may ask of this server (sglang_evict.request_policy); the adapter
    # sets it (the scorers a request may choose depend on the server).
    request_limits: RequestLimits | None = None
    states: dict[str, RequestState] = field(default_factory=dict)
    # The requests' captured queries, by request-pool row (query-reading scorers).
    query_ring: QueryRing | None = None
    decode_steps: int = 0  # decode steps counted by ``open_pass_step``
    # Failed passes: per-request backoff, counts by cause (``sglang_evict.passes.failures``).
    failures: FailureTracker = field(default_factory=FailureTracker)
    # Pad passes to bucketed shapes (``passes.batch.shapes``); False: exact shapes, the
    # reference ``tests/test_static_shape_pass.py`` holds the padded pass to.
    static_shapes: bool = True
    # The quantized tier's storage (``sglang_evict.tier.arena``), attached by whoever
    # sized it (the driver, the engine adapter) when the config asks for a tier.
    tier_arena: TierArena | None = None
    # Tier demotions the sidecar could not take, by cause (``tier.demotion``).
    tier_fallbacks: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if self.config.page_size != self.pool.page_size:
            raise ValueError(
                f"config page_size {self.config.page_size} != engine page size "
                f"{self.pool.page_size}"
            )
        self.device = torch.device(self.device)
        self.scorer = self.config.make_scorer()
        config = self.config
        # The sidecar checks the token when a call arrives: the lease covers a call.
        ttl_ms = config.lease_ttl_ms
        if self.compactor is not None:
            ttl_ms = max(ttl_ms, 2 * config.compactor_timeout_ms)
        self.lease = PassLease(self.leases, self.lease_holder, ttl_ms)
        # The policy of requests that override nothing, and the scorers requests chose
        # (built once each, with their default parameters; the server's with its own).
        self.default_policy = default_policy(self.config)
        self._scorers: dict[str, Scorer] = {self.config.scorer: self.scorer}
        # Decode positions are ``seq_lens - 1 + offsets_by_row[req_pool_indices]``.
        self.offsets_by_row = torch.zeros(
            self.num_request_rows, dtype=torch.int64, device=self.device
        )
        self.positions_by_row = torch.zeros(
            self.num_request_rows, self.row_capacity, dtype=torch.int32, device=self.device
        )
        # Candidate tokens scored NaN or +-inf (NaN ones were evicted first), on device.
        self.nonfinite_scores_device = torch.zeros((), dtype=torch.int64, device=self.device)
        self.bytes_per_slot = sum(
            b[0].numel() * b.element_size() for b in (*self.pool.k_buffers, *self.pool.v_buffers)
        )
        # ``--kv-pass-group-steps auto``: the server's choice (``passes.grouping``).
        self.group_choice = GroupChoice() if config.pass_group_steps == AUTO else None
        # Passes replayed as CUDA graphs (``sglang_evict.passes.graphs``); None: eager.
        self.graphs = None
        if config.pass_cuda_graph and self.device.type != "cuda":
            raise ValueError(
                f"pass_cuda_graph needs the KV pool on a CUDA device (it is on "
                f"{self.device.type}); leave --kv-pass-cuda-graph off"
            )
        if config.pass_cuda_graph is not False and self.device.type == "cuda":
            self.graphs = PassGraphs(
                self.device, pool_limit_bytes=config.pass_graph_pool_mib * 2**20
            )
        # The tier's format and per-request bound (``sglang_evict.tier.policy``).
        self.tier_policy = None
        fmt = config.tier_format(self.pool.k_buffers[0].shape[-1])
        if fmt is not None:
            self.tier_policy = TierPolicy(fmt, config.tier_max_tokens)
        self.accumulated_by_row = None
        if self.scorer.carries_scores:
            self.accumulated_by_row = torch.zeros(
                self.num_request_rows, self.row_capacity, dtype=torch.float32, device=self.device
            )

    # --- queries (host reads of device data: tests and the finish path only) --------

    def position_offset(self, rid: str) -> int:
        state = self.states.get(rid)
        return 0 if state is None else state.position_offset

    def positions(self, rid: str, kv_len: int) -> Tensor:
        """int64 CPU logical position of each of the first ``kv_len`` row entries."""
        state = self.states.get(rid)
        if state is None:
            return torch.arange(kv_len)
        if kv_len < state.compacted_len:
            raise ValueError(f"kv_len {kv_len} is below the compacted length {state.compacted_len}")
        head = self.positions_by_row[state.req_pool_idx, : state.compacted_len]
        tail = torch.arange(state.compacted_len, kv_len) + state.position_offset
        return torch.cat([head.to("cpu", torch.int64), tail])

    def intact_prefix_len(self, rid: str, kv_len: int) -> int:
        """Length of the longest row prefix whose entry i holds position i: the part of
        the row that still equals an uncompacted cache of the same tokens."""
        positions = self.positions(rid, kv_len)
        mismatch = torch.nonzero(positions != torch.arange(kv_len), as_tuple=True)[0]
        return int(mismatch[0]) if mismatch.numel() else kv_len

    def num_tracked_requests(self) -> int:
        """Requests with eviction state, tier groups or failed passes counted (none once
        every request has finished)."""
        rids = set(self.states) | self.failures.failed_passes.keys()  # backoff's are in it
        if self.tier_arena is not None:
            rids |= set(self.tier_arena.owned)
        return len(rids)

    def first_evicted_position(self, rid: str, kv_len: int) -> int | None:
        """The smallest logical position no longer held (None: nothing evicted)."""
        state = self.states.get(rid)
        if state is None:
            return None
        held = torch.zeros(kv_len + state.position_offset + 1, dtype=torch.bool)
        held[self.positions(rid, kv_len)] = True
        return int(torch.nonzero(~held)[0])

    def scorer_for(self, name: str) -> Scorer:
        """The scorer ``name`` (the server's own instance for the server's scorer)."""
        scorer = self._scorers.get(name)
        if scorer is None:
            scorer = self._scorers[name] = build_scorer(name)
        return scorer

    def counts(
        self,
        rid: str,
        kv_len: int,
        num_shared: int,
        prompt_len: int,
        policy: RequestPolicy | None = None,
    ) -> PassCounts:
        """What a pass would do to this request now (host ints only); ``policy`` None:
        the server's."""
        config = self.config
        policy = policy or self.default_policy
        return pass_counts(
            kv_len=kv_len,
            position_offset=self.position_offset(rid),
            num_shared=num_shared,
            prompt_len=prompt_len,
            page_size=config.page_size,
            budget=policy.kv_budget_tokens,
            sink_tokens=config.sink_tokens,
            protected_tokens=config.protected_tokens,
            window_tokens=config.window_tokens,
            evict_prompt=config.evict_prompt,
        )

    def lead_end(self, kv_len: int, num_shared: int, prompt_len: int) -> int:
        """``counts(...).lead_end`` alone (admission asks it of every running request
        at every scheduling round: a few host ints, no counts object)."""
        return self._protected(kv_len, 0, num_shared, prompt_len)[2]

    def is_due(
        self,
        rid: str,
        kv_len: int,
        num_shared: int,
        prompt_len: int,
        policy: RequestPolicy | None = None,
    ) -> bool:
        """A pass is due once it would evict at least ``cadence`` tokens (O(1), no
        counts object: every running request asks at every decode step); never for a
        request whose policy turns eviction off."""
        policy = policy or self.default_policy
        if not policy.enabled:
            return False
        tier = self.tier_policy if policy.tier_tokens else None
        cadence = due_cold_tokens(policy.cadence_tokens, tier)
        budget = policy.kv_budget_tokens
        if kv_len < budget + cadence:  # survivors >= budget: never due
            return False
        if not self.failures.may_run(rid, self.decode_steps):  # backing off after a failure
            return False
        state = self.states.get(rid)
        offset = 0 if state is None else state.position_offset
        num_protected = self._protected(kv_len, offset, num_shared, prompt_len)[4]
        return kv_len - max(budget, num_protected) >= cadence  # kv_len - survivors

    def _protected(
        self, kv_len: int, position_offset: int, num_shared: int, prompt_len: int
    ) -> tuple[int, int, int, int, int]:
        """``protected_count`` under this server's config."""
        c = self.config
        return protected_count(
            kv_len,
            position_offset,
            num_shared,
            prompt_len,
            c.page_size,
            c.sink_tokens,
            c.protected_tokens,
            c.window_tokens,
            c.evict_prompt,
        )

    # --- shared-page pins ------------------------------------------------------------

    def pin_shared_pages(self, slots: Tensor, pin: bool) -> None:
        """Pin (or unpin) the pages holding ``slots`` in the lease store, under this
        scheduler's holder name: called as radix-tree nodes become locked (or
        unlocked), never on the pass path. A compactor checking leases refuses any plan
        touching a page pinned by another holder. A store outage is counted
        (``lease.pin_failures``), never raised: SGLang's lock path must not fail."""
        self.lease.pin_pages(slots, self.config.page_size, pin)

    # --- state changes ---------------------------------------------------------------

    def forget(self, rid: str) -> None:
        """Drop a request's state (finish, abort, or retraction: a retracted request is
        re-prefilled from its tokens, so its KV is regular again)."""
        state = self.states.pop(rid, None)
        if state is not None:
            self.offsets_by_row[state.req_pool_idx] = 0
        if self.tier_arena is not None:
            self.tier_arena.release(rid)
        if self.query_ring is not None:
            self.query_ring.release(rid)
        self.failures.forget(rid)

    def record_queries(self, req_pool_idx: int, queries: Tensor, positions: Tensor) -> None:
        """Keep a request's newest queries (``[layers, tokens, q_heads, head_dim]``, after
        RoPE, at logical ``positions [tokens]``) in the query ring's row
        ``req_pool_idx``: the CPU loop's forward (a server's attention writes the ring
        itself, ``sglang_evict.srt.capture``)."""
        if self.query_ring is None:
            raise ValueError(
                "this manager has no query ring: give the driver the model's query heads "
                "(MemoryDriver num_q_heads) or run a scorer that reads no queries"
            )
        self.query_ring.record(req_pool_idx, queries, positions)

    def decode_positions(self, req_pool_indices: Tensor, seq_lens: Tensor) -> Tensor:
        """Logical positions of the tokens a decode batch generates: SGLang derives
        ``seq_lens - 1`` (after its +1); each request adds its offset."""
        base = (seq_lens - 1).clamp(min=0).to(torch.int64)
        return self.shift_positions(base, req_pool_indices)

    def shift_positions(self, positions: Tensor, req_pool_indices: Tensor) -> Tensor:
        """``positions`` (one per request, SGLang's ``seq_lens - 1``) plus each
        request's offset: two tensor operations. Every offset is 0 while no request
        has state (``states`` empty), so callers may skip this then."""
        rows = req_pool_indices.to(self.offsets_by_row.device).long()
        return positions + self.offsets_by_row[rows].to(positions.device)

    def order_after_forward(self) -> None:
        """Make the current stream (the scheduler's) wait, on the device, for the work
        already queued on the forward stream: the in-flight forward still writes the
        newest token's KV and reads every row the pass rewrites. The host does not wait.
        No-op on CPU, where every operation completes before the next starts."""
        if self.forward_stream is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_stream(self.forward_stream)

    @property
    def pass_group_steps(self) -> int:
        """Decode steps one pass serves now (``--kv-pass-group-steps``; with ``auto``
        the server's current choice, ``sglang_evict.passes.grouping``)."""
        if self.group_choice is not None:
            return self.group_choice.steps
        return self.config.pass_group_steps

    def open_pass_step(self) -> bool:
        """Count a decode step; whether its due requests' passes run now: on every
        ``pass_group_steps``-th step, so the requests that fell due since the last one
        share one pass. With ``auto`` the host time since the last step (passes left
        out) feeds the choice."""
        self.decode_steps += 1
        if self.group_choice is not None:
            self.group_choice.step_at(time.perf_counter())
        return self.decode_steps % self.pass_group_steps == 0

    def run_batch_pass(self, due: Sequence[DueRequest]) -> list[PassResult]:
        """Evict and compact every due request in one pass; one result per request that
        had anything to evict. Raises (``ValueError``/``RuntimeError`` and subclasses)
        only when nothing moved: the requests keep their full KV. Once slots may have
        moved, the pass always commits (module docstring)."""
        start = time.perf_counter()
        if not due:
            return []
        work = pass_work(due, self.states, self.default_policy, self.config)
        evicting = work.counts.tokens_evicted > 0
        if not evicting.all():
            work = work.take(np.flatnonzero(evicting).tolist())
        if not work.due:
            return []
        due, policies, counts = work.due, work.policies, work.counts
        check_rows(work, self.num_request_rows, self.row_capacity)
        names = sorted({p.scorer for p in policies})
        readers = [name for name in names if self.scorer_for(name).needs_queries]
        if readers and self.query_ring is None:
            raise ValueError(
                f"scorer {readers[0]!r} needs the requests' captured queries, but no "
                f"query ring is attached; query capture must run in the attention"
            )
        with tracing.tracer().start_as_current_span(tracing.SPAN_PASS) as span:
            recording = span.is_recording()  # the sums below only for a recorded span
            if recording:
                span.set_attribute(tracing.ATTR_REQUESTS, len(due))
                span.set_attribute(tracing.ATTR_TOKENS_BEFORE, int(counts.kv_len.sum()))
                span.set_attribute(tracing.ATTR_SCORER, ",".join(names))
            try:
                self.lease.check_up()
                results = self._run(work, start, span)
            except BaseException as error:
                span.set_attribute(tracing.ATTR_OUTCOME, f"failed: {type(error).__name__}")
                if isinstance(error, Exception):
                    self.failures.note_failure([d.rid for d in due], error, self.decode_steps)
                raise
            self.failures.succeeded(d.rid for d in due)
            if self.group_choice is not None:  # a capture is a one-off cost, not a pass's
                self.group_choice.note_pass(time.perf_counter() - start, captured=work.captured)
            span.set_attribute(tracing.ATTR_OUTCOME, "committed")
            if recording:
                span.set_attribute(tracing.ATTR_TOKENS_AFTER, int(counts.survivors.sum()))
                span.set_attribute(tracing.ATTR_PAGES_FREED, int(counts.pages_freed.sum()))
                span.set_attribute(tracing.ATTR_STRATEGY, results[0].strategy)
        return results

    # --- the pass --------------------------------------------------------------------

    def _run(self, work: PassWork, start: float, span) -> list[PassResult]:
        counts = work.counts
        strategy, staging_counts = batch_strategy(
            self.config.compaction, counts, self.pool.available_pages
        )
        use = self.use_pool_kernels
        by_name = {}
        scorers = [
            by_name.get(p.scorer) or by_name.setdefault(p.scorer, self.scorer_for(p.scorer))
            for p in work.policies
        ]
        graphable = self._graphable(scorers)
        shape = pass_shape(
            counts,
            staging_counts,
            page_size=self.config.page_size,
            row_capacity=self.row_capacity,
            static=self.static_shapes or graphable,
        )
        pad = shape.requests - len(counts)
        step = PassStep(
            shape=shape,
            strategy=strategy,
            scorers=tuple(scorers) + (scorers[0],) * pad,
            use_pool_kernels=self.device.type == "cuda" if use is None else use,
            with_queries=any(s.needs_queries for s in scorers),
            lengths=tuple(counts.kv_len.tolist()) + (0,) * pad,
            current_positions=tuple(counts.next_position.tolist()) + (0,) * pad,
        )
        packed = host_columns(
            row_of_request=work.rows,
            compacted_lens=work.compacted_lens,
            counts=counts,
            staging_counts=staging_counts,
            shape=shape,
        )
        demotion = []  # the tier's part of the pass, prepared before the moves
        on_keep = None
        if self.tier_policy is not None:
            on_keep = lambda view, keep, scores: demotion.append(  # noqa: E731
                tier_demotion.prepare_pass(self, work, view, keep, scores)
            )
        total_staging = int(staging_counts.sum())
        num_released = int(counts.pages_freed.sum()) + total_staging
        claimed = claim_staging(self.pool, total_staging)
        try:
            if graphable:
                key = PassKey(
                    shape, scorers[0].name, strategy, step.use_pool_kernels, step.with_queries
                )
                work.captured = self.graphs.will_capture(key)
                lease = self.lease.acquire()  # the replay holds the moves
                if lease is not None:
                    span.set_attribute(tracing.ATTR_FENCING_TOKEN, lease.token)
                try:
                    release, copies = self.graphs.run(
                        key, packed, claimed, lambda p, s: self._device_pass(step, p, s)
                    )
                finally:
                    self.lease.release(lease)
                written = None
            else:
                if self.graphs is not None:
                    self.graphs.miss()
                packed_device = device_int64(packed, self.device)
                staging_device = pad_claimed(claimed, shape.staging_total, self.device)
                columns, rows_raw, scores, plan = score_and_plan(
                    self, step, packed_device, staging_device, on_keep=on_keep
                )
                lease = self.lease.acquire()  # only around the moves (``passes.lease``)
                if lease is not None:
                    span.set_attribute(tracing.ATTR_FENCING_TOKEN, lease.token)
                try:
                    prepared = demotion[0] if demotion else None
                    fields = prepared.plan_fields() if prepared and prepared.sidecar else None
                    with tracing.tracer().start_as_current_span(tracing.SPAN_RPC):
                        copies = self._move(plan, counts, self.lease.claim(lease), fields)
                finally:
                    self.lease.release(lease)
                written = (columns, rows_raw, plan, scores)
        except BaseException:
            if claimed is not None:  # nothing moved: the staging pages go back
                self.pool.release_pages(claimed)
            raise
        with tracing.tracer().start_as_current_span(tracing.SPAN_COMMIT):
            if written is not None:
                commit_writes(self, *written)
                release = written[2].release
            self.pool.release_pages(release[:num_released])
            commit_states(self.states, work)
            if demotion and demotion[0] is not None:
                tier_demotion.commit(self.tier_arena, demotion[0])
        duration_s = time.perf_counter() - start
        results = pass_results(work, scorers, strategy, copies, duration_s, self.bytes_per_slot)
        if demotion and demotion[0] is not None:
            tier_demotion.note_results(results, demotion[0], self.tier_policy.group_tokens)
        return results

    def _graphable(self, scorers: list[Scorer]) -> bool:
        """Whether this pass is replayed as a CUDA graph (``sglang_evict.passes.graphs``):
        graphs on, moves in-process, one rank, and one scorer whose batched form reads
        device data only."""
        if self.graphs is None or self.tier_policy is not None:
            return False
        return (
            self.compactor is None
            and self.score_reducer is None
            and all(s is scorers[0] for s in scorers)
            and scorers[0].graph_safe
        )

    def _device_pass(self, step: PassStep, packed: Tensor, staging: Tensor):
        """``passes.device_work.device_pass`` on this manager: what a replayed pass runs."""
        return device_pass(self, step, packed, staging)

    def _move(
        self, plan: BatchPlan, counts: BatchCounts, claim: LeaseClaim | None, demotions=None
    ) -> Tensor:
        """``moves.move_slots`` on this manager's pool and compactor (``demotions``: the
        sidecar's part of the tier's demotion, ``tier.demotion.Demotion.plan_fields``)."""
        copies, forced = move_slots(
            self.pool, self.compactor, self.lease, plan, counts, claim, demotions
        )
        self.forced_completions += forced
        return copies

    # --- invariants ------------------------------------------------------------------

    def check_request(self, rid: str, kv_len: int) -> None:
        """Raise ``AssertionError`` if a request's state breaks the module's invariants."""
        state = self.states.get(rid)
        if state is None:
            return
        positions = self.positions(rid, kv_len)
        next_position = kv_len + state.position_offset
        if torch.unique(positions).numel() != kv_len:
            raise AssertionError(f"request {rid}: repeated logical positions")
        if kv_len and int(positions.max()) >= next_position:
            raise AssertionError(f"request {rid}: a position is beyond the next token's")
        held = set(positions.tolist())
        c = self.counts(rid, kv_len, state.num_shared, state.prompt_len, state.policy)
        protected = set(range(min(c.lead_end, next_position))) | set(
            range(c.window_start, next_position)
        )
        if not protected <= held:
            missing = sorted(protected - held)[:8]
            raise AssertionError(f"request {rid}: protected positions {missing} are not held")
        if self.tier_arena is not None:
            tiered = [p for group in self.tier_arena.positions_of(rid) for p in group]
            if len(set(tiered)) != len(tiered) or min(tiered, default=0) < 0:
                raise AssertionError(f"request {rid}: its tier groups repeat or miss positions")
            if set(tiered) & held:
                both = sorted(set(tiered) & held)[:8]
                raise AssertionError(f"request {rid}: positions {both} in the tier and in full")
            if tiered and max(tiered) >= next_position:
                raise AssertionError(f"request {rid}: a tier position is beyond the next token's")
