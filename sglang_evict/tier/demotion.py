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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sglang_evict.tier.arena import TierArena
from sglang_evict.tier.policy import group_scores, groups_to_drop
from sglang_evict_kernels.tier_format import TierStore
from sglang_evict_kernels.tier_quant import quantize_into

_LAST = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class RequestDemotion:
    """One request's part (host ints)."""

    rid: str
    batch_index: int  # its row in the pass's [R, N] tensors
    new_groups: int  # groups of its cold tokens
    fresh: int  # arena slots it takes
    dropped: int  # groups given up (old or new): tokens gone from the KV
    row: int | None = None  # its request-pool row (the arena's row tables)


@dataclass
class Demotion:
    """A prepared demotion, committed with its pass (or dropped with a failed one)."""

    requests: list[RequestDemotion]
    targets: Tensor  # int64 [groups]: the arena slot of each new group (trash: given up)
    scores: Tensor  # float32 [groups]
    positions: Tensor  # int32 [groups, G]: each new group's logical positions
    scratch: list[TierStore]  # per layer, the groups quantized


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
) -> Demotion | None:
    """The demotion of a pass's requests (``rids[i]`` is row ``i`` of the ``[R, N]``
    tensors; ``demoted_tokens[i]`` a multiple of G). None when nothing is demoted."""
    g = arena.fmt.group_tokens
    device = slots.device
    free_left = arena.free_groups
    parts: list[RequestDemotion] = []
    token_slots, token_positions, targets, new_group_scores = [], [], [], []
    fresh_base = 0  # fresh slots promised to the requests before this one
    for i, (rid, demoted, bound) in enumerate(zip(rids, demoted_tokens, max_groups, strict=True)):
        new = demoted // g
        if new == 0:
            continue
        old = arena.groups_of(rid)
        fresh = max(0, min(new, bound - len(old), free_left))
        free_left -= fresh
        dropped = new - fresh  # groups over the bound or the arena, old or new
        order = _cold_order(valid[i], keep[i], positions[i], new * g)
        token_slots.append(slots[i].index_select(0, order).view(new, g))
        token_positions.append(positions[i].index_select(0, order).view(new, g))
        cleaned = torch.nan_to_num(
            scores[i].index_select(0, order).float(), nan=-1e30, posinf=1e30, neginf=-1e30
        )
        new_scores = group_scores(cleaned, g)
        new_group_scores.append(new_scores)
        # the slots ``take`` hands out at the commit, in its order
        fresh_slots = torch.tensor(arena.peek(fresh, after=fresh_base), dtype=torch.int64)
        fresh_base += fresh
        targets.append(_targets(arena, old, fresh_slots.to(device), new_scores, dropped, device))
        row = None if rows is None else rows[i]
        parts.append(RequestDemotion(rid, i, new, fresh, dropped, row))
    if not parts:
        return None
    all_tokens = torch.cat(token_slots)
    scratch = []
    index = torch.arange(all_tokens.shape[0], device=device)
    for layer, (k_buffer, v_buffer) in enumerate(zip(k_buffers, v_buffers, strict=True)):
        store = TierStore.empty(
            arena.fmt,
            all_tokens.shape[0],
            k_buffer.shape[1],
            k_buffer.dtype,
            device=device,
            outliers=arena.fmt.outliers_for_layer(layer),
        )
        quantize_into(store, index, k_buffer, v_buffer, all_tokens, arena.fmt)
        scratch.append(store)
    return Demotion(
        parts,
        torch.cat(targets),
        torch.cat(new_group_scores),
        torch.cat(token_positions).to(torch.int32),
        scratch,
    )


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
    trash = torch.tensor([arena.trash], dtype=torch.int64, device=device)
    old_slots = torch.tensor(old, dtype=torch.int64, device=device)
    all_scores = torch.cat([arena.scores.index_select(0, old_slots), new_scores])
    gone = torch.zeros(all_scores.numel(), dtype=torch.bool, device=device)
    gone[groups_to_drop(all_scores, dropped)] = True  # old first: ties to the older
    old_gone, new_kept = gone[: len(old)], ~gone[len(old) :]
    # The old slots given up first, then the kept ones (never reached by a rank).
    freed_first = old_slots.index_select(0, torch.argsort((~old_gone).to(torch.int8), stable=True))
    pool = torch.cat([fresh_slots, freed_first, trash])
    rank = (torch.cumsum(new_kept.to(torch.int64), 0) - 1).clamp(min=0)
    return torch.where(new_kept, pool.index_select(0, rank), trash)


def commit(arena: TierArena, demotion: Demotion) -> None:
    """Write the prepared groups at their slots and hand out the fresh slots."""
    for store, scratch in zip(arena.stores, demotion.scratch, strict=True):
        store.write(demotion.targets, scratch)
    arena.scores.index_copy_(0, demotion.targets, demotion.scores)
    arena.positions.index_copy_(0, demotion.targets, demotion.positions)
    for part in demotion.requests:
        arena.take(part.rid, part.fresh, row=part.row)


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
    return prepare(
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
    )


def note_results(results, demotion: Demotion, group_tokens: int) -> None:
    """Each request's ``PassResult`` gains the tokens it demoted and gave up."""
    by_rid = {r.rid: r for r in results}
    for part in demotion.requests:
        result = by_rid[part.rid]
        result.tokens_demoted = part.new_groups * group_tokens
        result.tokens_dropped = part.dropped * group_tokens
