"""A pass's demotion: the tokens it does not keep enter their requests' tiers, in
whole groups, before the pass's moves overwrite their slots.

Two steps, so that a pass that fails before anything moved leaves the tier as it was:

    prepare (after selection, before the moves)
        per request: its cold entries (valid, not kept) in position order, cut into
        groups of G; each group's score (the highest of its tokens' scores: a group
        holding one token the scorer ranks high is worth keeping whole); which
        groups the tier gives up when it would pass its bound (lowest score, ties to
        the older: ``tier.policy.groups_to_drop``'s rule, on the device); the slot
        each kept new group goes to (a fresh arena slot, or the slot of an old group
        given up); then every group quantized from the pool's slots into a scratch
        store, one quantize call per layer for the whole pass
    commit (after the moves, with the pass's own commit)
        the scratch groups written at their slots, their scores and positions stored,
        the fresh slots handed to their requests (host)

Nothing here reads device data on the host: the counts (groups per request, fresh
slots, groups given up) are host ints the pass already knows, and the choices made on
the device (which groups go, which slots they take) are tensors of host-known shapes.
A group given up at once (a pass demoting more than the tier's room) is written to the
arena's trash slot, which nothing reads.

With the compactor sidecar (``sidecar=True``) the compactor quantizes, so ``prepare``
only chooses: each request's token slots, targets and claimed arena slots go into its
``CompactionPlan`` (``plan_fields``), and nothing is quantized here. A sidecar's
demotion may fail halfway, so its targets are only slots nothing reads until the
commit: fresh slots, then, for a kept new group that replaces an old one given up,
another fresh slot (a *swap*: the old slot is freed at the commit) instead of the old
slot, which the request's attention still reads; the trash slot. A pass whose swaps
the arena has no free slots for is demoted in-process instead (``Demotion.sidecar``
False: the same choice of groups, the old slots overwritten at the commit).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from sglang_evict.tier.arena import TierArena
from sglang_evict.tier.policy import group_scores, groups_to_drop
from sglang_evict_kernels.tier_format import TierStore
from sglang_evict_kernels.tier_quant import quantize_into

_LAST = torch.iinfo(torch.int64).max
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestDemotion:
    """One request's part (host ints)."""

    rid: str
    batch_index: int  # its row in the pass's [R, N] tensors
    new_groups: int  # groups of its cold tokens
    fresh: int  # arena slots it takes
    dropped: int  # groups given up (old or new): tokens gone from the KV
    row: int | None = None  # its request-pool row (the arena's row tables)
    swaps: int = 0  # sidecar: arena slots claimed beyond ``fresh`` (at most this many used)
    claimed: tuple[int, ...] = ()  # sidecar: its claimed arena slots (fresh, then swaps)
    old: tuple[int, ...] = ()  # sidecar: the slots it held before the pass


@dataclass
class Demotion:
    """A prepared demotion, committed with its pass (or dropped with a failed one)."""

    requests: list[RequestDemotion]
    targets: Tensor  # int64 [groups]: the arena slot of each new group (trash: given up)
    scores: Tensor  # float32 [groups]
    positions: Tensor  # int32 [groups, G]: each new group's logical positions
    scratch: list[TierStore] | None  # per layer, the groups quantized (None: the sidecar)
    token_slots: Tensor | None = None  # int64 [groups, G] (the sidecar's plans)
    old_gone: list[Tensor] | None = None  # sidecar: per request, bool [old]: given up

    @property
    def sidecar(self) -> bool:
        """Whether the compactor sidecar quantizes this demotion (``plan_fields``)."""
        return self.scratch is None

    def plan_fields(self) -> dict[int, dict[str, Tensor]]:
        """Batch index -> the ``CompactionPlan`` demotion fields of that request (host
        int64: ``demote_slots``, ``demote_targets``, ``arena_claimed``)."""
        token_slots, targets = self.token_slots.cpu(), self.targets.cpu()
        fields, start = {}, 0
        for part in self.requests:
            end = start + part.new_groups
            fields[part.batch_index] = {
                "demote_slots": token_slots[start:end].reshape(-1).clone(),
                "demote_targets": targets[start:end].clone(),
                "arena_claimed": torch.tensor(part.claimed, dtype=torch.int64),
            }
            start = end
        return fields


def _cold_order(valid: Tensor, keep: Tensor, positions: Tensor, count: int) -> Tensor:
    """Columns of the first ``count`` cold entries (valid, not kept) in position order."""
    key = torch.where(valid & ~keep, positions.to(torch.int64), _LAST)
    return torch.argsort(key, stable=True)[:count]


def prepare(
    arena: TierArena,
    *,
    rids: list[str],
    demoted_tokens: list[int],
    max_groups: list[int],
    slots: Tensor,
    positions: Tensor,
    valid: Tensor,
    keep: Tensor,
    scores: Tensor,
    k_buffers: list[Tensor],
    v_buffers: list[Tensor],
    rows: list[int] | None = None,
    sidecar: bool = False,
) -> Demotion | None:
    """The demotion of a pass's requests (``rids[i]`` is row ``i`` of the ``[R, N]``
    tensors; ``demoted_tokens[i]`` a multiple of G). None when nothing is demoted.
    ``sidecar``: for the compactor sidecar (module docstring), unless the arena lacks
    the free slots its swaps need."""
    g = arena.fmt.group_tokens
    device = slots.device
    counts = []  # (i, rid, new groups, old slots, fresh, dropped)
    free_left = arena.free_groups
    for i, (rid, demoted, bound) in enumerate(zip(rids, demoted_tokens, max_groups, strict=True)):
        new = demoted // g
        if new == 0:
            continue
        old = arena.groups_of(rid)
        fresh = max(0, min(new, bound - len(old), free_left))
        free_left -= fresh
        counts.append((i, rid, new, old, fresh, new - fresh))  # dropped: old or new
    if not counts:
        return None
    swaps = [min(dropped, len(old)) for *_, old, _, dropped in counts]
    sidecar = sidecar and sum(swaps) <= free_left
    parts: list[RequestDemotion] = []
    token_slots, token_positions, targets, new_group_scores, old_gone = [], [], [], [], []
    fresh_base = 0  # fresh slots promised to the requests before this one
    for (i, rid, new, old, fresh, dropped), swap in zip(counts, swaps, strict=True):
        order = _cold_order(valid[i], keep[i], positions[i], new * g)
        token_slots.append(slots[i].index_select(0, order).view(new, g))
        token_positions.append(positions[i].index_select(0, order).view(new, g))
        cleaned = torch.nan_to_num(
            scores[i].index_select(0, order).float(), nan=-1e30, posinf=1e30, neginf=-1e30
        )
        new_scores = group_scores(cleaned, g)
        new_group_scores.append(new_scores)
        claims = fresh + swap if sidecar else fresh
        # the slots ``take`` hands out at the commit, in its order
        claimed = arena.peek(claims, after=fresh_base)
        fresh_base += claims
        fresh_slots = torch.tensor(claimed, dtype=torch.int64, device=device)
        if sidecar:
            chosen, gone = _sidecar_targets(arena, old, fresh_slots, new_scores, dropped, device)
            targets.append(chosen)
            old_gone.append(gone)
        else:
            targets.append(_targets(arena, old, fresh_slots, new_scores, dropped, device))
        row = None if rows is None else rows[i]
        extra = {"swaps": swap, "claimed": tuple(claimed), "old": tuple(old)} if sidecar else {}
        parts.append(RequestDemotion(rid, i, new, fresh, dropped, row, **extra))
    all_tokens = torch.cat(token_slots)
    scratch = None if sidecar else _quantize(arena, all_tokens, k_buffers, v_buffers)
    return Demotion(
        parts,
        torch.cat(targets),
        torch.cat(new_group_scores),
        torch.cat(token_positions).to(torch.int32),
        scratch,
        token_slots=all_tokens if sidecar else None,
        old_gone=old_gone if sidecar else None,
    )


def _quantize(
    arena: TierArena, token_slots: Tensor, k_buffers: list[Tensor], v_buffers: list[Tensor]
) -> list[TierStore]:
    """``token_slots`` ``[groups, G]`` of every layer quantized into scratch stores."""
    index = torch.arange(token_slots.shape[0], device=token_slots.device)
    scratch = []
    for layer, (k_buffer, v_buffer) in enumerate(zip(k_buffers, v_buffers, strict=True)):
        store = TierStore.empty(
            arena.fmt,
            token_slots.shape[0],
            k_buffer.shape[1],
            k_buffer.dtype,
            device=token_slots.device,
            outliers=arena.fmt.outliers_for_layer(layer),
        )
        quantize_into(store, index, k_buffer, v_buffer, token_slots, arena.fmt)
        scratch.append(store)
    return scratch


def _given_up(
    arena: TierArena, old: list[int], new_scores: Tensor, dropped: int, device
) -> tuple[Tensor, Tensor, Tensor]:
    """``(old slots, old given up [old], new kept [new])``: the tier keeps its highest-
    scored groups, old and new (ties to the older); ``dropped`` go."""
    old_slots = torch.tensor(old, dtype=torch.int64, device=device)
    all_scores = torch.cat([arena.scores.index_select(0, old_slots), new_scores])
    gone = torch.zeros(all_scores.numel(), dtype=torch.bool, device=device)
    gone[groups_to_drop(all_scores, dropped)] = True  # old first: ties to the older
    return old_slots, gone[: len(old)], ~gone[len(old) :]


def _ranked(pool: Tensor, new_kept: Tensor, trash: int) -> Tensor:
    """Kept new groups take ``pool``'s slots in order; the others the trash slot."""
    rank = (torch.cumsum(new_kept.to(torch.int64), 0) - 1).clamp(min=0)
    return torch.where(new_kept, pool.index_select(0, rank), trash)


def _sidecar_targets(
    arena: TierArena,
    old: list[int],
    claimed: Tensor,
    new_scores: Tensor,
    dropped: int,
    device,
) -> tuple[Tensor, Tensor]:
    """``_targets`` for the sidecar: kept new groups take ``claimed`` slots only (fresh,
    then swaps), never an old group's slot; also which old groups go (bool [old])."""
    if dropped == 0:
        return claimed, torch.zeros(len(old), dtype=torch.bool, device=device)
    _, old_gone, new_kept = _given_up(arena, old, new_scores, dropped, device)
    trash = torch.tensor([arena.trash], dtype=torch.int64, device=device)
    return _ranked(torch.cat([claimed, trash]), new_kept, arena.trash), old_gone


def _targets(
    arena: TierArena,
    old: list[int],
    fresh_slots: Tensor,
    new_scores: Tensor,
    dropped: int,
    device,
) -> Tensor:
    """The arena slot of each of a request's new groups: the tier keeps its highest-
    scored groups, old and new (ties to the older), ``dropped`` go; a kept new group
    takes a fresh slot, then the slot of an old group given up; a new group given up
    goes to the trash slot."""
    if dropped == 0:  # every new group has a fresh slot
        return fresh_slots
    old_slots, old_gone, new_kept = _given_up(arena, old, new_scores, dropped, device)
    trash = torch.tensor([arena.trash], dtype=torch.int64, device=device)
    # The old slots given up first, then the kept ones (never reached by a rank).
    freed_first = old_slots.index_select(0, torch.argsort((~old_gone).to(torch.int8), stable=True))
    return _ranked(torch.cat([fresh_slots, freed_first, trash]), new_kept, arena.trash)


def commit(arena: TierArena, demotion: Demotion) -> None:
    """Write the prepared groups at their slots (the sidecar wrote them already) and
    hand out the fresh slots (with the sidecar: the claimed slots used, the old slots
    their swaps replace freed)."""
    if demotion.scratch is not None:
        for store, scratch in zip(arena.stores, demotion.scratch, strict=True):
            store.write(demotion.targets, scratch)
    arena.scores.index_copy_(0, demotion.targets, demotion.scores)
    arena.positions.index_copy_(0, demotion.targets, demotion.positions)
    if demotion.scratch is not None:
        for part in demotion.requests:
            arena.take(part.rid, part.fresh, row=part.row)
        return
    claims = []
    for part, gone in zip(demotion.requests, demotion.old_gone, strict=True):
        released = [slot for slot, g in zip(part.old, gone.tolist(), strict=True) if g]
        used = part.fresh + len(released)  # kept new groups: fresh, then one a swap
        claims.append((part.rid, part.row, list(part.claimed), used, released))
    arena.take_claimed(claims)


def prepare_pass(manager, work, view, keep: Tensor, scores: Tensor) -> Demotion | None:
    """``prepare`` for one pass of ``manager`` (an ``EvictionManager``) over ``work``
    (``passes.host_work.PassWork``): every token the pass does not keep
    (``counts.tokens_evicted``, whole groups under a tier) enters its request's tier,
    up to the request's bound (``RequestPolicy.tier_tokens``; 0: evicted)."""
    if manager.tier_arena is None:
        raise ValueError(
            "--kv-tier-bits is set but no tier arena is attached: the engine (or driver) "
            "must size one (sglang_evict.tier.arena)"
        )
    g = manager.tier_policy.group_tokens
    tiered = [p.tier_tokens > 0 for p in work.policies]
    sidecar = manager.compactor is not None
    demotion = prepare(
        manager.tier_arena,
        rids=[d.rid for d in work.due],
        demoted_tokens=[
            n if t else 0 for n, t in zip(work.counts.tokens_evicted.tolist(), tiered, strict=True)
        ],
        max_groups=[p.tier_tokens // g for p in work.policies],
        slots=view.slots,
        positions=view.positions,
        valid=view.valid,
        keep=keep,
        scores=scores,
        k_buffers=manager.pool.k_buffers,
        v_buffers=manager.pool.v_buffers,
        rows=[d.req_pool_idx for d in work.due],
        sidecar=sidecar,
    )
    if sidecar and demotion is not None and not demotion.sidecar:
        _fell_back(manager, "arena-full")
    return demotion


def _fell_back(manager, cause: str) -> None:
    """Count (and, the first time, log) a demotion the sidecar could not take."""
    manager.tier_fallbacks[cause] += 1
    if manager.tier_fallbacks[cause] == 1:
        logger.warning(
            "sglang-evict: a tier demotion ran in-process instead of on the compactor "
            "sidecar (%s: %s); counted in tier_fallbacks",
            cause,
            FALLBACK_CAUSES[cause],
        )


# Why a demotion ran in-process with the sidecar configured.
FALLBACK_CAUSES = {
    "arena-full": "the arena had no free slots for the pass's swaps, so the old slots "
    "its new groups replace were overwritten in place at the commit",
}


def note_results(results, demotion: Demotion, group_tokens: int) -> None:
    """Each request's ``PassResult`` gains the tokens it demoted and gave up."""
    by_rid = {r.rid: r for r in results}
    for part in demotion.requests:
        result = by_rid[part.rid]
        result.tokens_demoted = part.new_groups * group_tokens
        result.tokens_dropped = part.dropped * group_tokens


def attach_arena(manager, arena: TierArena, shared=None) -> None:
    """Give ``manager`` (an ``EvictionManager``) its tier arena. With the compactor
    sidecar, ``shared`` (the arena's ``SharedArena``: ``tier.arena.make_arena``) is
    registered with it and its stores given to the in-process fallback."""
    manager.tier_arena = arena
    if manager.compactor is None:
        return
    if shared is None:
        raise ValueError(
            "--kv-tier-bits with --kv-compactor grpc: the tier's arena must be shared with "
            "the sidecar (tier.arena.make_arena with its pool directory)"
        )
    manager.compactor.attach_arena(arena.stores, arena.fmt, shared.layout)
