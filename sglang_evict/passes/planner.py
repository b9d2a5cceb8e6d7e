"""Compaction planner: from a request's row and survivor set to a ``CompactionPlan``.

Pure: no allocator, no KV pool. Inputs describe one request as SGLang holds it: its
``req_to_token`` row (slot of each cached token, in row order), each entry's logical
position, the page size, and the entries the engine marks immovable (shared prefix).

Why a plan at all: a paged allocator frees a page only when all of its slots are dead,
so scattered eviction frees nothing (16,000 tokens in 16-token pages, every 10th kept:
0 of 1,000 pages free). Survivors must be consolidated until whole pages empty out.

Strategies
----------
``repack``     survivors keep logical order in the new row (entry i of the new row is
               the i-th survivor by position). A new page whose content already sits in
               one old page at the right offsets stays there; other new pages are built
               in an old page that holds no conflicting survivor, else in an old page
               with no survivor at all, else in a fresh page supplied by the caller.
``hole_fill``  the fewest copies: keep the old pages holding the most survivors (and, as
               the last page, the page keeping the most survivors at its leading
               offsets), move survivors of every other page into the holes of the kept
               pages. Row order is no longer logical order; ``new_positions`` carries
               the position map that RoPE needs. Never needs fresh pages.
With page size 1 every slot is its own page, so neither strategy moves anything: the
new row simply drops the evicted slots, which are freed.

Invariants (``check_plan_invariants`` verifies all five; tests run it after every plan)
----------------------------------------------------------------------------------
1. Page structure. With page size P > 1 the new row is page-structured: entries i and
   i - (i mod P) share a page, ``row[i] mod P == i mod P``; all pages but the last are
   full.
2. Same survivors, bit for bit. After the moves, the multiset of slots the new row
   reads holds exactly the survivors' K/V, and ``new_positions`` gives each entry's
   logical position.
3. Interruption-safe. No move writes a slot the committed (pre-pass) row still needs:
   a destination is never a survivor's slot (whether it stays or is a move source)
   and never shared; it is an evicted slot, the free tail of the request's last page,
   or a fresh page. Consequences: every survivor's K/V is intact at every instant of a
   pass, so a pass interrupted anywhere can be re-run or completed from the same plan
   (moves are independent: no slot is both read and written, so order and
   parallelism do not matter and a re-run is idempotent). The evicted tokens' slots
   are scratch from the moment a plan is issued.
4. Shared slots are frozen. Every page holding an immovable entry keeps its row
   position, is never a move source or destination, and is never freed. Such pages
   must lead the row and all their entries must survive (a shared prefix is
   page-aligned in SGLang's radix tree; anything else is rejected).
5. Exact accounting. ``len(freed_pages) - len(claimed_pages)`` == pages before - pages
   after, where pages = ceil(tokens / P).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from compactor_service.plan import CompactionPlan, PlanError

STRATEGIES = ("repack", "hole_fill")


class PlanInvariantError(AssertionError):
    """A plan broke one of the planner's invariants (a planner bug, never user input)."""


class NotEnoughFreshPages(ValueError):
    """``repack`` needs more fresh pages than the caller supplied."""

    def __init__(self, needed: int, given: int) -> None:
        super().__init__(
            f"repack needs {needed} fresh pages for this pass, {given} were supplied; "
            f"allocate them first (fresh_pages_needed) or use hole_fill, which needs none"
        )
        self.needed = needed


def _to_numpy(name: str, value: Tensor | np.ndarray | list, dtype) -> np.ndarray:
    array = value.cpu().numpy() if isinstance(value, Tensor) else np.asarray(value)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    expected = np.bool_ if dtype is bool else np.integer
    if array.size and not np.issubdtype(array.dtype, expected):
        raise ValueError(f"{name} must hold {np.dtype(dtype).name} values, got {array.dtype}")
    return array.astype(dtype, copy=False)


class _Request:
    """Validated planner inputs and derived per-page views (internal)."""

    def __init__(self, row, survivors, page_size, positions, immovable) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        self.P = page_size
        self.row = _to_numpy("row", row, np.int64)
        n = self.N = self.row.size
        if len(np.unique(self.row)) != n:
            raise ValueError("row repeats a slot")
        if page_size > 1:
            try:
                from compactor_service.plan import check_page_structure

                check_page_structure(torch.from_numpy(self.row), page_size)
            except PlanError as error:
                raise ValueError(f"row is not page-structured: {error}") from None
        self.survivors = _to_numpy("survivors", survivors, np.int64)
        if self.survivors.size and (
            np.any(np.diff(self.survivors) <= 0) or self.survivors[0] < 0 or self.survivors[-1] >= n
        ):
            raise ValueError(f"survivors must be strictly ascending indices in [0, {n})")
        self.positions = (
            np.arange(n, dtype=np.int64)
            if positions is None
            else _to_numpy("positions", positions, np.int64)
        )
        if self.positions.size != n:
            raise ValueError(f"positions has {self.positions.size} entries, row has {n}")
        self.immovable = (
            np.zeros(n, dtype=bool)
            if immovable is None
            else _to_numpy("immovable", immovable, bool)
        )
        if self.immovable.size != n:
            raise ValueError(f"immovable has {self.immovable.size} entries, row has {n}")
        self.num_pages = -(-n // page_size)
        self.page_ids = self.row[::page_size] // page_size  # physical page of each row page
        self.alive = np.zeros(self.num_pages * page_size, dtype=bool)
        self.alive[self.survivors] = True
        frozen = np.unique(np.nonzero(self.immovable)[0] // page_size)
        self.num_frozen_pages = frozen.size
        if not np.array_equal(frozen, np.arange(frozen.size)):
            raise ValueError(
                f"immovable entries must fill the leading pages of the row; they touch row "
                f"pages {frozen[:8].tolist()}"
            )
        self.num_frozen_entries = min(frozen.size * page_size, n)
        if not self.alive[: self.num_frozen_entries].all():
            dropped = np.nonzero(~self.alive[: self.num_frozen_entries])[0]
            raise ValueError(
                f"survivors drop entries {dropped[:8].tolist()} that lie in immovable (shared) "
                f"pages; protect whole shared pages before selecting"
            )
        # Survivors outside the frozen pages, in logical order: the new row's tail content.
        rest = self.survivors[self.survivors >= self.num_frozen_entries]
        self.rest = rest[np.argsort(self.positions[rest], kind="stable")]

    def slot(self, row_page: int, offset: int) -> int:
        return int(self.page_ids[row_page]) * self.P + offset


def _finish(
    req: _Request, new_pages: list, contents: np.ndarray, fresh_ids: list[int]
) -> CompactionPlan:
    """Build the plan from the new row's pages (row-page index, or ("fresh", id)) and the
    entry held by each new-row index."""
    P = req.P
    n_new = contents.size
    new_row = np.empty(n_new, dtype=np.int64)
    src, dst = [], []
    used_row_pages = set()
    for q, page in enumerate(new_pages):
        lo, hi = q * P, min((q + 1) * P, n_new)
        if isinstance(page, tuple):
            base = page[1] * P
        else:
            base = int(req.page_ids[page]) * P
            used_row_pages.add(page)
        for i in range(lo, hi):
            target = base + (i - lo)
            new_row[i] = target
            source = int(req.row[contents[i]])
            if source != target:
                src.append(source)
                dst.append(target)
    freed = [int(req.page_ids[j]) for j in range(req.num_pages) if j not in used_row_pages]
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    return CompactionPlan(
        page_size=P,
        new_row=torch.from_numpy(new_row),
        new_positions=torch.from_numpy(req.positions[contents].copy()),
        src_slots=as_tensor(src),
        dst_slots=as_tensor(dst),
        freed_pages=as_tensor(freed),
        claimed_pages=as_tensor(fresh_ids),
    )


def _plan_page_size_one(req: _Request, strategy: str) -> CompactionPlan:
    order = (
        req.rest if strategy == "repack" else req.survivors[req.survivors >= req.num_frozen_entries]
    )
    contents = np.concatenate([np.arange(req.num_frozen_entries), order]).astype(np.int64)
    evicted = np.setdiff1d(np.arange(req.N), contents)
    return CompactionPlan(
        page_size=1,
        new_row=torch.from_numpy(req.row[contents].copy()),
        new_positions=torch.from_numpy(req.positions[contents].copy()),
        src_slots=torch.zeros(0, dtype=torch.int64),
        dst_slots=torch.zeros(0, dtype=torch.int64),
        freed_pages=torch.from_numpy(req.row[evicted].copy()),
        claimed_pages=torch.zeros(0, dtype=torch.int64),
    )


def _plan_repack(
    req: _Request, fresh_pages: list[int] | None
) -> tuple[list, np.ndarray, list[int]]:
    P, f = req.P, req.num_frozen_pages
    rest = req.rest
    contents = np.concatenate([np.arange(req.num_frozen_entries), rest]).astype(np.int64)
    new_pages: list = list(range(f))
    used = set(range(f))
    alive = req.alive
    dead_pages = [j for j in range(f, req.num_pages) if not alive[j * P : (j + 1) * P].any()]
    fresh_used: list[int] = []
    for start in range(0, rest.size, P):
        chunk = rest[start : start + P]
        offsets = np.arange(chunk.size)
        best, best_in_place = None, -1
        for j in np.unique(chunk // P):
            j = int(j)
            if j in used:
                continue
            home = j * P + offsets
            in_place = chunk == home
            # Offsets this page must provide hold a survivor only if it is already right.
            if (alive[home] & ~in_place).any():
                continue
            if int(in_place.sum()) > best_in_place:
                best, best_in_place = j, int(in_place.sum())
        if best is None:
            while dead_pages and dead_pages[0] in used:
                dead_pages.pop(0)
            if dead_pages:
                best = dead_pages.pop(0)
        if best is None:
            if fresh_pages is None:  # counting mode: a placeholder id
                page = ("fresh", -1 - len(fresh_used))
            elif len(fresh_used) < len(fresh_pages):
                page = ("fresh", int(fresh_pages[len(fresh_used)]))
            else:
                raise NotEnoughFreshPages(len(_plan_repack(req, None)[2]), len(fresh_pages))
            fresh_used.append(page[1])
            new_pages.append(page)
        else:
            used.add(best)
            new_pages.append(best)
    return new_pages, contents, fresh_used


def _plan_hole_fill(req: _Request) -> tuple[list, np.ndarray]:
    P, f = req.P, req.num_frozen_pages
    rest_count = req.rest.size
    num_full, remainder = divmod(rest_count, P)
    grid = req.alive.reshape(req.num_pages, P)
    candidates = np.arange(f, req.num_pages)
    counts = grid[candidates].sum(axis=1)
    # Most survivors first; ties keep the earlier page (stable sort on -count).
    ranked = candidates[np.argsort(-counts, kind="stable")]
    partial = None
    if remainder:
        leading = grid[candidates, :remainder].sum(axis=1)
        count_of = dict(zip(candidates.tolist(), counts.tolist(), strict=True))
        top = ranked[: num_full + 1].tolist()
        top_sum = sum(count_of[j] for j in top[:num_full])
        best_value = -1
        for j, stay in zip(candidates.tolist(), leading.tolist(), strict=True):
            if j in top[:num_full]:
                others = (
                    top_sum - count_of[j] + (count_of[top[num_full]] if len(top) > num_full else 0)
                )
            else:
                others = top_sum
            if stay + others > best_value:
                best_value, partial = stay + others, j
        full = [j for j in ranked.tolist() if j != partial][:num_full]
    else:
        full = ranked[:num_full].tolist()
    full.sort()  # kept full pages keep their row order
    kept = full + ([partial] if partial is not None else [])
    kept_set = set(kept)
    # Holes in new-row order, and the survivors that must move, in logical order.
    holes, stays = [], {}
    for q, j in enumerate(kept):
        width = remainder if j == partial else P
        for o in range(width):
            entry = j * P + o
            if grid[j, o]:
                stays[q * P + o] = entry
            else:
                holes.append(q * P + o)
    movers = [
        int(e)
        for e in req.rest
        if (int(e) // P) not in kept_set or (int(e) // P == partial and int(e) % P >= remainder)
    ]
    if len(movers) != len(holes):
        raise PlanInvariantError(f"{len(movers)} movers for {len(holes)} holes")
    contents = np.empty(rest_count, dtype=np.int64)
    for index, entry in stays.items():
        contents[index] = entry
    contents[holes] = movers
    frozen_entries = np.arange(req.num_frozen_entries, dtype=np.int64)
    return list(range(f)) + kept, np.concatenate([frozen_entries, contents])


def plan_compaction(
    row: Tensor,
    survivors: Tensor,
    *,
    page_size: int,
    strategy: str = "hole_fill",
    positions: Tensor | None = None,
    immovable: Tensor | None = None,
    fresh_pages: Tensor | list[int] | None = (),
) -> CompactionPlan:
    """Plan one request's pass (see the module docstring for strategies and invariants).

    Args:
        row: int64 ``[tokens]`` slots of the request's cached tokens, in row order.
        survivors: int64 ascending indices into ``row`` of the tokens to keep.
        page_size: the KV page size.
        strategy: ``repack`` or ``hole_fill``.
        positions: int64 ``[tokens]`` logical positions (default: ``arange(tokens)``).
        immovable: bool ``[tokens]``, entries the request must not move (shared prefix).
        fresh_pages: page ids the caller allocated for ``repack``; unused ones stay the
            caller's. ``hole_fill`` never uses them.

    Raises:
        ValueError: malformed inputs, survivors dropping shared entries, or (as
            ``NotEnoughFreshPages``) too few fresh pages for ``repack``.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown compaction strategy {strategy!r}; known: {list(STRATEGIES)}")
    req = _Request(row, survivors, page_size, positions, immovable)
    if page_size == 1:
        return _plan_page_size_one(req, strategy)
    if strategy == "hole_fill":
        new_pages, contents = _plan_hole_fill(req)
        return _finish(req, new_pages, contents, [])
    fresh = [] if fresh_pages is None else [int(p) for p in fresh_pages]
    new_pages, contents, fresh_used = _plan_repack(req, fresh)
    return _finish(req, new_pages, contents, fresh_used)


def pages_freed_without_compaction(num_tokens: int, survivors: Tensor, page_size: int) -> int:
    """Pages an allocator could reclaim if evicted tokens were only marked dead: those
    whose every slot is evicted (what eviction without compaction returns)."""
    num_pages = -(-num_tokens // page_size)
    has_survivor = torch.zeros(num_pages, dtype=torch.bool)
    has_survivor[torch.div(survivors, page_size, rounding_mode="floor")] = True
    return int((~has_survivor).sum())


def fresh_pages_needed(
    row: Tensor,
    survivors: Tensor,
    *,
    page_size: int,
    strategy: str = "hole_fill",
    positions: Tensor | None = None,
    immovable: Tensor | None = None,
) -> int:
    """How many fresh pages ``plan_compaction`` will claim for these inputs."""
    if strategy == "hole_fill" or page_size == 1:
        return 0
    req = _Request(row, survivors, page_size, positions, immovable)
    return len(_plan_repack(req, None)[2])


def check_plan_invariants(
    plan: CompactionPlan,
    *,
    row: Tensor,
    survivors: Tensor,
    page_size: int,
    positions: Tensor | None = None,
    immovable: Tensor | None = None,
) -> None:
    """Raise ``PlanInvariantError`` naming the first of the five invariants ``plan``
    breaks for this request (module docstring)."""
    req = _Request(row, survivors, page_size, positions, immovable)
    P = req.P
    try:
        plan.validate_structure()
    except PlanError as error:  # invariants 1 and 3's independence of moves
        raise PlanInvariantError(f"invariant 1/3: {error}") from None
    if plan.page_size != P:
        raise PlanInvariantError(f"plan page size {plan.page_size} != {P}")
    new_row = plan.new_row.numpy()
    src, dst = plan.src_slots.numpy(), plan.dst_slots.numpy()
    # 2: simulate the moves on slot contents (entry ids), gather before scatter.
    content = {int(slot): entry for entry, slot in enumerate(req.row)}
    moved = [content.get(int(s)) for s in src]
    if any(m is None for m in moved):
        raise PlanInvariantError("invariant 2: a move reads a slot outside the request's row")
    for d, m in zip(dst.tolist(), moved, strict=True):
        content[d] = m
    seen = [content.get(int(slot)) for slot in new_row]
    if any(s is None for s in seen) or sorted(seen) != sorted(req.survivors.tolist()):
        raise PlanInvariantError("invariant 2: the new row does not read exactly the survivors")
    if not np.array_equal(
        plan.new_positions.numpy(), req.positions[np.array(seen, dtype=np.int64)]
    ):
        raise PlanInvariantError(
            "invariant 2: new_positions disagree with the survivors' positions"
        )
    # 3: destinations are never survivor slots, never immovable.
    survivor_slots = req.row[req.survivors]
    if np.isin(dst, survivor_slots).any():
        raise PlanInvariantError("invariant 3: a move overwrites a survivor's slot")
    own_slots = set(req.row.tolist())
    if req.N:
        last = int(req.page_ids[-1])
        own_slots |= set(range(last * P, (last + 1) * P))
    own_slots |= {p * P + o for p in plan.claimed_pages.tolist() for o in range(P)}
    if not set(dst.tolist()) <= own_slots:
        raise PlanInvariantError("invariant 3: a move writes a slot the request does not own")
    # 4: frozen pages untouched, in place, not freed.
    frozen_slots = req.row[: req.num_frozen_entries]
    frozen_pages = req.page_ids[: req.num_frozen_pages]
    if np.isin(src, frozen_slots).any() or np.isin(dst // P * P, frozen_pages * P).any():
        raise PlanInvariantError("invariant 4: a move touches a shared page")
    if np.isin(plan.freed_pages.numpy(), frozen_pages).any():
        raise PlanInvariantError("invariant 4: a shared page is freed")
    if not np.array_equal(new_row[: req.num_frozen_entries], frozen_slots):
        raise PlanInvariantError("invariant 4: a shared entry changed its row position")
    # 5: exact page accounting; every old page is either kept or freed.
    pages_after = -(-new_row.size // P)
    if plan.num_pages_freed != req.num_pages - pages_after:
        raise PlanInvariantError(
            f"invariant 5: {plan.num_pages_freed} pages freed, expected "
            f"{req.num_pages} - {pages_after}"
        )
    new_pages = set((new_row // P).tolist())
    old_pages = set(req.page_ids.tolist()) if P > 1 else set(req.row.tolist())
    if P > 1 and old_pages - new_pages != set(plan.freed_pages.tolist()):
        raise PlanInvariantError("invariant 5: freed pages are not exactly the pages left behind")
    if P == 1 and old_pages - set(new_row.tolist()) != set(plan.freed_pages.tolist()):
        raise PlanInvariantError("invariant 5: freed slots are not exactly the slots left behind")
