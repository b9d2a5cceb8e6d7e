"""Batched passes replayed as CUDA graphs: one graph per pass shape, captured once.

A pass's device work (gather, score, select, plan, the in-process moves and the row,
position and offset writes) is a few hundred tensor operations; dispatched one by one
it costs the host milliseconds, and SGLang's scheduler waits for that between two
decode steps. A static-shape pass (``sglang_evict.passes.batch.shapes``) reads its
varying inputs from two device buffers only (the packed host ints and the claimed
staging pages), so it can be captured once per ``PassKey`` and replayed:

    host, per pass                                 device
    fill the key's pinned buffer (numpy: no op)
    one copy pinned -> static packed ints     ->   (staging pages: one more copy)
    replay                                    ->   the whole pass
    clone the released pages and the copies   ->   (the next replay overwrites them)
    hand the released pages to the allocator

The first pass of a key runs eagerly on the key's static buffers (it compiles Triton
kernels and grows cached index vectors outside a capture), then the key is captured;
every later pass of that key is replayed. Keys past ``max_graphs``, and passes that
cannot be captured (mixed scorers, a scorer that reads the host, the sidecar's passes,
tensor parallelism), run eagerly and are counted as misses
(``sglang_evict:pass_graph_misses_total``). All graphs share one memory pool; the
bytes it took are logged at each capture and exposed (``graph_pool_bytes``).

The pool has a limit (``pool_limit_bytes``, ``--kv-pass-graph-pool-mib``), which the
server takes out of SGLang's KV pool before the KV pool is allocated
(``sglang_evict.srt.graph_pool``): the graphs never grow into memory SGLang gave the KV
cache or its own decode graphs. A new shape is captured only while the pool plus the
largest growth one capture has caused so far fits the limit (so the pool passes it by
at most the first capture's growth, when that alone exceeds it); past it, the shape's
passes run eagerly, counted as misses, and a warning names the flag once.

Off CUDA (tests and the op-count bench on CPU) the same mechanism runs with the capture
emulated: "capturing" keeps the body and "replaying" runs it on the key's static
buffers, so everything but the CUDA graph itself (static buffers, keys, the clones,
the misses, the pool limit) is exercised and counted without a GPU. The emulated pool
grows by the bytes of every tensor the key's first pass allocated (``AllocationTally``):
the most a capture could take, since a real capture's pool reuses what its freed
intermediates held.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sglang_evict.passes.batch.inputs import COLUMNS
from sglang_evict.passes.batch.shapes import PassShape

logger = logging.getLogger(__name__)

# Graphs one server keeps (each holds its intermediates in the shared pool): a server
# in steady state uses a handful of shapes (``shapes`` module docstring).
MAX_GRAPHS = 64

Body = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class PassKey:
    """What a captured pass is specialised to: its shape, scorer, strategy and the
    scoring path (pool kernels or torch forms, captured queries)."""

    shape: PassShape
    scorer: str
    strategy: str
    use_pool_kernels: bool
    with_queries: bool


@dataclass
class _Captured:
    pinned: Tensor  # int64, the packed host ints (pinned host memory)
    packed: Tensor  # int64 on the device: what the graph reads
    claimed: Tensor  # int64 on the device: staging pages (length staging_total)
    copied: torch.cuda.Event | None = None  # after the last pinned -> device copy
    graph: torch.cuda.CUDAGraph | None = None
    outputs: tuple[Tensor, Tensor] | None = None
    body: Body | None = None  # off CUDA: the captured body, run on replay
    emulated_bytes: int = 0  # off CUDA: what the first pass allocated (the pool's growth)
    failed: bool = False  # the capture raised: passes of this key run eagerly


@dataclass
class PassGraphs:
    """The captured passes of one eviction manager (module docstring)."""

    device: torch.device
    max_graphs: int = MAX_GRAPHS
    entries: dict[PassKey, _Captured] = field(default_factory=dict)
    captures: int = 0
    replays: int = 0
    misses: int = 0
    pool_limit_bytes: int | None = None  # None: no limit (module docstring)
    graph_pool_bytes: int = 0
    largest_growth_bytes: int = 0  # the most one capture grew the pool
    _pool: object | None = None
    _limit_warned: bool = False

    def report(self) -> dict:
        limit = self.pool_limit_bytes
        return {
            "captured": len(self.entries),
            "replays": self.replays,
            "misses": self.misses,
            "graph_pool_mib": round(self.graph_pool_bytes / 2**20, 3),
            "graph_pool_limit_mib": None if limit is None else round(limit / 2**20, 3),
        }

    def will_capture(self, key: PassKey) -> bool:
        """Whether a pass of ``key`` run now is its first (eager, then captured)."""
        return key not in self.entries and self._room_for_a_capture()

    def _room_for_a_capture(self) -> bool:
        if len(self.entries) >= self.max_graphs:
            return False
        limit = self.pool_limit_bytes
        return limit is None or self.graph_pool_bytes + self.largest_growth_bytes <= limit

    def miss(self) -> None:
        """Count a pass that ran eagerly although graphs are on."""
        self.misses += 1

    def run(
        self, key: PassKey, packed_host: np.ndarray, claimed: Tensor | None, body: Body
    ) -> tuple[Tensor, Tensor]:
        """``body(packed, claimed)``'s ``(released pages, copies per request)``, replayed
        when ``key`` was captured; the first pass of a key runs eagerly and captures it.
        The returned tensors are the caller's (clones of the graph's outputs)."""
        entry = self.entries.get(key)
        if entry is None:
            if not self._room_for_a_capture():
                self.misses += 1
                self._warn_full(key)
                return body(*self._eager_inputs(key, packed_host, claimed))
            entry = self._new_entry(key)
            self._fill(entry, packed_host, claimed)
            if self.on_cuda:
                outputs = body(entry.packed, entry.claimed)
            else:
                with AllocationTally() as tally:
                    outputs = body(entry.packed, entry.claimed)
                entry.emulated_bytes = tally.bytes
            # The pass above has run and must commit: a capture that fails leaves this
            # key eager (and counted), never the pass undone.
            try:
                self._capture(key, entry, body)
            except Exception as error:
                entry.failed = True
                logger.error(
                    "sglang-evict: a pass of %d request(s), width %d could not be captured "
                    "as a CUDA graph (%s: %s); passes of this shape run eagerly, counted in "
                    "sglang_evict:pass_graph_misses_total",
                    key.shape.requests,
                    key.shape.width,
                    type(error).__name__,
                    error,
                )
            self.entries[key] = entry
            return outputs
        if entry.failed:
            self.misses += 1
            return body(*self._eager_inputs(key, packed_host, claimed))
        self._fill(entry, packed_host, claimed)
        if entry.graph is not None:
            entry.graph.replay()
        else:  # emulated off CUDA (module docstring)
            entry.outputs = entry.body(entry.packed, entry.claimed)
        self.replays += 1
        released, copies = entry.outputs
        return released.clone(), copies.clone()

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _eager_inputs(self, key, packed_host, claimed) -> tuple[Tensor, Tensor]:
        packed = torch.from_numpy(packed_host)
        if self.on_cuda:
            packed = packed.pin_memory().to(self.device, non_blocking=True)
        padded = torch.zeros(key.shape.staging_total, dtype=torch.int64, device=self.device)
        if claimed is not None:
            padded[: claimed.numel()].copy_(claimed)
        return packed, padded

    def _new_entry(self, key: PassKey) -> _Captured:
        width = len(COLUMNS) * key.shape.requests
        pinned = torch.zeros(width, dtype=torch.int64)
        return _Captured(
            pinned=pinned.pin_memory() if self.on_cuda else pinned,
            packed=torch.zeros(width, dtype=torch.int64, device=self.device),
            claimed=torch.zeros(key.shape.staging_total, dtype=torch.int64, device=self.device),
        )

    def _fill(self, entry: _Captured, packed_host: np.ndarray, claimed: Tensor | None) -> None:
        if entry.copied is not None:
            entry.copied.synchronize()  # the last copy out of the pinned buffer is done
        entry.pinned.numpy()[:] = packed_host  # host memory: no tensor operation
        entry.packed.copy_(entry.pinned, non_blocking=True)
        if self.on_cuda:
            if entry.copied is None:
                entry.copied = torch.cuda.Event()
            entry.copied.record()
        if claimed is not None and claimed.numel():
            entry.claimed[: claimed.numel()].copy_(claimed)

    def _warn_full(self, key: PassKey) -> None:
        if self._limit_warned:
            return
        self._limit_warned = True
        if len(self.entries) >= self.max_graphs:
            why = f"{self.max_graphs} pass shapes are captured, the most a server keeps"
        else:
            why = (
                f"their memory pool holds {self.graph_pool_bytes / 2**20:.1f} MiB of its "
                f"{self.pool_limit_bytes / 2**20:.1f} MiB and a capture has taken up to "
                f"{self.largest_growth_bytes / 2**20:.1f} MiB; raise --kv-pass-graph-pool-mib "
                f"to capture more"
            )
        logger.warning(
            "sglang-evict: passes of %d request(s), width %d and other new shapes run "
            "eagerly from now on (counted in sglang_evict:pass_graph_misses_total): %s",
            key.shape.requests,
            key.shape.width,
            why,
        )

    def _grew(self, growth_bytes: int) -> None:
        self.graph_pool_bytes += growth_bytes
        self.largest_growth_bytes = max(self.largest_growth_bytes, growth_bytes)

    def _capture(self, key: PassKey, entry: _Captured, body: Body) -> None:
        self.captures += 1
        if not self.on_cuda:
            entry.body = body
            self._grew(entry.emulated_bytes)
            return
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        before = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: SGLang's other threads may allocate while this one captures.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            entry.outputs = body(entry.packed, entry.claimed)
        entry.graph = graph
        self._grew(max(0, torch.cuda.memory_reserved(self.device) - before))
        logger.info(
            "sglang-evict: pass captured as a CUDA graph (%d requests, width %d, scorer %s, "
            "%s); %d graph(s), their memory pool %.1f MiB",
            key.shape.requests,
            key.shape.width,
            key.scorer,
            key.strategy,
            len(self.entries) + 1,
            self.graph_pool_bytes / 2**20,
        )


class AllocationTally(TorchDispatchMode):
    """The bytes of every storage the operations run under it create (views and
    in-place writes create none): off CUDA, what a capture of those operations could
    take from a graph pool at most."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        known = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in known:  # a new storage, not a view or an in-place write
                known.add(ptr)
                self.bytes += storage.nbytes()
        return out


def _tensors(tree) -> list[Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, Tensor)]
