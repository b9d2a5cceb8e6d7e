"""The scorer contract: ``score(view) -> float32[num_tokens]``, higher = keep.

A scorer only scores. Protection of sinks, protected prefix, shared prefix and the
recent window, the budget and the top-k all live in ``sglang_evict.passes.selection``.

Why one keep-set per request, not per head: SGLang stores every layer and head of a
token in one slot index (``req_to_token`` maps a token to one slot of every layer's
buffer), so a slot can only be freed when every head of every layer lets the token
go. Per-head scores are therefore combined into one score per token:

    per_head  [layers, heads, tokens]
      -> normalise each (layer, head) row over tokens   (head_normalization)
      -> reduce over layers and heads                   (head_reduction)
      -> [tokens]

``zscore`` normalisation puts heads with very different score scales (a sink-heavy
head next to a diffuse one) on one footing before they vote; ``none`` keeps raw
scores (needed when scores are meant to add up across passes, e.g. cumulative
attention). ``mean`` keeps tokens most heads like; ``max`` keeps a token if any head
needs it (fewer quality losses on specialised heads, less eviction headroom).

Determinism: every reduction here runs in float32 in a fixed order on the view's
device, so identical inputs give identical scores; selection breaks ties by index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from sglang_evict_kernels.normalize import (
    REDUCTIONS,
    ZSCORE_EPS,
    check_per_head,
    zscore_reduce_reference,
    zscore_reduce_triton,
)

HEAD_NORMALIZATIONS = ("zscore", "none")
HEAD_REDUCTIONS = REDUCTIONS


@dataclass(frozen=True)
class KVView:
    """What a scorer may read about one request's cache.

    Tokens are listed in logical order (ascending ``positions``); the mechanism that
    builds the view maps results back to physical slots.

    Attributes:
        keys: ``[layers, tokens, kv_heads, head_dim]`` cached keys, after RoPE (as the
            KV pool stores them); any float dtype.
        positions: int64 ``[tokens]``, each token's logical (RoPE) position.
        current_position: logical position of the next token to be generated.
        values: ``[layers, tokens, kv_heads, head_dim]``, for scorers that use values.
        queries: ``[layers, window, q_heads, head_dim]`` recently captured queries (after
            RoPE), oldest first; ``q_heads`` is a multiple of ``kv_heads`` (GQA).
        query_positions: int64 ``[window]``, logical positions of those queries.
        accumulated_scores: float32 ``[tokens]`` scores carried over from earlier passes
            for cumulative scorers (H2O-style); owned by the mechanism.
    """

    keys: Tensor
    positions: Tensor
    current_position: int
    values: Tensor | None = None
    queries: Tensor | None = None
    query_positions: Tensor | None = None
    accumulated_scores: Tensor | None = None

    def __post_init__(self) -> None:
        if self.keys.dim() != 4:
            raise ValueError(
                f"keys must be [layers, tokens, kv_heads, head_dim], got shape "
                f"{tuple(self.keys.shape)}"
            )
        num_layers, num_tokens, num_kv_heads, head_dim = self.keys.shape
        if self.positions.shape != (num_tokens,):
            raise ValueError(f"positions must be [{num_tokens}], got {tuple(self.positions.shape)}")
        if self.values is not None and self.values.shape[:3] != self.keys.shape[:3]:
            raise ValueError(
                f"values shape {tuple(self.values.shape)} does not match keys "
                f"{tuple(self.keys.shape)} in [layers, tokens, kv_heads]"
            )
        if self.queries is not None:
            q = self.queries
            if q.dim() != 4 or q.shape[0] != num_layers or q.shape[3] != head_dim:
                raise ValueError(
                    f"queries must be [{num_layers}, window, q_heads, {head_dim}], got "
                    f"{tuple(q.shape)}"
                )
            if q.shape[2] % num_kv_heads != 0:
                raise ValueError(
                    f"q_heads={q.shape[2]} is not a multiple of kv_heads={num_kv_heads}"
                )
            if self.query_positions is None or self.query_positions.shape != (q.shape[1],):
                raise ValueError("query_positions must be given as [window] with queries")
        if self.accumulated_scores is not None and self.accumulated_scores.shape != (num_tokens,):
            raise ValueError(
                f"accumulated_scores must be [{num_tokens}], got "
                f"{tuple(self.accumulated_scores.shape)}"
            )

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[1]


@dataclass(frozen=True)
class QueryWindow:
    """The captured queries of every request of a batched pass (``sglang_evict.
    query_capture``): ``W`` cells per request, in ring order (not time order).

    Attributes:
        num_layers: layers of the model.
        queries_of_layer: ``layer -> [R, W, q_heads, head_dim]`` queries (after RoPE).
        positions: int64 ``[R, W]``, the logical position of each cell's query.
        valid: bool ``[R, W]``: the cell holds one of the request's last ``W`` queries
            (its own: a row's earlier request's and empty cells are False).
    """

    num_layers: int
    queries_of_layer: Callable[[int], Tensor]
    positions: Tensor
    valid: Tensor

    def request_queries(self, r: int) -> tuple[Tensor, Tensor]:
        """``(queries [layers, n, q_heads, head_dim], positions [n])`` of request ``r``,
        oldest first: the per-request ``KVView`` form. Reads ``valid`` on the host (a
        synchronisation): only for scorers without a batched form."""
        cells = torch.nonzero(self.valid[r], as_tuple=True)[0]
        cells = cells[torch.argsort(self.positions[r, cells])]
        queries = torch.stack(
            [self.queries_of_layer(layer)[r, cells] for layer in range(self.num_layers)]
        )
        return queries, self.positions[r, cells]

    def select_rows(self, index: Tensor) -> QueryWindow:
        """The requests ``index`` (int64 ``[R']`` on the device) only, in that order."""
        of_layer = self.queries_of_layer
        return QueryWindow(
            num_layers=self.num_layers,
            queries_of_layer=lambda layer: of_layer(layer).index_select(0, index),
            positions=self.positions.index_select(0, index),
            valid=self.valid.index_select(0, index),
        )


@dataclass(frozen=True)
class BatchKVView:
    """What a scorer may read about the due requests of one batched pass, all at once.

    Requests are padded to the longest: request ``r``'s tokens are columns
    ``[0, lengths[r])`` of row ``r``, in its row order (``positions`` gives each token's
    logical position; after a ``hole_fill`` pass row order is not logical order).
    Padding columns read slot 0 (SGLang's padding slot); whatever they score must not
    change the real tokens' scores. Everything is on the pool's device and nothing here
    may be read back on the host (the pass never synchronises); ``lengths`` and
    ``current_positions_host`` are the host's own copies.

    Attributes:
        k_buffers: the pool's per-layer key buffers ``[slots, kv_heads, head_dim]``.
        slots: int64 ``[R, N]``, the slot of each token.
        positions: int64 ``[R, N]``, each token's logical (RoPE) position.
        valid: bool ``[R, N]``, ``column < lengths[r]``.
        current_positions: int64 ``[R]``, each request's next position.
        lengths, current_positions_host: the same as host ints.
        gather_keys: ``slots [T] -> float [layers, T, kv_heads, head_dim]`` (one
            request's keys, for scorers scored one request at a time).
        gather_layer_keys: ``(layer, slots [T]) -> float [T, kv_heads, head_dim]``, one
            layer's keys: the batched forms read the pass's keys through it, a layer
            at a time, so their temporary memory is one layer's keys of the pass.
        use_pool_kernels: score with a pool-reading kernel where the scorer has one.
        queries: the requests' captured queries (``window``, ``rkv``); None: this
            manager has no query ring.
        accumulated_scores: float32 ``[R, N]`` scores carried over from earlier passes
            (``Scorer.carries_scores``; entries appended since: 0), or None.
    """

    k_buffers: list[Tensor]
    slots: Tensor
    positions: Tensor
    valid: Tensor
    current_positions: Tensor
    lengths: tuple[int, ...]
    current_positions_host: tuple[int, ...]
    gather_keys: Callable[[Tensor], Tensor]
    gather_layer_keys: Callable[[int, Tensor], Tensor]
    use_pool_kernels: bool = False
    queries: QueryWindow | None = None
    accumulated_scores: Tensor | None = None

    def layer_keys(self, layer: int) -> Tensor:
        """float ``[R, N, kv_heads, head_dim]``: one layer's keys of every entry
        (padding entries read slot 0)."""
        keys = self.gather_layer_keys(layer, self.slots.reshape(-1))
        return keys.float().view(*self.slots.shape, *keys.shape[1:])

    def select_rows(self, rows: Sequence[int], index: Tensor) -> BatchKVView:
        """The requests ``rows`` only, in that order (``index``: the same as int64 on the
        device): every per-request field is subset, the pool's fields are shared."""

        def pick(tensor: Tensor | None) -> Tensor | None:
            return None if tensor is None else tensor.index_select(0, index)

        return dataclasses.replace(
            self,
            slots=self.slots.index_select(0, index),
            positions=self.positions.index_select(0, index),
            valid=self.valid.index_select(0, index),
            current_positions=self.current_positions.index_select(0, index),
            lengths=tuple(self.lengths[r] for r in rows),
            current_positions_host=tuple(self.current_positions_host[r] for r in rows),
            queries=None if self.queries is None else self.queries.select_rows(index),
            accumulated_scores=pick(self.accumulated_scores),
        )


def aggregate_segments(
    per_head: Tensor, valid: Tensor, normalization: str, reduction: str, *, fused: bool = False
) -> Tensor:
    """``aggregate_head_scores`` for a padded batch: ``[layers, heads, R, N]`` ->
    float32 ``[R, N]``, each (layer, head) z-normalised per request over that request's
    own tokens (``valid``); padding neither counts nor matters. The z-score form is
    ``sglang_evict_kernels.normalize``'s: its torch reference, or with ``fused`` (where
    the pass runs pool kernels) its two Triton launches."""
    if normalization == "zscore":
        aggregate = zscore_reduce_triton if fused else zscore_reduce_reference
        return aggregate(per_head, valid, reduction, ZSCORE_EPS)
    if normalization != "none":
        raise ValueError(
            f"unknown head_normalization {normalization!r}; known: {HEAD_NORMALIZATIONS}"
        )
    check_per_head(per_head, valid, reduction)
    flat = per_head.to(torch.float32).reshape(-1, *valid.shape)
    return flat.mean(dim=0) if reduction == "mean" else flat.max(dim=0).values


def aggregate_head_scores(per_head: Tensor, normalization: str, reduction: str) -> Tensor:
    """Combine ``[layers, heads, tokens]`` scores into one float32 ``[tokens]`` score."""
    if per_head.dim() != 3:
        raise ValueError(f"per-head scores must be [layers, heads, tokens], got {per_head.shape}")
    scores = per_head.to(torch.float32)
    if normalization == "zscore":
        mean = scores.mean(dim=-1, keepdim=True)
        std = scores.std(dim=-1, keepdim=True, unbiased=False)
        scores = (scores - mean) / (std + ZSCORE_EPS)
    elif normalization != "none":
        raise ValueError(
            f"unknown head_normalization {normalization!r}; known: {HEAD_NORMALIZATIONS}"
        )
    flat = scores.reshape(-1, scores.shape[-1])
    if reduction == "mean":
        return flat.mean(dim=0)
    if reduction == "max":
        return flat.max(dim=0).values
    raise ValueError(f"unknown head_reduction {reduction!r}; known: {HEAD_REDUCTIONS}")


@dataclass(frozen=True, kw_only=True)
class Scorer:
    """Base of every scorer: a frozen set of parameters and one ``score`` method.

    Subclasses set ``name`` (the registry key, what ``--kv-scorer`` takes), say whether
    they need captured queries, and implement ``head_scores`` (or ``score`` directly
    when the signal is per token, not per head).
    """

    name: ClassVar[str]
    needs_queries: ClassVar[bool] = False
    # Whether the batched form (``batch_scores``) reads device data only, never the
    # view's host tuples: such a pass can be captured once and replayed as a CUDA graph
    # (``sglang_evict.passes.graphs``). Scorers without a batched form are never safe.
    graph_safe: ClassVar[bool] = False
    head_normalization: str = "zscore"
    head_reduction: str = "mean"

    def __post_init__(self) -> None:
        if self.head_normalization not in HEAD_NORMALIZATIONS:
            raise ValueError(
                f"unknown head_normalization {self.head_normalization!r}; "
                f"known: {list(HEAD_NORMALIZATIONS)}"
            )
        if self.head_reduction not in HEAD_REDUCTIONS:
            raise ValueError(
                f"unknown head_reduction {self.head_reduction!r}; known: {list(HEAD_REDUCTIONS)}"
            )

    @property
    def carries_scores(self) -> bool:
        """Whether this scorer adds scores carried over from earlier passes
        (``accumulated_scores``): the mechanism then keeps each survivor's score."""
        return False

    def head_scores(self, view: KVView) -> Tensor:
        """``[layers, heads, tokens]`` scores, higher = keep."""
        raise NotImplementedError

    def pool_head_scores(
        self,
        k_buffers: list[Tensor],
        slots: Tensor,
        current_position: int,
        *,
        check_slots: bool = True,
    ) -> Tensor | None:
        """``head_scores`` computed by a kernel straight from the KV pool (per-layer
        ``[slots, kv_heads, head_dim]`` buffers, ``slots`` in the view's token order),
        without gathering keys; None when this scorer has no such kernel.
        ``check_slots=False``: skip the kernel's slot range check, which reads device
        data (slots the batched pass made on the device)."""
        return None

    def batch_head_scores(self, view: BatchKVView) -> Tensor | None:
        """``[layers, heads, R, N]`` scores of every request of a batched pass at once,
        or None when this scorer has no batched form: the mechanism then scores each
        request's ``KVView`` in turn (same scores, one request at a time)."""
        return None

    def batch_scores(self, view: BatchKVView) -> Tensor | None:
        """float32 ``[R, N]`` of a batched pass (higher = keep), or None (see
        ``batch_head_scores``). Scorers whose signal is per token override this."""
        per_head = self.batch_head_scores(view)
        if per_head is None:
            return None
        return aggregate_segments(
            per_head,
            view.valid,
            self.head_normalization,
            self.head_reduction,
            fused=view.use_pool_kernels,
        )

    def aggregate(self, per_head: Tensor) -> Tensor:
        """Per-head scores -> per-token scores, with this scorer's settings."""
        return aggregate_head_scores(per_head, self.head_normalization, self.head_reduction)

    def score(self, view: KVView) -> Tensor:
        """float32 ``[tokens]``, higher = keep."""
        if self.needs_queries and view.queries is None:
            raise ValueError(
                f"scorer {self.name!r} needs captured queries, but the view has none; enable "
                f"query capture or choose a score-free scorer (knorm, streaming, triattention)"
            )
        return self.aggregate(self.head_scores(view))


def expand_kv_heads(keys_layer: Tensor, num_q_heads: int) -> Tensor:
    """``[tokens, kv_heads, D]`` -> ``[tokens, q_heads, D]`` by GQA group (no copy of data
    beyond the expand view)."""
    num_tokens, num_kv_heads, head_dim = keys_layer.shape
    group = num_q_heads // num_kv_heads
    return (
        keys_layer.unsqueeze(2)
        .expand(num_tokens, num_kv_heads, group, head_dim)
        .reshape(num_tokens, num_q_heads, head_dim)
    )
