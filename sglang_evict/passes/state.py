"""The mechanism's data types: what it needs from the engine's pools
(``KVPoolAccess``), the requests a pass covers (``DueRequest``), what it keeps per
request (``RequestState``) and what a pass reports (``PassResult``).
``sglang_evict.passes.manager`` explains the state they describe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from torch import Tensor

from sglang_evict.request_policy import RequestPolicy


class KVPoolAccess(Protocol):
    """What the mechanism needs from the engine's pools (implemented by the adapter).
    Every method is free of host synchronisation on a GPU pool."""

    page_size: int
    k_buffers: list[Tensor]  # per-layer [slots, kv_heads, head_dim]
    v_buffers: list[Tensor]

    def read_rows(self, rows: Tensor, width: int) -> Tensor:
        """int64 ``[len(rows), width]``: the first ``width`` entries of those rows."""
        ...

    def write_rows(self, rows: Tensor, values: Tensor) -> None:
        """Overwrite the first ``values.shape[1]`` entries of those rows."""
        ...

    def gather_keys(self, slots: Tensor) -> Tensor:
        """float ``[layers, len(slots), kv_heads, head_dim]`` cached keys (one
        request's, for scorers without a batched form)."""
        ...

    def gather_layer_keys(self, layer: int, slots: Tensor) -> Tensor:
        """float ``[len(slots), kv_heads, head_dim]``: one layer's cached keys. The
        batched scorers' torch forms read a pass's keys one layer at a time, so their
        temporary memory is one layer's keys of the pass, not every layer's."""
        ...

    def available_pages(self) -> int:
        """Free pages (slots when the page size is 1), host-known."""
        ...

    def alloc_pages(self, num_pages: int) -> Tensor | None:
        """int64 device page ids of ``num_pages`` fresh pages, or None if short."""
        ...

    def release_pages(self, pages: Tensor) -> None:
        """Give pages (slots when the page size is 1) back to the allocator."""
        ...


@dataclass(slots=True)
class RequestState:
    """Mechanism-owned eviction state of one running request (module docstring)."""

    req_pool_idx: int
    compacted_len: int
    position_offset: int
    num_shared: int
    prompt_len: int
    num_passes: int = 0
    tokens_evicted: int = 0
    policy: RequestPolicy | None = None  # None: the server's
    peak_kv_tokens: int = 0  # the most KV it held when a pass ran


class DueRequest(NamedTuple):
    """A request a decode step's pass covers (host ints the scheduler holds). A named
    tuple, not a frozen dataclass: the decode step builds one per due request, and a
    frozen dataclass costs ~1 us more each."""

    rid: str
    req_pool_idx: int
    kv_len: int  # row entries in use, all written
    num_shared: int  # leading entries the radix tree owns (never touched)
    prompt_len: int  # prompt tokens; protected unless config.evict_prompt
    policy: RequestPolicy | None = None  # the request's own (None: the server's)


@dataclass(slots=True)
class PassResult:
    """One request's part of a batched pass, for metrics, traces and tests (not
    frozen only because a frozen dataclass costs the pass's host path ~1 us more per
    request to build; nothing changes one).

    The slot copies stay on the device, one tensor for the whole batch
    (``batch_slot_copies[batch_index]`` is this request's): reading ``slot_copies`` or
    ``bytes_moved`` synchronises, so the hot path never does (metrics fold the batch's
    total in later, ``sglang_evict.metrics``)."""

    rid: str
    tokens_before: int
    tokens_after: int
    pages_freed: int
    strategy: str
    protected_over_budget: bool
    duration_s: float  # host time of the whole batched pass
    batch_slot_copies: Tensor  # int64 [requests of the batch], on the pool's device
    batch_index: int
    bytes_per_slot: int  # every layer's K and V row of one slot
    scorer: str = ""  # the scorer that ranked its tokens
    budget_tokens: int = 0  # its budget
    # Under a tier: of the tokens leaving full precision, those that entered the tier,
    # and the tokens the tier gave up (gone from the KV: evicted for real).
    tokens_demoted: int = 0
    tokens_dropped: int = 0

    @property
    def tokens_evicted(self) -> int:
        return self.tokens_before - self.tokens_after

    @property
    def slot_copies(self) -> int:
        return int(self.batch_slot_copies[self.batch_index])

    @property
    def bytes_moved(self) -> int:
        """Read + written."""
        return 2 * self.slot_copies * self.bytes_per_slot
