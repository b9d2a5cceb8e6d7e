"""Batched compaction planning on the device: ``hole_fill`` and ``repack`` for every
due request at once, as tensor operations (no loop over requests, pages or tokens).

The numpy planner (``sglang_evict.passes.planner.plan_compaction``) is the reference: these
plans need not copy its choices, but the tests hold them to the same contract, for
every request (``check_plan_invariants``): page-structured new rows reading exactly the
survivors, no move ever writing a survivor's slot, shared pages untouched, and the same
number of pages freed (pages before - pages after; host-known, see ``counts``).

Layout. Requests are padded to the longest: the old rows as ``[R, N]`` and, viewed
page by page, as a grid ``[R, NP, P]`` (``NP = ceil(N / P)``); the new rows as
``[R, K]`` with ``K`` the largest survivor count. Every data-dependent choice stays on
the device; only these shapes and the counts come from the host.

    old row pages      j:  0        1         2          3          (P = 4)
    grid cell (j, o)      [F F F F][a . b .][. c . .][d e f g]      F frozen (shared)
    hole_fill keeps       [F F F F]          ........ [d e f g]     the fullest pages,
    and fills holes       [F F F F][d e f g][a b c  ]              in place; pages
                                                                    1 and 2 donate

``hole_fill``: ``q = m // P`` full pages and, when ``rem = m % P`` > 0, one partial
page are kept among the non-frozen pages (``m`` = non-frozen survivors): the full ones
are the pages holding most survivors (ties: the earlier page), the partial one the page
keeping most survivors at offsets ``< rem``. Kept cells that hold no survivor (or lie in
the free tail of the last page) are *holes*; survivors outside the kept cells are
*movers*; a cumulative sum ranks both and the k-th mover fills the k-th hole. Every
destination is a hole: never a survivor's slot (invariant 3). Never needs fresh pages.

``repack``: the new row holds the survivors in logical order (one ``argsort`` of the
positions). New page ``u`` (``P`` consecutive survivors) stays in an old page when one
of its survivors already sits at its target offset there and every other survivor of
that page is either in place for ``u`` or beyond ``u``'s end (then it moves out and is
not overwritten): that page's other cells are holes. Otherwise it is built in a staging
page. The host claims an upper bound of staging pages (every built page) before the
plan; the ones left unused go back to the allocator with the freed pages, so the
allocator always gets exactly ``pages_before - frozen_pages`` pages back per request
and the net gain is still ``pages_before - pages_after``. Page size 1 never needs
staging (each slot is its own page and always stays).

Moves. One per new-row entry (``[R, K]``): ``src == dst`` means no move (entries that
stay, and padding: slot 0 -> slot 0, SGLang's padding slot), so the count of real
moves never has to reach the host; the repack kernel skips them
(``sglang_evict_kernels.repack_kv_independent``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from compactor_service.plan import CompactionPlan
from sglang_evict.passes.batch.counts import PAGE_COUNTS, ceil_div, page_counts
from sglang_evict.passes.batch.indices import arange

_LAST = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class PlanInputs:
    """One batched pass's planning inputs, padded to ``[R, N]`` (device tensors).

    Attributes:
        page_size: the pool's page size ``P``.
        rows: int64 slots of each request's row (page-structured; padding: 0).
        keep: bool survivors (padding: False; every frozen entry must survive).
        positions: int64 logical positions.
        survivors, frozen_len: int64 ``[R]`` (host-known counts, on device);
            ``frozen_len`` is a multiple of ``P``.
        max_survivors: ``max(survivors)`` (host), the new rows' padded width ``K``.
        num_released: pages (slots when ``P == 1``) the allocator gets back, all
            requests together (host): ``sum(pages_freed + staging given)``.
        frozen_pages, pages_before, full_pages, partial_len, partial_page: int64
            ``[R]``, each request's ``counts.page_counts`` (host-known, on device).
    """

    page_size: int
    rows: Tensor
    keep: Tensor
    positions: Tensor
    survivors: Tensor
    frozen_len: Tensor
    max_survivors: int
    num_released: int
    frozen_pages: Tensor
    pages_before: Tensor
    full_pages: Tensor
    partial_len: Tensor
    partial_page: Tensor

    @classmethod
    def from_requests(
        cls,
        page_size: int,
        rows: list[Tensor],
        keeps: list[Tensor],
        positions: list[Tensor],
        frozen_lens: list[int],
        num_staging: list[int] | None = None,
    ) -> PlanInputs:
        """Pad per-request 1-D tensors (tests, benches)."""
        width = max(1, *(r.numel() for r in rows))

        def pad(values: list[Tensor], fill) -> Tensor:
            out = torch.full((len(values), width), fill, dtype=values[0].dtype)
            for i, v in enumerate(values):
                out[i, : v.numel()] = v
            return out

        kv_lens = [r.numel() for r in rows]
        survivors = [int(k.sum()) for k in keeps]
        freed = [
            ceil_div(n, page_size) - ceil_div(k, page_size)
            for n, k in zip(kv_lens, survivors, strict=True)
        ]
        staging = num_staging or [0] * len(rows)
        pages = [
            page_counts(kv_len=n, survivors=k, frozen_len=f, page_size=page_size)
            for n, k, f in zip(kv_lens, survivors, frozen_lens, strict=True)
        ]
        return cls(
            page_size=page_size,
            rows=pad(rows, 0),
            keep=pad(keeps, False),
            positions=pad(positions, 0),
            survivors=torch.tensor(survivors),
            frozen_len=torch.tensor(frozen_lens),
            max_survivors=max(survivors),
            num_released=sum(freed) + sum(staging),
            **{
                name: torch.tensor(column)
                for name, column in zip(PAGE_COUNTS, zip(*pages, strict=True), strict=True)
            },
        )


@dataclass(frozen=True)
class BatchPlan:
    """A batched pass's plan, on the device; request ``r``'s part is row ``r``.

    Attributes:
        new_row: int64 ``[R, K]``, the request-to-token rows after commit (columns past
            the survivors: 0).
        new_positions: int64 ``[R, K]``, logical position of each new-row entry.
        content: int64 ``[R, K]``, the old row index (column of the pass's inputs) each
            new-row entry holds (padding: 0), to carry per-entry data along.
        src, dst: int64 ``[R, K]``, one move per new-row entry; ``src == dst``: none.
        page_ids: int64 ``[R, NP]``, the physical page of each old row page.
        freed: bool ``[R, NP]``, old row pages the request gives up.
        staging: int64 ``[R, U]`` staging pages the host claimed (``repack``).
        staging_used: bool ``[R, U]``, those the new rows use.
        release: int64, every page (slot when ``P == 1``) the allocator gets back:
            freed pages and unused staging pages (host-known length).
        live: bool ``[R, K]``, the new-row entries in use (``column < survivors``).
    """

    page_size: int
    new_row: Tensor
    new_positions: Tensor
    content: Tensor
    src: Tensor
    dst: Tensor
    page_ids: Tensor
    freed: Tensor
    staging: Tensor
    staging_used: Tensor
    release: Tensor
    live: Tensor

    def move_counts(self) -> Tensor:
        """int64 ``[R]`` slot copies per request, on the device."""
        return (self.src != self.dst).sum(dim=1)

    def to_host_plans(
        self, survivors: list[int], frozen_lens: list[int] | None = None
    ) -> list[CompactionPlan]:
        """One ``CompactionPlan`` per request, on the host (reads the device: for the
        sidecar, whose API carries host plans, and for tests).

        ``frozen_lens``: leave each request's frozen (shared) leading entries out of its
        plan's ``new_row``/``new_positions``. They never move, and requests sharing a
        prefix share those slots, while a compactor checks that the plans of one batch
        hold disjoint slots (``validate_batch``): the plans sent cover what the pass
        may change. Frozen lengths are whole pages, so the rows stay page-structured.
        """
        cpu = {
            name: getattr(self, name).cpu()
            for name in ("new_row", "new_positions", "src", "dst", "page_ids", "freed")
        }
        staging, used = self.staging.cpu(), self.staging_used.cpu()
        plans = []
        starts = frozen_lens or [0] * len(survivors)
        for r, (k, start) in enumerate(zip(survivors, starts, strict=True)):
            src, dst = cpu["src"][r, :k], cpu["dst"][r, :k]
            real = src != dst
            plans.append(
                CompactionPlan(
                    page_size=self.page_size,
                    new_row=cpu["new_row"][r, start:k].clone(),
                    new_positions=cpu["new_positions"][r, start:k].clone(),
                    src_slots=src[real].clone(),
                    dst_slots=dst[real].clone(),
                    freed_pages=cpu["page_ids"][r][cpu["freed"][r]].clone(),
                    claimed_pages=staging[r][used[r]].clone(),
                )
            )
        return plans


def _pad_columns(t: Tensor, width: int, fill) -> Tensor:
    if t.shape[1] == width:
        return t
    tail = torch.full((t.shape[0], width - t.shape[1]), fill, dtype=t.dtype, device=t.device)
    return torch.cat([t, tail], dim=1)


def _flatten_selected(values: Tensor, mask: Tensor, total: int) -> Tensor:
    """``values[mask]`` in row-major order as a tensor of the host-known length
    ``total`` (a boolean index would make the host wait for the count)."""
    flat = mask.reshape(-1)
    rank = flat.cumsum(0) * flat  # 1-based among the selected; 0: not selected (scratch)
    out = values.new_zeros(total + 1)
    return out.scatter_(0, rank, values.reshape(-1))[1:]


class _Grid:
    """Shared views of the padded inputs (``[R, NP, P]`` cells)."""

    def __init__(self, inputs: PlanInputs) -> None:
        P = self.P = inputs.page_size
        R, N = inputs.rows.shape
        self.R, self.NP, self.K = R, ceil_div(N, P), inputs.max_survivors
        self.C = self.NP * P
        self.device = inputs.rows.device
        self.rows = _pad_columns(inputs.rows, self.C, 0)
        self.keep = _pad_columns(inputs.keep, self.C, False)
        self.positions = _pad_columns(inputs.positions, self.C, 0)
        # Rows are page-structured: a page's first cell holds slot page_id * P (pages
        # past kv_len hold padding: page 0).
        self.page_starts = self.rows.view(R, self.NP, P)[:, :, :1]
        self.page_ids = torch.div(self.page_starts.squeeze(2), P, rounding_mode="floor")
        self.j = arange(self.NP, self.device).unsqueeze(0)  # row page
        self.o = arange(P, self.device).view(1, 1, P)  # offset in a page
        self.t = arange(self.K, self.device).unsqueeze(0)  # new-row index
        self.frozen_pages = inputs.frozen_pages.unsqueeze(1)
        self.candidate = (self.j >= self.frozen_pages) & (self.j < inputs.pages_before.unsqueeze(1))
        self.live = self.t < inputs.survivors.unsqueeze(1)

    def finish(
        self,
        inputs: PlanInputs,
        content: Tensor,
        new_row: Tensor,
        freed: Tensor,
        staging: Tensor,
        staging_used: Tensor,
        staging_given: Tensor,
    ) -> BatchPlan:
        """Moves, positions and released pages from each new entry's old entry
        (``content``) and slot (``new_row``), both ``[R, K]`` and 0 past the
        survivors (``live``)."""
        src = self.rows.gather(1, content) * self.live
        if staging.shape[1]:
            released = _flatten_selected(
                torch.cat([self.page_ids, staging], dim=1),
                torch.cat([freed, staging_given > staging_used], dim=1),
                inputs.num_released,
            )
        else:
            released = _flatten_selected(self.page_ids, freed, inputs.num_released)
        return BatchPlan(
            page_size=self.P,
            new_row=new_row,
            new_positions=self.positions.gather(1, content) * self.live,
            content=content,
            src=src,
            dst=new_row,
            page_ids=self.page_ids,
            freed=freed,
            staging=staging,
            staging_used=staging_used,
            release=released,
            live=self.live,
        )


def plan_hole_fill(inputs: PlanInputs) -> BatchPlan:
    """``hole_fill`` for every request of the batch (module docstring)."""
    g = _Grid(inputs)
    P, R, NP, C, K, j, o = g.P, g.R, g.NP, g.C, g.K, g.j, g.o
    alive = g.keep.view(R, NP, P)
    rem = inputs.partial_len.unsqueeze(1)
    # Full pages: the candidates holding most survivors, ties to the earlier page (a
    # stable sort keeps page order among equal counts). Non-candidates sort last, and
    # there are at least ``full_pages`` candidates (the non-frozen survivors lie in
    # them), so the rank alone decides.
    count = torch.where(g.candidate, alive.sum(dim=-1), -1)
    rank = count.argsort(dim=1, descending=True, stable=True).argsort(dim=1)
    full = rank < inputs.full_pages.unsqueeze(1)
    # The partial page: among the other candidates, most survivors at offsets < rem
    # (``argmax`` returns the first, i.e. earliest, of equal counts).
    in_partial = o < rem.unsqueeze(2)  # [R, 1, P]
    leading = torch.where(g.candidate > full, (alive & in_partial).sum(dim=-1), -1)
    partial = (j == leading.argmax(dim=1, keepdim=True)) & (rem > 0)
    kept_full = (j < g.frozen_pages) | full  # frozen pages stay whole, in place
    new_page = torch.where(partial, inputs.partial_page.unsqueeze(1), kept_full.cumsum(dim=1) - 1)
    region = (kept_full.unsqueeze(2) | (partial.unsqueeze(2) & in_partial)).view(R, C)
    alive = alive.reshape(R, C)
    hole, mover = region > alive, alive > region  # bools: a & ~b
    # The k-th mover (row order) fills the k-th hole (row order): 1-based ranks, 0 for
    # cells that are neither (column 0 of the lookup is scratch).
    cells = arange(C, g.device).unsqueeze(0).expand(R, C)
    mover_at = torch.zeros(R, C + 1, dtype=torch.int64, device=g.device)
    mover_at.scatter_(1, mover.cumsum(dim=1) * mover, cells)
    incoming = mover_at.gather(1, hole.cumsum(dim=1) * hole)
    content_of_cell = torch.where(hole, incoming, cells)
    slot_of_cell = (g.page_starts + o).view(R, C)
    # Each kept cell's new-row index (others: scratch column K), both per-cell values
    # scattered there in one go.
    target = torch.where(region, (new_page.unsqueeze(2) * P + o).view(R, C), K)
    placed = torch.zeros(R, K + 1, 2, dtype=torch.int64, device=g.device)
    placed.scatter_(
        1,
        target.unsqueeze(2).expand(R, C, 2),
        torch.stack([content_of_cell, slot_of_cell], dim=2),
    )
    freed = g.candidate > (full | partial)
    no_staging = g.rows[:, :0]
    new_row = placed[:, :K, 1].contiguous()  # the moves' targets: flat views of it follow
    return g.finish(
        inputs, placed[:, :K, 0], new_row, freed, no_staging, g.keep[:, :0], g.keep[:, :0]
    )


def plan_repack(inputs: PlanInputs, staging: Tensor, staging_given: Tensor) -> BatchPlan:
    """``repack`` for every request of the batch (module docstring).

    ``staging``: int64 ``[R, U]`` pages the host claimed, ``staging_given`` bool
    ``[R, U]`` which columns hold one (``U_r`` leading columns per request).
    """
    g = _Grid(inputs)
    P, R, C, K, o, t = g.P, g.R, g.C, g.K, g.o, g.t
    frozen_len = inputs.frozen_len.unsqueeze(1)
    index = arange(C, g.device).unsqueeze(0)
    rest = g.keep & (index >= frozen_len)
    by_position = torch.where(rest, g.positions, _LAST).argsort(dim=1)  # rest first
    content = torch.where(
        t < frozen_len, t, by_position.gather(1, (t - frozen_len).clamp(min=0).expand(R, K))
    )
    # Each old entry's new index (-1: none), to test pages for reuse.
    new_index = torch.full((R, C + 1), -1, dtype=torch.int64, device=g.device)
    new_index.scatter_(1, torch.where(g.live, content, C), t.expand(R, K))
    new_index = new_index[:, :C]
    # New page u may stay in the old page of its first in-place survivor.
    KP = ceil_div(K, P)
    t_offset, t_page = t % P, torch.div(t, P, rounding_mode="floor")
    in_place = g.live & (content % P == t_offset) & (t >= frozen_len)
    in_place = _pad_columns(in_place, KP * P, False).view(R, KP, P)
    first = in_place.to(torch.uint8).argmax(dim=2, keepdim=True)
    content_pages = _pad_columns(content, KP * P, 0).view(R, KP, P)
    candidate = torch.div(content_pages.gather(2, first).squeeze(2), P, rounding_mode="floor")
    u = arange(KP, g.device).unsqueeze(0)
    u_start = u * P
    chunk_len = (inputs.survivors.unsqueeze(1) - u_start).clamp(0, P)
    cells = (candidate.unsqueeze(2) * P + o).view(R, KP * P)
    alive_there = g.keep.gather(1, cells).view(R, KP, P)
    index_there = new_index.gather(1, cells).view(R, KP, P)
    fits = (
        (o >= chunk_len.unsqueeze(2)) | ~alive_there | (index_there == u_start.unsqueeze(2) + o)
    ).all(dim=2)
    built = (u >= g.frozen_pages) & (chunk_len > 0)
    reuse = built & in_place.any(dim=2) & fits
    build = built & ~reuse
    stage_rank = build.cumsum(dim=1) - 1
    if staging.shape[1]:
        stage_page = staging.gather(1, stage_rank.clamp(0, staging.shape[1] - 1))
    else:
        stage_page = torch.zeros_like(stage_rank)
    physical = torch.where(
        u < g.frozen_pages,
        g.page_ids.gather(1, u.clamp(max=g.NP - 1).expand(R, KP)),
        torch.where(reuse, g.page_ids.gather(1, candidate), stage_page),
    )
    new_row = physical.gather(1, t_page.expand(R, K)) * P + t_offset
    columns = arange(staging.shape[1], g.device).unsqueeze(0)
    staging_used = columns < build.sum(dim=1, keepdim=True)
    reused = torch.zeros(R, g.NP + 1, dtype=torch.bool, device=g.device)
    reused = reused.scatter_(1, torch.where(reuse, candidate, g.NP), True)[:, : g.NP]
    freed = g.candidate > reused
    return g.finish(
        inputs, content * g.live, new_row * g.live, freed, staging, staging_used, staging_given
    )
