"""A batched pass's device work, from two device buffers to committed rows.

Everything a pass does on the pool's device, given the packed host ints
(``passes.batch.inputs.host_columns``) and the claimed staging pages: gather the rows and
positions, score, select, plan (``passes.batch``), move the slots in-process, and write
the rows, positions, carried scores and offsets. Nothing here reads device data on the
host or sizes a tensor from device data (shapes come from ``PassStep.shape``), so
``device_pass`` is what a CUDA graph captures (``sglang_evict.passes.graphs``).

The functions act on an ``EvictionManager`` (``sglang_evict.passes.manager``), the mechanism
that owns the pool access and the per-row tables they update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from compactor_service import tracing
from sglang_evict.passes.batch import (
    BatchPlan,
    PlanInputs,
    plan_hole_fill,
    plan_repack,
    protected_ranges_mask,
    score_rows_or_fall_back,
    select_keep,
)
from sglang_evict.passes.batch.counts import PAGE_COUNTS
from sglang_evict.passes.batch.indices import arange
from sglang_evict.passes.batch.inputs import gather_inputs, unpack_columns
from sglang_evict.passes.batch.shapes import PassShape
from sglang_evict.scorers import Scorer
from sglang_evict_kernels import repack_kv_independent


@dataclass(frozen=True)
class PassStep:
    """What a pass's device work is specialised to (host values; ``scorers`` and the
    host lengths are padded to ``shape.requests`` with request 0's scorer and 0)."""

    shape: PassShape
    strategy: str
    scorers: tuple[Scorer, ...]
    use_pool_kernels: bool
    with_queries: bool
    lengths: tuple[int, ...]
    current_positions: tuple[int, ...]


def pad_claimed(claimed: Tensor | None, total: int, device) -> Tensor:
    """The claimed staging pages padded to ``total`` (the shape's staging bucket)."""
    if claimed is None:
        return torch.zeros(total, dtype=torch.int64, device=device)
    # Always the same two operations, whether or not the bucket is full.
    tail = torch.zeros(total - claimed.numel(), dtype=torch.int64, device=device)
    return torch.cat([claimed.to(torch.int64), tail])


def device_pass(manager, step: PassStep, packed: Tensor, staging: Tensor) -> tuple[Tensor, Tensor]:
    """The whole pass on the device, from the packed ints and the claimed staging
    pages: what a graph captures. Returns ``(released pages, copies per request)``."""
    columns, rows_raw, scores, plan = score_and_plan(manager, step, packed, staging)
    repack_kv_independent(
        manager.pool.k_buffers, manager.pool.v_buffers, plan.src.reshape(-1), plan.dst.reshape(-1)
    )
    commit_writes(manager, columns, rows_raw, plan, scores)
    return plan.release, plan.move_counts()


def score_and_plan(manager, step: PassStep, packed: Tensor, staging_flat: Tensor, on_keep=None):
    """``(columns, rows_raw, scores, plan)`` of a pass, on the device. ``on_keep``:
    called with ``(view, keep, scores)`` once the survivors are chosen, before any
    plan or move (the tier's demotion reads the tokens not kept where they lie)."""
    tracer = tracing.tracer()
    shape = step.shape
    columns = unpack_columns(packed)
    inputs = gather_inputs(
        pool=manager.pool,
        positions_by_row=manager.positions_by_row,
        columns=columns,
        width=shape.width,
        lengths=step.lengths,
        current_positions_host=step.current_positions,
        use_pool_kernels=step.use_pool_kernels,
        query_ring=manager.query_ring if step.with_queries else None,
        accumulated_by_row=manager.accumulated_by_row,
    )
    view = inputs.view
    with tracer.start_as_current_span(tracing.SPAN_SCORE):
        scores, fell_back = score_rows_or_fall_back(step.scorers, view)
        if fell_back:  # a kernel failed on this GPU: the torch forms from now on
            manager.use_pool_kernels = False
        if manager.score_reducer is not None:
            scores = manager.score_reducer(scores)
    protected = protected_ranges_mask(
        view.positions, view.valid, columns["lead_end"], columns["window_start"]
    )
    keep, nonfinite = select_keep(
        scores, view.positions, view.valid, protected, columns["evicted"], shape.evicted
    )
    manager.nonfinite_scores_device += nonfinite.sum()
    if on_keep is not None:
        on_keep(view, keep, scores)
    staging, given = staging_layout(manager, columns, staging_flat, shape)
    with tracer.start_as_current_span(tracing.SPAN_PLAN):
        plan_inputs = PlanInputs(
            page_size=manager.config.page_size,
            rows=view.slots,
            keep=keep,
            positions=view.positions,
            survivors=columns["survivors"],
            frozen_len=columns["frozen_len"],
            max_survivors=shape.survivors,
            num_released=shape.released,
            **{name: columns[name] for name in PAGE_COUNTS},
        )
        plan = (
            plan_repack(plan_inputs, staging, given)
            if step.strategy == "repack"
            else plan_hole_fill(plan_inputs)
        )
    return columns, inputs.rows_raw, scores, plan


def staging_layout(manager, columns, staging_flat: Tensor, shape: PassShape):
    """``(staging [R, U], given [R, U])``: the claimed staging pages laid out per
    request (``staging_flat``: all of them, padded to ``shape.staging_total``)."""
    R, U = shape.requests, shape.staging_width
    if shape.staging_total == 0:
        empty = torch.zeros(R, 0, dtype=torch.int64, device=manager.device)
        return empty, empty.bool()
    column = arange(U, manager.device).unsqueeze(0)
    given = column < columns["staging"].unsqueeze(1)
    starts = columns["staging_base"].unsqueeze(1)
    index = torch.where(given, starts + column, shape.staging_total)
    padded = torch.cat([staging_flat.to(torch.int64), staging_flat.new_zeros(1)])
    return padded[index], given


def commit_writes(manager, columns, rows_raw: Tensor, plan: BatchPlan, scores: Tensor) -> None:
    """Rows, positions, carried scores and offsets on the device (no host wait).
    Padded requests repeat request 0's writes (``alias``): same index, same values.
    Nothing here can refuse: it matches what moved."""
    width = plan.new_row.shape[1]
    rows, alias = columns["row"], columns["alias"]
    new_rows = torch.where(plan.live, plan.new_row, rows_raw[:, :width])
    manager.pool.write_rows(rows, new_rows.index_select(0, alias))
    table_index = (rows.unsqueeze(1), arange(width, manager.device).unsqueeze(0))
    new_positions = plan.new_positions.index_select(0, alias)
    manager.positions_by_row.index_put_(table_index, new_positions.to(torch.int32))
    if manager.accumulated_by_row is not None:  # each survivor's score moves with it
        content = plan.content.clamp(max=scores.shape[1] - 1)
        carried = scores.gather(1, content).index_select(0, alias)
        manager.accumulated_by_row.index_put_(table_index, carried)
    manager.offsets_by_row.index_put_((rows,), columns["offset_after"])
