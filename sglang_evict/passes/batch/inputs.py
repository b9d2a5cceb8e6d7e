"""The padded device inputs of a batched pass, built from host ints and the pool.

Every per-request int the device needs goes over in one packed host-to-device copy
(``host_columns``: pinned, non-blocking on a GPU; into a graph's static buffer when the
pass is replayed); rows and logical positions are gathered on the device from the
request-to-token pool and the positions table (``gather_inputs``). Nothing is read back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from sglang_evict.passes.batch.counts import PAGE_COUNTS, BatchCounts
from sglang_evict.passes.batch.indices import arange
from sglang_evict.passes.batch.shapes import PassShape
from sglang_evict.scorers.base import BatchKVView

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
    "alias",  # the request whose writes this one repeats: itself; padding: 0
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


def host_columns(
    *,
    row_of_request: np.ndarray,
    compacted_lens: np.ndarray,
    counts: BatchCounts,
    staging_counts: np.ndarray,
    shape: PassShape,
) -> np.ndarray:
    """The packed host ints of a pass (int64): ``COLUMNS`` one after the other, each
    ``shape.requests`` long. Requests past the due ones are padding: no entry, nothing
    kept, moved or released, and request 0's row, offset and writes (``alias``), so
    their writes repeat request 0's exactly (``shapes`` module docstring)."""
    R, n = shape.requests, len(counts)
    packed = np.zeros((len(COLUMNS), R), dtype=np.int64)  # padding: 0 but for 3 columns
    staging_base = np.cumsum(staging_counts) - staging_counts  # where each one's start
    offset_after = counts.next_position - counts.survivors
    packed[:, :n] = (
        row_of_request,
        counts.kv_len,
        counts.next_position - counts.kv_len,
        compacted_lens,
        counts.lead_end,
        counts.window_start,
        counts.frozen_len,
        counts.survivors,
        counts.tokens_evicted,
        offset_after,
        staging_counts,
        staging_base,
        np.arange(n),  # alias: itself
        *counts.page_counts(),
    )
    packed[_ROW, n:] = row_of_request[0]
    packed[_OFFSET_AFTER, n:] = offset_after[0]
    return packed.reshape(-1)


_ROW, _OFFSET_AFTER = COLUMNS.index("row"), COLUMNS.index("offset_after")


def unpack_columns(packed: Tensor) -> dict[str, Tensor]:
    """``COLUMNS`` as views of the packed ``[len(COLUMNS) * R]`` device tensor."""
    return dict(zip(COLUMNS, packed.view(len(COLUMNS), -1), strict=True))


def gather_inputs(
    *,
    pool,
    positions_by_row: Tensor,
    columns: dict[str, Tensor],
    width: int,
    lengths: tuple[int, ...],
    current_positions_host: tuple[int, ...],
    use_pool_kernels: bool,
    query_ring=None,
    accumulated_by_row: Tensor | None = None,
) -> BatchInputs:
    """Rows and positions gathered on the device (``sglang_evict.passes.manager`` module
    docstring: positions past ``compacted_len`` are ``index + offset``); with a
    ``query_ring`` (``sglang_evict.query_capture.QueryRing``) the requests' captured
    queries, with ``accumulated_by_row`` (float32, shaped like the positions table) the
    scores carried over from earlier passes (entries appended since: 0). ``lengths``
    and ``current_positions_host``: the host's copies, padded with 0 (read only by the
    scorers scored one request at a time)."""
    index = arange(width, positions_by_row.device).unsqueeze(0)
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
        lengths=lengths,
        current_positions_host=current_positions_host,
        gather_keys=pool.gather_keys,
        use_pool_kernels=use_pool_kernels,
        gather_layer_keys=pool.gather_layer_keys,
        queries=None
        if query_ring is None
        else query_ring.window_of(columns["row"], current_positions),
        accumulated_scores=accumulated,
    )
    return BatchInputs(columns=columns, rows_raw=rows_raw, view=view)
