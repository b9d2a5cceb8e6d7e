"""The query ring: the last ``W`` queries of every running request, every layer, in
buffers allocated once, written by the attention forward and read by the batched pass
(``window``, ``rkv``).

FlashAttention-style kernels never materialise attention scores, and the plugin leaves
the server's kernel alone: it copies each layer's queries (after RoPE, as the attention
backend receives them) into this ring, and the scorers compute the ``W x N`` logits they
need at pass time (``sglang_evict.scorers.window``).

Layout (``W`` = ``query_window_tokens``; ``S`` slots, each holding one request)::

    queries[layer]  [S + 1, W, q_heads, head_dim]   the model's dtype
    positions       [S + 1, W] int64                logical position held; -1: empty
    slot_of_row     [rows + 1] int64                the slot of each request-pool row

    row  = the request's request-pool row (``req_pool_idx``); row ``rows`` is the
           scratch row, where the tokens of an extend batch that are not among their
           request's last W land. Row 0 is SGLang's padding row (padded CUDA-graph
           entries read and write it harmlessly).
    slot = ``slot_of_row[row]``; slot ``S`` is the scratch slot (writes land there
           harmlessly, reads of it find nothing).
    cell = position % W

Two ways to give rows slots:

* **Dedicated** (``RingShape.num_slots`` None): one slot per row, ``slot_of_row`` the
  identity. The CPU loops and the reference path use it.
* **Shared** (``num_slots`` = S, the server's): only a request the pass may read the
  queries of holds a slot: one whose prompt plus ``max_new_tokens`` exceeds its budget
  (a shorter one is never passed). Every other row maps to the scratch slot. Admission
  reserves a request's slot (``reserve``; a request finding none waits, as for the
  tier's arena), its first forward maps its row to it (``claim_rows``), and its release
  (finish, abort, retraction) gives it back (``release``). With bounded admission at
  most ``pool_tokens // (budget + 1)`` such requests run at once (each is counted at
  least ``budget + 1`` tokens), so ``default_slots`` sizes the ring by that: its cost
  follows what can run, not SGLang's request-pool rows (2,048 or more on a GPU).

A query at logical position ``p`` goes to cell ``p % W`` of its request's slot, so the
slot always holds the newest query of each residue class, and at a pass (next position
``P``) the cells whose position lies in ``[P - W, P)`` are exactly the request's last
``W`` queries that were computed. A cell written by the slot's previous request can
never pass that test by accident: a slot is reset (every position -1) when it is handed
to a new request (``claim_rows``, keyed by the request's id and the request pool's
per-row generation, which SGLang zeroes when it flushes its cache), before the
request's first forward.

Writes are plain ``index_put_`` copies of the forward's own tensors into these buffers
at device index tensors (the op SGLang writes its KV cache with), through a gather of
``slot_of_row``: no allocation that outlives the call, no host synchronisation, no
data-dependent shape. A CUDA graph captured with the writes replays them against the
same buffers, with the request rows and positions the graph runner copies into its
static inputs, and the slots ``slot_of_row`` holds at replay. Slot hand-outs change
``slot_of_row`` only at an extend batch's claim, on the forward stream, so a forward
already enqueued writes the slots it was enqueued with.

Cost: ``ring_bytes = (S + 1) * W * (layers * q_heads * head_dim * dtype_bytes + 8) +
(rows + 1) * 8``, the 8 bytes being a cell's int64 position and a row's int64 slot. The
server counts it against the KV pool (``kv_tokens_for``): the pool is that many tokens
smaller, rounded up to whole pages. Per slot that is ``W * q_heads * head_dim /
(kv_heads * (k_dim + v_dim))`` KV tokens of the same dtype: ``W * G / 2`` for a GQA
group of ``G`` (64 tokens for Llama-3-8B at ``W`` = 32), so with ``default_slots`` the
ring takes about ``W * G / (2 * (budget + 1))`` of the pool (3.1 % at ``W`` = 32,
``G`` = 4 and a 2,048-token budget), whatever the pool's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from sglang_evict.scorers.base import QueryWindow
from sglang_evict_kernels import device_int64

POSITION_BYTES = 8  # int64
SLOT_BYTES = 8  # int64
EMPTY = -1


@dataclass(frozen=True)
class RingShape:
    """What sizes a query ring.

    Attributes:
        num_layers: attention layers of the model.
        num_request_rows: rows of SGLang's request-to-token pool (its padding row 0
            included); the ring adds one scratch row.
        window: ``W``, queries kept per request (``query_window_tokens``).
        num_q_heads: query heads this rank computes (tensor parallelism splits them).
        head_dim: the query head dimension.
        dtype: the queries' dtype (the model's).
        num_slots: requests whose queries are kept at once (shared slots, module
            docstring); None: one slot per request row (dedicated).
    """

    num_layers: int
    num_request_rows: int
    window: int
    num_q_heads: int
    head_dim: int
    dtype: torch.dtype
    num_slots: int | None = None

    def __post_init__(self) -> None:
        if self.num_slots is not None and not 1 <= self.num_slots <= self.num_request_rows:
            raise ValueError(
                f"num_slots={self.num_slots}: must lie in [1, {self.num_request_rows}] "
                f"(the request rows)"
            )

    @property
    def dedicated(self) -> bool:
        return self.num_slots is None

    @property
    def slots(self) -> int:
        """Slots requests may hold (the scratch slot aside)."""
        return self.num_request_rows if self.num_slots is None else self.num_slots

    @property
    def num_rows(self) -> int:
        """Rows of the query buffers: the slots and the scratch slot."""
        return self.slots + 1

    @property
    def bytes_per_row(self) -> int:
        """Bytes of one slot: ``W * (layers * q_heads * head_dim * dtype_bytes + 8)``."""
        element = torch.empty((), dtype=self.dtype).element_size()
        per_query = self.num_layers * self.num_q_heads * self.head_dim * element
        return self.window * (per_query + POSITION_BYTES)

    @property
    def total_bytes(self) -> int:
        """``(S + 1) * W * (layers * q_heads * head_dim * dtype_bytes + 8) + (rows + 1) * 8``."""
        return self.num_rows * self.bytes_per_row + (self.num_request_rows + 1) * SLOT_BYTES


def default_slots(*, pool_tokens: int, budget_tokens: int, num_request_rows: int) -> int:
    """Shared slots enough for every request bounded admission lets run that the pass
    may read the queries of: each is counted at least ``budget_tokens + 1`` KV tokens,
    so at most ``pool_tokens // (budget_tokens + 1)`` run at once (module docstring).
    At most one per request row."""
    if pool_tokens < 0 or budget_tokens < 1 or num_request_rows < 1:
        raise ValueError(
            f"pool_tokens={pool_tokens}, budget_tokens={budget_tokens}, "
            f"num_request_rows={num_request_rows}"
        )
    return max(1, min(num_request_rows, pool_tokens // (budget_tokens + 1)))


def kv_tokens_for(num_bytes: int, kv_bytes_per_token: int, page_size: int) -> int:
    """KV pool tokens holding at least ``num_bytes``, in whole pages."""
    if kv_bytes_per_token <= 0 or page_size < 1:
        raise ValueError(
            f"kv_bytes_per_token={kv_bytes_per_token}, page_size={page_size}: both must be >= 1"
        )
    pages = -(-num_bytes // (kv_bytes_per_token * page_size))
    return pages * page_size


def pool_after_reserving(
    pool_tokens: int, num_bytes: int, kv_bytes_per_token: int, page_size: int
) -> tuple[int, int]:
    """``(reserved, left)``: the KV tokens ``num_bytes`` take out of a pool of
    ``pool_tokens`` (``kv_tokens_for``) and the whole pages left (possibly < 1 page: the
    caller refuses that, naming its flags)."""
    reserved = kv_tokens_for(num_bytes, kv_bytes_per_token, page_size)
    return reserved, (pool_tokens - reserved) // page_size * page_size


def extend_rows(
    request_rows: Tensor,
    extend_start: Tensor,
    extend_lens: Tensor,
    num_tokens: int,
    window: int,
    scratch_row: int,
) -> Tensor:
    """int64 ``[num_tokens]``: the ring row each token of an extend batch is written to:
    its request's row for the request's last ``window`` tokens of the batch, the scratch
    row for the others (so no two tokens write one real cell). Device ops of host-known
    shapes only (``output_size`` keeps ``repeat_interleave`` from reading the lengths).
    """
    device = request_rows.device
    extend_lens = extend_lens.to(device, torch.int64)
    owner = torch.repeat_interleave(
        torch.arange(extend_lens.shape[0], device=device), extend_lens, output_size=num_tokens
    )
    end = (extend_start.to(device, torch.int64) + extend_lens)[owner]
    from_end = end - torch.arange(num_tokens, device=device)  # 1 for the request's last
    return torch.where(from_end <= window, request_rows.to(torch.int64)[owner], scratch_row)


class QueryRing:
    """The ring (module docstring); one per scheduler process.

    Invariants (``check_invariants``; tests call it after every operation):
        * a slot is free or held by one request, never both, never two;
        * ``slot_of_row`` maps the scratch row, the padding row and every row not
          claimed with a slot to the scratch slot, and every other row to the slot it
          was last claimed with (shared slots; a released request's row keeps its slot
          until the row's next claim, and no forward writes it before then).
    """

    def __init__(self, shape: RingShape, device: str | torch.device = "cpu") -> None:
        self.shape = shape
        self.window = shape.window
        self.device = torch.device(device)
        self.scratch_slot = shape.slots
        self.scratch_row = shape.num_request_rows
        cells = (shape.num_rows, shape.window)
        self.queries = [
            torch.zeros(
                *cells, shape.num_q_heads, shape.head_dim, dtype=shape.dtype, device=self.device
            )
            for _ in range(shape.num_layers)
        ]
        self.positions = torch.full(cells, EMPTY, dtype=torch.int64, device=self.device)
        rows = shape.num_request_rows + 1
        if shape.dedicated:  # row r -> slot r; the scratch row -> the scratch slot
            self.slot_of_row = torch.arange(rows, dtype=torch.int64, device=self.device)
        else:
            self.slot_of_row = torch.full(
                (rows,), self.scratch_slot, dtype=torch.int64, device=self.device
            )
        # Host state: the request each row was last claimed for (its id and the request
        # pool's generation of the row: SGLang zeroes the generations when it flushes
        # its cache, so neither alone tells a new request), and (shared slots) the free
        # slots, the slot each request holds and each row's slot.
        self._owner: list[tuple | None] = [None] * rows
        self._row_of: dict[str, int] = {}
        self._free = [] if shape.dedicated else list(range(shape.slots - 1, -1, -1))
        self._held: dict[str, int] = {}
        self._row_slot: list[int | None] = [None] * rows
        self.slot_misses = 0  # claims of a request needing a slot when none was free

    @property
    def nbytes(self) -> int:
        """Bytes the ring's buffers hold (equals ``shape.total_bytes``)."""
        buffers = (*self.queries, self.positions, self.slot_of_row)
        return sum(b.numel() * b.element_size() for b in buffers)

    # --- slots (host: admission, the extend batch's claim, the release) ----------------

    @property
    def free_slots(self) -> int:
        """Slots no request holds (dedicated: every row has its own)."""
        return self.shape.slots if self.shape.dedicated else len(self._free)

    def holds(self, rid: str) -> bool:
        return rid in self._held

    def slot_holders(self) -> list[str]:
        """The requests holding a slot (shared slots)."""
        return list(self._held)

    def reserve(self, rid: str) -> bool:
        """Give request ``rid`` a slot (admission), or False when none is free. A
        request holding one keeps it (True)."""
        if self.shape.dedicated or rid in self._held:
            return True
        if not self._free:
            return False
        self._held[rid] = self._free.pop()
        return True

    def release(self, rid: str) -> None:
        """Request ``rid`` is gone (finish, abort, retraction): its slot is free again.
        Its row keeps pointing at the slot until the row's next claim; no forward
        writes that row before then (a forward already enqueued wrote it earlier)."""
        slot = self._held.pop(rid, None)
        if slot is not None:
            self._free.append(slot)
        row = self._row_of.pop(rid, None)
        if row is not None:
            self._owner[row] = None  # a request coming back to the row is claimed anew

    def claim_rows(
        self,
        rows: Sequence[int],
        generations: Sequence[int],
        rids: Sequence[str] | None = None,
        needs: Sequence[bool] | None = None,
    ) -> None:
        """Prepare each row whose request changed since its last claim (another request
        id or request-pool generation, or its request was released): point it at its
        request's slot (shared slots: the reserved one, or a free one, when ``needs``;
        else the scratch slot) and empty that slot. Call before the request's first
        forward writes, on the stream the forwards run on (host ints in, at most one
        device copy and one fill out)."""
        rids = [None] * len(rows) if rids is None else rids
        needs = [True] * len(rows) if needs is None else needs
        changed_rows, slots = [], []
        for row, generation, rid, need in zip(rows, generations, rids, needs, strict=True):
            if self._owner[row] == (rid, generation):
                continue
            self._owner[row] = (rid, generation)
            if rid is not None:
                self._row_of[rid] = row
            if self.shape.dedicated:
                slot = row
            elif need and rid is not None and self.reserve(rid):
                slot = self._held[rid]
            else:
                self.slot_misses += int(bool(need))
                slot = self.scratch_slot
            changed_rows.append(row)
            slots.append(slot)
        if not changed_rows:
            return
        if not self.shape.dedicated:
            for row, slot in zip(changed_rows, slots, strict=True):
                self._row_slot[row] = None if slot == self.scratch_slot else slot
            self.slot_of_row.index_put_(
                (device_int64(changed_rows, self.device),), device_int64(slots, self.device)
            )
        reset = [slot for slot in slots if slot != self.scratch_slot]
        if reset:
            self.positions.index_fill_(0, device_int64(reset, self.device), EMPTY)

    def check_invariants(self) -> None:
        """The class invariants (raises ``AssertionError``)."""
        if self.shape.dedicated:
            return
        held = list(self._held.values())
        if len(set(held)) != len(held) or set(held) & set(self._free):
            raise AssertionError(f"slots held {sorted(held)}, free {sorted(self._free)}")
        if len(held) + len(self._free) != self.shape.slots:
            raise AssertionError(
                f"{len(held)} held + {len(self._free)} free != {self.shape.slots} slots"
            )
        mapped = self.slot_of_row.tolist()
        for row, slot in enumerate(self._row_slot):
            expected = self.scratch_slot if slot is None else slot
            if mapped[row] != expected:
                raise AssertionError(f"row {row} maps to slot {mapped[row]}, not {expected}")

    # --- writes (the attention forward) ------------------------------------------------

    def write(self, layer: int, queries: Tensor, rows: Tensor, positions: Tensor) -> None:
        """Copy ``queries [T, q_heads, head_dim]`` at logical ``positions [T]`` into
        the slots of ``rows [T]`` (device tensors; a row may be the padding or scratch
        row)."""
        slots = self.slot_of_row.index_select(0, rows.to(self.device, torch.int64))
        positions = positions.to(self.device, torch.int64)
        cells = torch.remainder(positions, self.window)
        self.queries[layer].index_put_((slots, cells), queries.to(self.shape.dtype))
        if layer == 0:
            self.positions.index_put_((slots, cells), positions)

    def write_decode(
        self, layer: int, queries: Tensor, request_rows: Tensor, positions: Tensor
    ) -> None:
        """A decode batch: one query per request (padded CUDA-graph entries: row 0)."""
        self.write(layer, queries, request_rows, positions)

    def write_extend(
        self,
        layer: int,
        queries: Tensor,
        request_rows: Tensor,
        positions: Tensor,
        extend_start: Tensor,
        extend_lens: Tensor,
    ) -> None:
        """An extend (prefill) batch: each request's last ``W`` tokens are kept."""
        rows = extend_rows(
            request_rows.to(self.device),
            extend_start,
            extend_lens,
            queries.shape[0],
            self.window,
            self.scratch_row,
        )
        self.write(layer, queries, rows, positions)

    def record(self, row: int, queries: Tensor, positions: Tensor) -> None:
        """One request's new tokens, ``queries [layers, T, q_heads, head_dim]`` at
        ``positions [T]`` (the CPU loop's forward): the extend path for one request."""
        num_tokens = queries.shape[1]
        request = device_int64([row], self.device)
        start = device_int64([0], self.device)
        lens = device_int64([num_tokens], self.device)
        for layer in range(queries.shape[0]):
            self.write_extend(layer, queries[layer], request, positions, start, lens)

    # --- reads (the pass) ---------------------------------------------------------------

    def window_of(self, rows: Tensor, next_positions: Tensor) -> QueryWindow:
        """The captured queries of requests at ``rows [R]`` whose next logical positions
        are ``next_positions [R]`` (device tensors; no host read). A row without a slot
        holds none."""
        slots = self.slot_of_row.index_select(0, rows.to(self.device, torch.int64))
        positions = self.positions.index_select(0, slots)
        next_positions = next_positions.to(self.device, torch.int64).unsqueeze(1)
        valid = (positions >= 0) & (positions < next_positions)
        valid &= positions >= next_positions - self.window
        valid &= (slots != self.scratch_slot).unsqueeze(1)

        def queries_of_layer(layer: int) -> Tensor:
            return self.queries[layer].index_select(0, slots)

        return QueryWindow(
            num_layers=self.shape.num_layers,
            queries_of_layer=queries_of_layer,
            positions=positions,
            valid=valid,
        )
