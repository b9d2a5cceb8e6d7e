"""The padded device inputs of a batched pass, built from host ints and the pool.

Every per-request int the device needs goes over in one packed host-to-device copy
(pinned, non-blocking on a GPU); rows and logical positions are gathered on the device
from the request-to-token pool and the positions table. Nothing is read back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sglang_evict.batch_pass.counts import PAGE_COUNTS, PassCounts, ceil_div, page_counts
from sglang_evict.batch_pass.indices import arange
from sglang_evict.scorers.base import BatchKVView
from sglang_evict_kernels import device_int64

# Per-request ints, one int64 row each of the packed tensor.
COLUMNS = (
    "row",  # request-pool row
    "kv_len",
    "offset",  # position offset before the pass
    "compacted_len",  # leading entries whose positions are in the table
    "lead_end",  # protected ranges (counts)
    "window_start",
    "frozen_len",
    "survivors",
    "evicted",
    "offset_after",  # position offset after the pass
    "staging",  # staging pages given (repack)
    "staging_base",  # where they start in the claimed pages
    *PAGE_COUNTS,  # the planners' page counts (``counts.page_counts``)
)


@dataclass(frozen=True)
class BatchInputs:
    """``columns``: int64 ``[R]`` device tensor per name of ``COLUMNS``; ``rows_raw``:
    int64 ``[R, N]`` request-to-token entries as stored (past ``kv_len``: whatever the
    pool holds); ``view``: what the scorer reads (padding slots: 0)."""

    columns: dict[str, Tensor]
    rows_raw: Tensor
    view: BatchKVView


def batch_inputs(
    *,
    pool,
    positions_by_row: Tensor,
    row_of_request: list[int],
    compacted_lens: list[int],
    counts: list[PassCounts],
    staging_counts: list[int],
    use_pool_kernels: bool,
    query_ring=None,
    accumulated_by_row: Tensor | None = None,
) -> BatchInputs:
    """Pack the host ints, gather rows and positions (``sglang_evict.evictor`` module
    docstring: positions past ``compacted_len`` are ``index + offset``); with a
    ``query_ring`` (``sglang_evict.query_capture.QueryRing``) the requests' captured
    queries, with ``accumulated_by_row`` (float32, shaped like the positions table) the
    scores carried over from earlier passes (entries appended since: 0)."""
    device = positions_by_row.device
    staging_base = [sum(staging_counts[:i]) for i in range(len(staging_counts))]
    values = [
        (
            row,
            c.kv_len,
            c.next_position - c.kv_len,
            compacted,
            c.lead_end,
            c.window_start,
            c.frozen_len,
            c.survivors,
            c.tokens_evicted,
            c.next_position - c.survivors,
            staging,
            base,
            *page_counts(
                kv_len=c.kv_len,
                survivors=c.survivors,
                frozen_len=c.frozen_len,
                page_size=c.page_size,
            ),
        )
        for row, compacted, c, staging, base in zip(
            row_of_request, compacted_lens, counts, staging_counts, staging_base, strict=True
        )
    ]
    packed = device_int64([v for column in zip(*values, strict=True) for v in column], device)
    columns = dict(zip(COLUMNS, packed.view(len(COLUMNS), len(counts)), strict=True))
    # Whole pages when the row capacity allows: the planner's page grid is then a view.
    page_size = counts[0].page_size
    width = min(
        ceil_div(max(c.kv_len for c in counts), page_size) * page_size, positions_by_row.shape[1]
    )
    index = arange(width, device).unsqueeze(0)
    rows_raw = pool.read_rows(columns["row"], width)
    valid = index < columns["kv_len"].unsqueeze(1)
    table = positions_by_row[:, :width].index_select(0, columns["row"]).to(torch.int64)
    positions = torch.where(
        index < columns["compacted_len"].unsqueeze(1),
        table,
        index + columns["offset"].unsqueeze(1),
    )
    current_positions = columns["kv_len"] + columns["offset"]
    accumulated = None
    if accumulated_by_row is not None:
        carried = accumulated_by_row[:, :width].index_select(0, columns["row"])
        accumulated = torch.where(index < columns["compacted_len"].unsqueeze(1), carried, 0.0)
    view = BatchKVView(
        k_buffers=pool.k_buffers,
        slots=torch.where(valid, rows_raw, 0),
        positions=positions,
        valid=valid,
        current_positions=current_positions,
        lengths=tuple(c.kv_len for c in counts),
        current_positions_host=tuple(c.next_position for c in counts),
        gather_keys=pool.gather_keys,
        use_pool_kernels=use_pool_kernels,
        gather_layer_keys=pool.gather_layer_keys,
        queries=None
        if query_ring is None
        else query_ring.window_of(columns["row"], current_positions),
        accumulated_scores=accumulated,
    )
    return BatchInputs(columns=columns, rows_raw=rows_raw, view=view)
