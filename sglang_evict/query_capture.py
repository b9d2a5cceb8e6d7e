"""The query ring: the last ``W`` queries of every running request, every layer, in
buffers allocated once, written by the attention forward and read by the batched pass
(``window``, ``rkv``).

FlashAttention-style kernels never materialise attention scores, and the plugin leaves
the server's kernel alone: it copies each layer's queries (after RoPE, as the attention
backend receives them) into this ring, and the scorers compute the ``W x N`` logits they
need at pass time (``sglang_evict.scorers.window``).

Layout (``W`` = ``query_window_tokens``, rows = SGLang's request-pool rows + 1)::

    queries[layer]  [rows, W, q_heads, head_dim]   the model's dtype
    positions       [rows, W] int64                logical position held; -1: empty

    row  = the request's request-pool row (``req_pool_idx``). Row 0 is SGLang's padding
           row (padded CUDA-graph entries read and write it harmlessly); the last row
           is the ring's scratch row, where the tokens of an extend batch that are not
           among their request's last W land.
    cell = position % W

A query at logical position ``p`` goes to cell ``p % W`` of its request's row, so the row
always holds the newest query of each residue class, and at a pass (next position
``P``) the cells whose position lies in ``[P - W, P)`` are exactly the request's last
``W`` queries that were computed. A cell written by the row's previous request can
never pass that test by accident: rows are reset (every position -1) when SGLang hands a
row to a new request (``claim_rows``, keyed by the request pool's per-row generation),
before the request's first forward.

Writes are plain ``index_put_`` copies of the forward's own tensors into these buffers
at device index tensors (the op SGLang writes its KV cache with): no allocation that
outlives the call, no host synchronisation, no data-dependent shape. A CUDA graph
captured with the writes replays them against the same buffers, with the request rows
and positions the graph runner copies into its static inputs.

Cost: ``ring_bytes = rows * W * (layers * q_heads * head_dim * dtype_bytes + 8)``, the
8 bytes being a cell's int64 position. The server counts it against the KV pool
(``kv_tokens_for``): the pool is that many tokens smaller, rounded up to whole pages.
Per request row that is ``W * q_heads * head_dim / (kv_heads * (k_dim + v_dim))`` KV
tokens of the same dtype: ``W * G / 2`` for a GQA group of ``G`` (64 tokens a row for
Llama-3-8B at ``W`` = 32).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from sglang_evict.scorers.base import QueryWindow
from sglang_evict_kernels import device_int64

POSITION_BYTES = 8  # int64
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
    """

    num_layers: int
    num_request_rows: int
    window: int
    num_q_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def num_rows(self) -> int:
        return self.num_request_rows + 1

    @property
    def bytes_per_row(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        per_query = self.num_layers * self.num_q_heads * self.head_dim * element
        return self.window * (per_query + POSITION_BYTES)

    @property
    def total_bytes(self) -> int:
        """``rows * W * (layers * q_heads * head_dim * dtype_bytes + 8)``."""
        return self.num_rows * self.bytes_per_row


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
    """The ring (module docstring); one per scheduler process."""

    def __init__(self, shape: RingShape, device: str | torch.device = "cpu") -> None:
        self.shape = shape
        self.window = shape.window
        self.device = torch.device(device)
        self.scratch_row = shape.num_rows - 1
        cells = (shape.num_rows, shape.window)
        self.queries = [
            torch.zeros(
                *cells, shape.num_q_heads, shape.head_dim, dtype=shape.dtype, device=self.device
            )
            for _ in range(shape.num_layers)
        ]
        self.positions = torch.full(cells, EMPTY, dtype=torch.int64, device=self.device)
        # The request-pool generation each row was last reset for (host ints).
        self._generation = [None] * shape.num_rows

    @property
    def nbytes(self) -> int:
        """Bytes the ring's buffers hold (equals ``shape.total_bytes``)."""
        buffers = (*self.queries, self.positions)
        return sum(b.numel() * b.element_size() for b in buffers)

    # --- writes (the attention forward) ------------------------------------------------

    def claim_rows(self, rows: Sequence[int], generations: Sequence[int]) -> None:
        """Reset each row whose request-pool generation changed since its last reset: a
        new request holds it now. Call before that request's first forward writes, on
        the stream the forwards run on (host ints in, one device fill out)."""
        stale = []
        for row, generation in zip(rows, generations, strict=True):
            if self._generation[row] != generation:
                self._generation[row] = generation
                stale.append(row)
        if stale:
            self.positions.index_fill_(0, device_int64(stale, self.device), EMPTY)

    def write(self, layer: int, queries: Tensor, rows: Tensor, positions: Tensor) -> None:
        """Copy ``queries [T, q_heads, head_dim]`` at logical ``positions [T]`` into
        ``rows [T]`` (device tensors; a row may be the padding or scratch row)."""
        rows = rows.to(self.device, torch.int64)
        positions = positions.to(self.device, torch.int64)
        cells = torch.remainder(positions, self.window)
        self.queries[layer].index_put_((rows, cells), queries.to(self.shape.dtype))
        if layer == 0:
            self.positions.index_put_((rows, cells), positions)

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
        are ``next_positions [R]`` (device tensors; no host read)."""
        rows = rows.to(self.device, torch.int64)
        positions = self.positions.index_select(0, rows)
        next_positions = next_positions.to(self.device, torch.int64).unsqueeze(1)
        valid = (positions >= 0) & (positions < next_positions)
        valid &= positions >= next_positions - self.window

        def queries_of_layer(layer: int) -> Tensor:
            return self.queries[layer].index_select(0, rows)

        return QueryWindow(
            num_layers=self.shape.num_layers,
            queries_of_layer=queries_of_layer,
            positions=positions,
            valid=valid,
        )
