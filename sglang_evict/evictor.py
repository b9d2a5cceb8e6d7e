"""The eviction mechanism: owns per-request state and runs passes on a paged KV pool.

Policy (scorers, ``select_survivors``, the planner) is pure; this module is where state
changes: it reads a request's row, asks the policy what to keep, has the compactor move
slots, commits the new row and frees pages. It talks to the engine only through the
``KVPoolAccess`` protocol, which the SGLang adapter implements over SGLang's pools.

Per-request state
-----------------
A request that never had a pass has no state: its row entry i holds logical position i.
After a pass, ``compacted_positions`` holds the position of each of the first
``compacted_len`` row entries; entries appended later (decode) continue from
``next_position_at_compaction``:

    row index:   0 .. compacted_len-1         | compacted_len .. kv_len-1
    position:    compacted_positions[i]       | next_position_at_compaction + (i - compacted_len)

so the next token's logical position is ``kv_len + position_offset`` with
``position_offset = next_position_at_compaction - compacted_len``: the per-request
offset added to SGLang's decode positions (which it derives from ``seq_lens``).

Invariants (tests call ``check_request`` after every operation):
    * positions are distinct and the appended tail is contiguous;
    * every position of the row is < ``kv_len + position_offset``;
    * ``first_evicted_position`` is the smallest logical position not in the row.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from compactor_service import tracing
from compactor_service.compactor import Compactor, LeaseClaim
from compactor_service.leases import LeaseStore
from compactor_service.redis_leases import LeaseStoreUnavailable
from sglang_evict.config import EvictionConfig
from sglang_evict.planner import fresh_pages_needed, plan_compaction
from sglang_evict.scorers import KVView
from sglang_evict.selection import protected_mask, select_survivors


class KVPoolAccess(Protocol):
    """What the mechanism needs from the engine's pools (implemented by the adapter)."""

    page_size: int
    k_buffers: list[Tensor]  # per-layer [slots, kv_heads, head_dim], for scoring kernels

    def read_row(self, req_pool_idx: int, length: int) -> Tensor:
        """int64 slots ``[length]`` of the request's row."""
        ...

    def write_row(self, req_pool_idx: int, row: Tensor) -> None:
        """Overwrite the first ``len(row)`` entries of the request's row."""
        ...

    def gather_keys(self, slots: Tensor) -> Tensor:
        """float ``[layers, len(slots), kv_heads, head_dim]`` cached keys."""
        ...

    def alloc_pages(self, num_pages: int) -> Tensor | None:
        """int64 page ids of ``num_pages`` fresh pages, or None if the pool is short."""
        ...

    def free_pages(self, pages: Tensor) -> None:
        """Return pages (slots when the page size is 1) to the allocator."""
        ...


@dataclass
class RequestState:
    """Mechanism-owned eviction state of one running request (see module docstring)."""

    req_pool_idx: int
    compacted_positions: Tensor
    next_position_at_compaction: int
    first_evicted_position: int
    num_passes: int = 0
    tokens_evicted: int = 0

    @property
    def compacted_len(self) -> int:
        return int(self.compacted_positions.numel())

    @property
    def position_offset(self) -> int:
        return self.next_position_at_compaction - self.compacted_len

    def positions(self, kv_len: int) -> Tensor:
        """int64 logical position of each of the first ``kv_len`` row entries."""
        if kv_len < self.compacted_len:
            raise ValueError(f"kv_len {kv_len} is below the compacted length {self.compacted_len}")
        tail = torch.arange(
            self.next_position_at_compaction,
            self.next_position_at_compaction + kv_len - self.compacted_len,
            dtype=torch.int64,
        )
        return torch.cat([self.compacted_positions, tail])

    def intact_prefix_len(self, kv_len: int) -> int:
        """Length of the longest row prefix whose entry i holds position i: the part of
        the row that still equals an uncompacted cache of the same tokens."""
        positions = self.positions(kv_len)
        mismatch = torch.nonzero(positions != torch.arange(kv_len), as_tuple=True)[0]
        return int(mismatch[0]) if mismatch.numel() else kv_len


class QueryRing:
    """The latest ``capacity`` queries of one request, every layer (post-RoPE), with
    their logical positions: what query-reading scorers see."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.queries: Tensor | None = None  # [layers, capacity, q_heads, head_dim]
        self.positions = torch.zeros(capacity, dtype=torch.int64)
        self.count = 0

    def append(self, queries: Tensor, positions: Tensor) -> None:
        """Add ``queries`` ``[layers, tokens, q_heads, head_dim]`` at ``positions``."""
        if self.queries is None:
            layers, _, heads, dim = queries.shape
            self.queries = torch.zeros(layers, self.capacity, heads, dim, dtype=queries.dtype)
        for t in range(max(0, queries.shape[1] - self.capacity), queries.shape[1]):
            at = self.count % self.capacity
            self.queries[:, at] = queries[:, t].to(self.queries.dtype)
            self.positions[at] = int(positions[t])
            self.count += 1

    def ordered(self) -> tuple[Tensor, Tensor]:
        """(queries ``[layers, n, q_heads, head_dim]``, positions ``[n]``), oldest first."""
        if self.queries is None:
            raise ValueError("no queries captured")
        n = min(self.count, self.capacity)
        order = (torch.arange(n) + (self.count - n)) % self.capacity
        return self.queries[:, order], self.positions[order]


@dataclass(frozen=True)
class PassResult:
    """One request's pass, for metrics and traces."""

    tokens_before: int
    tokens_after: int
    pages_freed: int
    slot_copies: int
    bytes_moved: int
    duration_s: float
    strategy: str
    protected_over_budget: bool

    @property
    def tokens_evicted(self) -> int:
        return self.tokens_before - self.tokens_after


@dataclass
class EvictionManager:
    """Runs passes and keeps every running request's ``RequestState``, keyed by request id.

    ``pool`` and ``compactor`` are the engine's; the manager never holds KV tensors.
    """

    config: EvictionConfig
    pool: KVPoolAccess
    compactor: Compactor
    num_request_rows: int
    device: str | torch.device = "cpu"
    # Combines this rank's per-token scores with the other tensor-parallel ranks' (each
    # holds different KV heads) so every rank keeps the same survivors; None: one rank.
    score_reducer: Callable[[Tensor], Tensor] | None = None
    # Score with the scorer's pool-reading kernel when it has one (no key gather);
    # None: when the pool is on a GPU (on CPU Triton runs only under its interpreter).
    use_pool_kernels: bool | None = None
    # Pass leases (fencing tokens the compactor checks) and shared-page pins; None: off.
    leases: LeaseStore | None = None
    lease_holder: str = "scheduler"
    # After the lease store failed, passes pause (fail at once, touching nothing) for
    # this long instead of reaching for an unreachable store at every decode step.
    lease_retry_interval_s: float = 1.0
    _leases_down_until_s: float = 0.0
    pin_failures: int = 0  # pin/unpin calls the lease store did not take (outage)
    states: dict[str, RequestState] = field(default_factory=dict)
    query_rings: dict[str, QueryRing] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.config.page_size != self.pool.page_size:
            raise ValueError(
                f"config page_size {self.config.page_size} != engine page size "
                f"{self.pool.page_size}"
            )
        self.scorer = self.config.make_scorer()
        # Position offset of the request occupying each request-pool row, on the engine's
        # device: decode positions are ``seq_lens - 1 + offsets[req_pool_indices]``.
        self.offsets_by_row = torch.zeros(
            self.num_request_rows, dtype=torch.int64, device=self.device
        )

    # --- queries -------------------------------------------------------------------

    def position_offset(self, rid: str) -> int:
        state = self.states.get(rid)
        return 0 if state is None else state.position_offset

    def positions(self, rid: str, kv_len: int) -> Tensor:
        state = self.states.get(rid)
        return torch.arange(kv_len) if state is None else state.positions(kv_len)

    def intact_prefix_len(self, rid: str, kv_len: int) -> int:
        state = self.states.get(rid)
        return kv_len if state is None else state.intact_prefix_len(kv_len)

    def num_tracked_requests(self) -> int:
        """Requests with eviction state (none once every request has finished)."""
        return len(self.states)

    def needs_pass(self, kv_len: int) -> bool:
        return kv_len >= self.config.trigger_tokens

    # --- shared-page pins ------------------------------------------------------------

    def pin_shared_pages(self, slots: Tensor, pin: bool) -> None:
        """Pin (or unpin) the pages holding ``slots`` in the lease store, under this
        scheduler's holder name: called as radix-tree nodes become locked (or
        unlocked). A compactor checking leases refuses any plan touching a page pinned
        by another holder. A store outage is logged and counted, never raised: SGLang's
        lock path must not fail (``pin_failures``)."""
        if self.leases is None or slots.numel() == 0:
            return
        pages = torch.unique(slots.to("cpu", torch.int64) // self.config.page_size).tolist()
        try:
            if pin:
                self.leases.pin(pages, self.lease_holder)
            else:
                self.leases.unpin(pages, self.lease_holder)
        except (LeaseStoreUnavailable, ValueError):
            self.pin_failures += 1

    # --- state changes ---------------------------------------------------------------

    def forget(self, rid: str) -> None:
        """Drop a request's state (finish, abort, or retraction: a retracted request is
        re-prefilled from its tokens, so its KV is regular again)."""
        state = self.states.pop(rid, None)
        self.query_rings.pop(rid, None)
        if state is not None:
            self.offsets_by_row[state.req_pool_idx] = 0

    def record_queries(self, rid: str, queries: Tensor, positions: Tensor) -> None:
        """Keep a request's latest queries (``[layers, tokens, q_heads, head_dim]``, after
        RoPE) for query-reading scorers; written from the attention forward."""
        ring = self.query_rings.get(rid)
        if ring is None:
            ring = self.query_rings[rid] = QueryRing(self.config.query_window_tokens)
        ring.append(queries, positions)

    def decode_positions(self, req_pool_indices: Tensor, seq_lens: Tensor) -> Tensor:
        """Logical positions of the tokens a decode batch generates: SGLang derives
        ``seq_lens - 1`` (after its +1); each request adds its offset."""
        base = (seq_lens - 1).clamp(min=0).to(torch.int64)
        return base + self.offsets_by_row[req_pool_indices.to(self.offsets_by_row.device).long()]

    def run_pass(
        self,
        rid: str,
        req_pool_idx: int,
        kv_len: int,
        *,
        num_shared: int,
        prompt_len: int,
    ) -> PassResult | None:
        """Evict down to the budget and compact one request; None if nothing to evict.

        Args:
            rid: request id (state key).
            req_pool_idx: the request's row in the request-to-token pool.
            kv_len: entries of the row in use (the request's KV length).
            num_shared: leading row entries owned by the radix tree (never touched).
            prompt_len: prompt tokens; protected unless ``config.evict_prompt``.
        """
        if not 0 <= req_pool_idx < self.offsets_by_row.numel():
            raise ValueError(
                f"req_pool_idx {req_pool_idx} outside the request pool [0, "
                f"{self.offsets_by_row.numel()})"
            )
        tracer = tracing.tracer()
        with tracer.start_as_current_span(tracing.SPAN_PASS) as span:
            span.set_attribute(tracing.ATTR_REQUESTS, 1)
            span.set_attribute(tracing.ATTR_TOKENS_BEFORE, kv_len)
            span.set_attribute(tracing.ATTR_SCORER, self.config.scorer)
            lease = None
            if self.leases is not None:
                if time.monotonic() < self._leases_down_until_s:
                    span.set_attribute(tracing.ATTR_OUTCOME, "lease-store-down")
                    raise LeaseStoreUnavailable(
                        "the lease store was unreachable moments ago: compaction paused"
                    )
                resource = f"{self.lease_holder}:req:{rid}"
                try:
                    lease = self.leases.acquire(
                        resource, self.lease_holder, self.config.lease_ttl_ms
                    )
                except LeaseStoreUnavailable:
                    self._leases_down_until_s = time.monotonic() + self.lease_retry_interval_s
                    span.set_attribute(tracing.ATTR_OUTCOME, "lease-store-down")
                    raise
                if lease is None:
                    span.set_attribute(tracing.ATTR_OUTCOME, "lease-busy")
                    raise RuntimeError(f"the pass lease of {resource!r} is held: pass skipped")
                span.set_attribute(tracing.ATTR_FENCING_TOKEN, lease.token)
            try:
                result = self._run_pass(
                    rid, req_pool_idx, kv_len, num_shared, prompt_len, lease, span
                )
            except BaseException as error:
                span.set_attribute(tracing.ATTR_OUTCOME, f"failed: {type(error).__name__}")
                raise
            finally:
                if lease is not None:
                    self.leases.release(lease)
            if result is None:
                span.set_attribute(tracing.ATTR_OUTCOME, "nothing-evicted")
                return None
            span.set_attribute(tracing.ATTR_OUTCOME, "committed")
            span.set_attribute(tracing.ATTR_TOKENS_AFTER, result.tokens_after)
            span.set_attribute(tracing.ATTR_PAGES_FREED, result.pages_freed)
            span.set_attribute(tracing.ATTR_BYTES_MOVED, result.bytes_moved)
            span.set_attribute(tracing.ATTR_STRATEGY, result.strategy)
            return result

    def _run_pass(self, rid, req_pool_idx, kv_len, num_shared, prompt_len, lease, span):
        start = time.perf_counter()
        tracer = tracing.tracer()
        config = self.config
        page_size = config.page_size
        row = self.pool.read_row(req_pool_idx, kv_len)
        positions = self.positions(rid, kv_len)
        next_position = kv_len + self.position_offset(rid)

        # Shared entries are frozen at page granularity; prompt tokens unless allowed.
        frozen_len = min(-(-num_shared // page_size) * page_size, kv_len)
        immovable = torch.zeros(kv_len, dtype=torch.bool)
        immovable[:frozen_len] = True
        pinned = immovable.clone()
        if not config.evict_prompt:
            pinned |= positions < prompt_len

        with tracer.start_as_current_span(tracing.SPAN_SCORE):
            # The scorer sees tokens in logical order.
            order = torch.argsort(positions)
            scores = self._pool_kernel_scores(row[order], next_position)
            if scores is None:
                scores = self._view_scores(rid, row[order], positions[order], next_position)
            if self.score_reducer is not None:
                scores = self.score_reducer(scores)
        protected = protected_mask(
            positions[order],
            sink_tokens=config.sink_tokens,
            protected_tokens=config.protected_tokens,
            window_tokens=config.window_tokens,
            pinned=pinned[order],
        )
        selection = select_survivors(scores, config.kv_budget_tokens, protected)
        survivors = torch.sort(order[selection.indices]).values
        if survivors.numel() == kv_len:
            return None

        strategy, fresh = config.compaction, torch.zeros(0, dtype=torch.int64)
        request = dict(page_size=page_size, positions=positions, immovable=immovable)
        need = fresh_pages_needed(row, survivors, strategy=strategy, **request)
        if need:
            allocated = self.pool.alloc_pages(need)
            if allocated is None:  # pool too full for staging pages: this pass fills holes
                strategy = "hole_fill"
            else:
                fresh = allocated
        claim = None
        if lease is not None:
            claim = LeaseClaim(lease.resource, lease.token, self.lease_holder)
        try:
            with tracer.start_as_current_span(tracing.SPAN_PLAN):
                plan = plan_compaction(
                    row, survivors, strategy=strategy, fresh_pages=fresh, **request
                )
            with tracer.start_as_current_span(tracing.SPAN_RPC):
                result = self.compactor.compact([plan], claim)
        except BaseException:
            # Nothing was committed: the row and its survivors are intact (invariant 3);
            # hand the staging pages back and let the caller decide.
            if fresh.numel():
                self.pool.free_pages(fresh)
            raise
        # Commit: only now does the row change and do pages return.
        with tracer.start_as_current_span(tracing.SPAN_COMMIT):
            self.pool.write_row(req_pool_idx, plan.new_row)
            self.pool.free_pages(plan.freed_pages)

        evicted_positions = positions[~torch.isin(positions, plan.new_positions)]
        previous = self.states.get(rid)
        first_evicted = int(evicted_positions.min())
        if previous is not None:
            first_evicted = min(first_evicted, previous.first_evicted_position)
        state = RequestState(
            req_pool_idx=req_pool_idx,
            compacted_positions=plan.new_positions.clone(),
            next_position_at_compaction=next_position,
            first_evicted_position=first_evicted,
            num_passes=(previous.num_passes if previous else 0) + 1,
            tokens_evicted=(previous.tokens_evicted if previous else 0)
            + kv_len
            - plan.new_row.numel(),
        )
        self.states[rid] = state
        self.offsets_by_row[req_pool_idx] = state.position_offset
        return PassResult(
            tokens_before=kv_len,
            tokens_after=int(plan.new_row.numel()),
            pages_freed=plan.num_pages_freed,
            slot_copies=result.slots_moved,
            bytes_moved=result.bytes_moved,
            duration_s=time.perf_counter() - start,
            strategy=strategy,
            protected_over_budget=selection.protected_over_budget,
        )

    def _pool_kernel_scores(self, slots: Tensor, next_position: int) -> Tensor | None:
        use = self.use_pool_kernels
        if use is None:
            use = torch.device(self.device).type == "cuda"
        if not use or self.scorer.needs_queries:
            return None
        per_head = self.scorer.pool_head_scores(self.pool.k_buffers, slots, next_position)
        return None if per_head is None else self.scorer.aggregate(per_head)

    def _view_scores(
        self, rid: str, slots: Tensor, positions: Tensor, next_position: int
    ) -> Tensor:
        keys = self.pool.gather_keys(slots)
        queries = query_positions = None
        if self.scorer.needs_queries:
            ring = self.query_rings.get(rid)
            if ring is None or ring.count == 0:
                raise ValueError(
                    f"scorer {self.scorer.name!r} needs the request's captured queries, but "
                    f"none were recorded for {rid}; query capture must run in the attention"
                )
            queries, query_positions = ring.ordered()
            queries = queries.to(keys.device)
        view = KVView(
            keys=keys,
            positions=positions,
            current_position=next_position,
            queries=queries,
            query_positions=query_positions,
        )
        return self.scorer.score(view)

    def check_request(self, rid: str, kv_len: int) -> None:
        """Raise ``AssertionError`` if a request's state breaks the module's invariants."""
        state = self.states.get(rid)
        if state is None:
            return
        positions = state.positions(kv_len)
        if torch.unique(positions).numel() != kv_len:
            raise AssertionError(f"request {rid}: repeated logical positions")
        if kv_len and int(positions.max()) >= kv_len + state.position_offset:
            raise AssertionError(f"request {rid}: a position is beyond the next token's")
        missing = set(range(kv_len + state.position_offset)) - set(positions.tolist())
        if missing and min(missing) != state.first_evicted_position:
            raise AssertionError(
                f"request {rid}: first evicted position {state.first_evicted_position}, "
                f"but {min(missing)} is missing"
            )
