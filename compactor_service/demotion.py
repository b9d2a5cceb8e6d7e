"""A pass's demotions applied by the compactor: the tokens a pass does not keep,
quantized into the pool's tier arena (``shared_arena``) before the pass's moves
overwrite their slots.

The scheduler chooses everything (which tokens, which arena slots: ``plan``'s
``demote_*`` fields, checked by ``CompactionPlan.validate_demotion`` and
``check_batch``); the compactor reads the tokens' K and V rows, quantizes them with
the tier's own kernel (``quantize_into``: the compiled CPU kernel where it builds, the
reference otherwise: the same bytes) and writes each group at its arena slot. A target
is a slot the scheduler allotted for this pass and nothing reads until it commits the
pass, or the trash slot, which nothing reads: so a demotion that stops halfway (the
compactor killed, a deadline, a lost lease) leaves only unread slots written, and the
scheduler, which commits nothing, loses nothing.

Two forms, as for the moves: ``demote_tensors`` over stores and buffers in this
process, ``demote_files`` over a CPU pool's and arena's files (through their guarded
mappings once the guarded copy module is loaded, else ``pread``/``pwrite``: never an
unguarded mapping, ``shared_pool.PoolFile`` says why).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from compactor_service.plan import CompactionPlan, PlanError
from sglang_evict_kernels.tier_format import TierFormat, TierStore
from sglang_evict_kernels.tier_quant import quantize_into


class ArenaMissing(PlanError):
    """A pass demotes into a pool that registered no tier arena."""


def check_batch(
    plans: Sequence[CompactionPlan], fmt: TierFormat | None, arena_slots: int, num_slots: int
) -> tuple[Tensor, Tensor]:
    """Validate every plan's demotion and the batch's (no two requests demote one slot or
    claim one arena slot; no request demotes a slot another request's row keeps); return
    the batch's ``(token_slots [groups, G], targets [groups])``."""
    demoting = [i for i, p in enumerate(plans) if p.num_demoted_groups or p.arena_claimed.numel()]
    empty = torch.zeros(0, dtype=torch.int64)
    if not demoting:
        return empty.view(0, 1), empty
    if fmt is None:
        raise ArenaMissing(
            f"plan {demoting[0]} demotes into the tier, but this pool registered no tier "
            f"arena (RegisterArena): nothing was moved"
        )
    g = fmt.group_tokens
    for index in demoting:
        try:
            plans[index].validate_demotion(g, arena_slots, num_slots)
        except PlanError as error:
            raise PlanError(f"plan {index}: {error}") from None
    slots = torch.cat([p.demote_slots for p in plans])
    claimed = torch.cat([p.arena_claimed for p in plans])
    if torch.unique(slots).numel() != slots.numel():
        raise PlanError("two plans of one batch demote the same slot")
    if torch.unique(claimed).numel() != claimed.numel():
        raise PlanError("two plans of one batch claim the same arena slot")
    for index in demoting:
        others = [p.new_row for j, p in enumerate(plans) if j != index]
        if others and torch.isin(plans[index].demote_slots, torch.cat(others)).any():
            raise PlanError(f"plan {index} demotes a slot another plan's row keeps")
    targets = torch.cat([p.demote_targets for p in plans])
    return slots.view(-1, g), targets


def demote_tensors(
    stores: Sequence[TierStore],
    fmt: TierFormat,
    k_buffers: Sequence[Tensor],
    v_buffers: Sequence[Tensor],
    token_slots: Tensor,
    targets: Tensor,
) -> None:
    """Quantize ``token_slots`` ``[groups, G]`` of every layer into ``stores`` at
    ``targets``."""
    if not targets.numel():
        return
    device = k_buffers[0].device
    token_slots, targets = token_slots.to(device), targets.to(device)
    for store, k, v in zip(stores, k_buffers, v_buffers, strict=True):
        quantize_into(store, targets, k, v, token_slots, fmt)


def demote_files(pool_file, arena_file, token_slots: Tensor, targets: Tensor) -> None:
    """``demote_tensors`` over a CPU pool's file and its arena's file: each layer's rows
    read, quantized here, and each group's bytes written at its arena slot. The rows and
    the quantized groups pass through buffers made once a call and reused by every layer
    (each group's bytes are all written by the quantizer, so a reused store holds no
    earlier layer's)."""
    if not targets.numel():
        return
    layout, arena = pool_file.layout, arena_file.layout
    fmt = arena.format()
    groups, g = token_slots.shape
    rows = token_slots.reshape(-1)
    local = torch.arange(groups * g, dtype=torch.int64).view(groups, g)
    slots = torch.arange(groups)
    specs = {(s.layer, s.name): s for s in arena_file.specs}
    shape = (groups * g, layout.num_kv_heads, layout.head_dim)
    k_rows = torch.empty(shape, dtype=pool_file.dtype)
    v_rows = torch.empty(shape, dtype=pool_file.dtype)
    stores: dict[int, TierStore] = {}  # one a count of outlier rows
    for layer in range(layout.num_layers):
        k = pool_file.read_tokens(layer, rows, out=k_rows)
        v = pool_file.read_tokens(layout.num_layers + layer, rows, out=v_rows)
        outliers = fmt.outliers_for_layer(layer)
        store = stores.get(outliers)
        if store is None:
            store = stores[outliers] = TierStore.empty(
                fmt, groups, layout.num_kv_heads, pool_file.dtype, outliers=outliers
            )
        quantize_into(store, slots, k, v, local, fmt)
        for name, tensor in store.tensors().items():
            arena_file.write_rows(specs[(layer, name)], targets, tensor)
