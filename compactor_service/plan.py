"""The compaction plan: what one pass does to one request's KV, shared by the plugin
(which computes it) and the compactor (which validates and applies it).

A plan is data only: a new request-to-token row, slot moves, and pages to free. The
compactor copies ``src_slots[i] -> dst_slots[i]`` in every layer's K and V buffer; the
scheduler then commits ``new_row``/``new_positions`` and frees ``freed_pages``.

``validate_structure`` checks what can be checked from the plan alone (the compactor
runs it on every request before any byte moves); the planner's full invariants, which
also need the pre-pass row and the survivor set, live in ``sglang_evict.passes.planner``.

What the compactor can know about slot ownership, and so checks (everything else in a
plan is the scheduler's word):

* the pool's geometry: every slot in ``[0, num_slots)``, every page in
  ``[0, num_slots // page_size)``, every position in ``[0, MAX_POSITION)``;
* the plan itself: the new row holds each slot once and is page-structured, every
  destination is a slot of the new row and no source is, no slot is both read and
  written, the new row's positions are distinct, freed pages are not used by the new
  row, claimed pages are (see ``validate_structure``);
* the batch (``compactor.validate_batch``): plans of one pass own disjoint slots — no
  slot read or written by two plans, no plan reading a slot another plan's row keeps, no
  page freed twice or freed while a row still uses it, and a page that several rows
  hold (a shared prefix) is frozen: nobody reads, writes, frees or claims it;
* the lease store, when the compactor has one (``compactor.check_leases``): the pass's
  fencing token is current, and no move reads or writes a page anyone pins (radix-tree
  pins mark shared prefixes, frozen for every request; the claim's holder name grants
  nothing, since a client chooses it).

What it cannot know: the pre-pass row of a request and the rows of requests outside the
batch. It never sees them, so a destination that is, in the scheduler's memory, the
slot of a survivor the plan does not mention, or a private slot of a request outside
the batch, cannot be told from a hole. Against that the compactor relies on who may call
it at all: the Unix socket (0600, in a private directory) admits the scheduler's uid
only, which can write the pool's memory anyway, and TCP beyond loopback needs TLS, with
client certificates (``--tls-client-ca``) to authenticate schedulers.

Diagram of a plan's slots (page size 4, one request; ``.`` = evicted, ``_`` = free tail):

    pre-pass row pages   [ 0  1  .  3 ][ 4  5  6  7 ][ .  9  10 _ ]
    moves                 9 -> hole of page 0 ; 10 -> ... (dst never a survivor slot)
    new row pages        [ 0  1  9  3 ][ 4  5  6  7 ][ 10 ... ]   freed: pages emptied
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor


class PlanError(ValueError):
    """A plan is malformed or violates an invariant; nothing was applied."""


# Logical positions are RoPE positions of a context; SGLang holds them in int32 tensors.
MAX_POSITION = 1 << 31


def _int64_1d(name: str, value: Tensor) -> None:
    if not isinstance(value, Tensor) or value.dim() != 1 or value.dtype != torch.int64:
        raise PlanError(f"{name} must be a 1-D int64 tensor, got {value!r:.80}")


def _in_range(name: str, values: Tensor, high: int) -> None:
    if values.numel() and (values.min() < 0 or values.max() >= high):
        bad = values[(values < 0) | (values >= high)][:4].tolist()
        raise PlanError(f"{name} holds {bad}, outside [0, {high})")


def _duplicates(values: Tensor) -> list[int]:
    unique, counts = torch.unique(values, return_counts=True)
    return unique[counts > 1].tolist()


# The plan's int64 arrays (checked here, carried as bytes on the wire).
ARRAY_FIELDS = (
    "new_row",
    "new_positions",
    "src_slots",
    "dst_slots",
    "freed_pages",
    "claimed_pages",
)

# A demotion's int64 arrays (empty: the pass demotes nothing for the request), carried
# beside the plan's; checked by ``validate_demotion`` against the pool's tier arena.
DEMOTION_FIELDS = ("demote_slots", "demote_targets", "arena_claimed")
WIRE_FIELDS = ARRAY_FIELDS + DEMOTION_FIELDS


def _no_values() -> Tensor:
    return torch.zeros(0, dtype=torch.int64)


@dataclass(frozen=True)
class CompactionPlan:
    """One request's compaction pass.

    Attributes:
        page_size: KV page size in tokens; page ``p`` holds slots ``[p*P, (p+1)*P)``.
        new_row: int64 ``[num_survivors]``, the request-to-token row after commit.
        new_positions: int64 ``[num_survivors]``, logical (RoPE) position of each entry.
        src_slots, dst_slots: int64 ``[num_moves]``, slot copies (every layer, K and V).
        freed_pages: int64, pages the request returns to the allocator after commit
            (slot indices when ``page_size`` is 1).
        claimed_pages: int64, fresh pages (allocated by the caller before the pass) that
            ``new_row`` uses; net pages returned = ``len(freed) - len(claimed)``.
        demote_slots: int64 ``[groups * G]``, the slots of the request's tokens that
            enter its tier, group by group (read before any move).
        demote_targets: int64 ``[groups]``, the arena slot each group is written to: one
            of ``arena_claimed``, or the trash slot (a group given up at once).
        arena_claimed: int64, free arena slots the caller allotted to the request for
            this pass; nothing reads them until the caller commits the pass.
    """

    page_size: int
    new_row: Tensor
    new_positions: Tensor
    src_slots: Tensor
    dst_slots: Tensor
    freed_pages: Tensor
    claimed_pages: Tensor
    demote_slots: Tensor = field(default_factory=_no_values)
    demote_targets: Tensor = field(default_factory=_no_values)
    arena_claimed: Tensor = field(default_factory=_no_values)

    @property
    def num_moves(self) -> int:
        return int(self.src_slots.numel())

    @property
    def num_demoted_groups(self) -> int:
        return int(self.demote_targets.numel())

    def without_moves(self) -> CompactionPlan:
        """The plan's demotion alone (a pass's first call: ``compactor.in_two_phases``)."""
        return replace(self, src_slots=_no_values(), dst_slots=_no_values())

    def without_demotion(self) -> CompactionPlan:
        """The plan's moves alone (a pass's second call)."""
        return replace(
            self, demote_slots=_no_values(), demote_targets=_no_values(), arena_claimed=_no_values()
        )

    def validate_demotion(self, group_tokens: int, arena_slots: int, num_slots: int) -> None:
        """Raise ``PlanError`` unless the demotion is self-consistent for an arena of
        ``arena_slots`` slots (the last the trash slot) over a pool of ``num_slots``:
        ``G`` token slots a group, each in the pool and read once; claimed arena slots
        distinct and not the trash; every target a claimed slot (at most one group
        each) or the trash slot."""
        for name in DEMOTION_FIELDS:
            _int64_1d(name, getattr(self, name))
        groups = self.num_demoted_groups
        if self.demote_slots.numel() != groups * group_tokens:
            raise PlanError(
                f"demote_slots holds {self.demote_slots.numel()} slots for {groups} groups "
                f"of {group_tokens} tokens"
            )
        _in_range("demote_slots", self.demote_slots, num_slots)
        trash = arena_slots - 1
        _in_range("arena_claimed", self.arena_claimed, trash)
        _in_range("demote_targets", self.demote_targets, arena_slots)
        for name in ("demote_slots", "arena_claimed"):
            dup = _duplicates(getattr(self, name))
            if dup:
                raise PlanError(f"{name} repeats {dup[:8]}")
        kept = self.demote_targets[self.demote_targets != trash]
        dup = _duplicates(kept)
        if dup:
            raise PlanError(f"demote_targets writes arena slots {dup[:8]} twice")
        if not torch.isin(kept, self.arena_claimed).all():
            stray = kept[~torch.isin(kept, self.arena_claimed)][:8].tolist()
            raise PlanError(f"demote_targets writes arena slots {stray} the request did not claim")

    @property
    def num_pages_freed(self) -> int:
        """Net pages returned to the allocator by this pass."""
        return int(self.freed_pages.numel() - self.claimed_pages.numel())

    def bytes_moved(self, bytes_per_slot_all_layers: int) -> int:
        """Bytes read plus written when every move copies ``bytes_per_slot_all_layers``."""
        return 2 * self.num_moves * bytes_per_slot_all_layers

    def validate_structure(self, num_slots: int | None = None) -> None:
        """Raise ``PlanError`` unless the plan is self-consistent.

        Checks: shapes and dtypes; no slot written twice or read twice; no slot both read
        and written (moves are independent, so any order or parallel split is safe and a
        re-run is idempotent); every destination lies in the new row and no source does;
        the new row is page-structured and its positions distinct; freed pages are not in
        the new row, claimed pages are; positions lie in ``[0, MAX_POSITION)``; with
        ``num_slots``, slots lie in ``[0, num_slots)`` and pages in
        ``[0, num_slots // page_size)``.
        """
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise PlanError(f"page_size must be a positive integer, got {self.page_size!r}")
        for name in WIRE_FIELDS:
            _int64_1d(name, getattr(self, name))
        if self.new_positions.shape != self.new_row.shape:
            raise PlanError("new_positions and new_row differ in length")
        if self.src_slots.shape != self.dst_slots.shape:
            raise PlanError("src_slots and dst_slots differ in length")
        if num_slots is not None:
            num_pages = num_slots // self.page_size
            for name, high in (
                ("new_row", num_slots),
                ("src_slots", num_slots),
                ("dst_slots", num_slots),
                ("freed_pages", num_pages),
                ("claimed_pages", num_pages),
            ):
                _in_range(name, getattr(self, name), high)
        _in_range("new_positions", self.new_positions, MAX_POSITION)
        for name in ARRAY_FIELDS:
            dup = _duplicates(getattr(self, name))
            if dup:
                raise PlanError(f"{name} repeats {dup[:8]}")
        if torch.isin(self.dst_slots, self.src_slots).any():
            both = self.dst_slots[torch.isin(self.dst_slots, self.src_slots)][:8].tolist()
            raise PlanError(f"slots {both} are both read and written in one pass")
        if not torch.isin(self.dst_slots, self.new_row).all():
            raise PlanError("a move writes a slot that the new row does not hold")
        if torch.isin(self.src_slots, self.new_row).any():
            raise PlanError("a move reads a slot that the new row still holds")
        check_page_structure(self.new_row, self.page_size)
        new_pages = torch.unique(torch.div(self.new_row, self.page_size, rounding_mode="floor"))
        if torch.isin(self.freed_pages, new_pages).any():
            raise PlanError("a freed page is still used by the new row")
        if not torch.isin(self.claimed_pages, new_pages).all():
            raise PlanError("a claimed page is not used by the new row")


def check_page_structure(row: Tensor, page_size: int) -> None:
    """Raise ``PlanError`` unless ``row`` is page-structured.

    SGLang's paged allocator and page-table attention backends read a row as whole
    pages: entry ``i`` lies in the same page as entry ``i - i % P`` and at offset
    ``i % P`` of it. So all pages but the last are full, and the last is filled from
    offset 0. With page size 1 every row qualifies.
    """
    if page_size == 1 or row.numel() == 0:
        return
    index = torch.arange(row.numel(), dtype=torch.int64)
    if not torch.equal(row % page_size, index % page_size):
        bad = int(torch.nonzero(row % page_size != index % page_size)[0])
        raise PlanError(
            f"row entry {bad} holds slot {int(row[bad])} at page offset "
            f"{int(row[bad]) % page_size}, expected {bad % page_size}"
        )
    page_start = row[index - index % page_size]
    if not torch.equal(row - index % page_size, page_start):
        bad = int(torch.nonzero(row - index % page_size != page_start)[0])
        raise PlanError(f"row entry {bad} is not in the same page as the start of its page")
