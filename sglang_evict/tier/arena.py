"""The tier's storage: a fixed arena of group slots per layer, and which request owns
which slot. Stateful (the mechanism's); the host keeps the free list and the owners,
the device holds the packed bytes.

One arena serves every request of a server. It is sized once, as a share of the KV
memory (``arena_groups_for_share``: the KV pool shrinks by it, so the tier's bytes are
memory the server owns and counts), and never grows::

    slot        0 .. num_groups - 1: a group of G tokens of one request, every layer
    trash       num_groups: where a pass writes the groups it gives up at once (their
                target is chosen on the device; nothing reads the trash slot)
    owner       slot -> request id (host); a request's slots in the order it got them
    free        the slots no request owns (host, a stack)
    score       float32 [num_groups + 1] on the device: each held group's score (the
                highest of its tokens' scores when it entered), what a full tier compares
    positions   int32 [num_groups + 1, G] on the device: the logical position of each
                of a held group's tokens (-1: none), in position order; what the
                invariants and the kept-set trace read (``SGLANG_EVICT_LOG_KEPT``)
    row tables  (``enable_rows``, SGLang's engine) int32 [request rows, max groups] and
                [request rows] on the device: each request-pool row's slots and their
                count, what the decode step's attention reads by ``req_pool_indices``
                (static shapes: no host read, CUDA-graph safe); written when a request's
                slots change (``take``, ``release``), outside any forward

Invariants (``check``, tested after every operation): every slot is either free or
owned by exactly one request; no request owns more than its bound; the trash slot is
never free nor owned; a bound row's table holds exactly its request's slots, and a row
no request is bound to holds none.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sglang_evict_kernels.tier_format import TierFormat, TierStore


def group_bytes(fmt: TierFormat, num_layers: int, kv_heads: int, full_dtype: torch.dtype) -> int:
    """Bytes one group slot holds across every layer (the stores' tensors, exactly)."""
    return sum(
        TierStore.empty(
            fmt, 1, kv_heads, full_dtype, device="meta", outliers=fmt.outliers_for_layer(layer)
        ).nbytes()
        for layer in range(num_layers)
    )


def slot_overhead_bytes(fmt: TierFormat) -> int:
    """Bytes a group slot holds beside its stores: its score (float32) and its tokens'
    positions (int32 each)."""
    return 4 + 4 * fmt.group_tokens


def arena_groups_for_share(
    *,
    share: float,
    kv_pool_bytes: int,
    fmt: TierFormat,
    num_layers: int,
    kv_heads: int,
    full_dtype: torch.dtype,
) -> int:
    """Group slots that ``share`` of ``kv_pool_bytes`` holds (the trash slot and each
    slot's score and positions included in the bytes)."""
    if not 0.0 < share < 1.0:
        raise ValueError(
            f"--kv-tier-pool-share {share}: the share of the KV memory the tier takes, in (0, 1)"
        )
    per_group = group_bytes(fmt, num_layers, kv_heads, full_dtype) + slot_overhead_bytes(fmt)
    return max(0, math.floor(share * kv_pool_bytes / per_group) - 1)


def _check_stores(stores: list[TierStore], expected: list[TierStore]) -> None:
    if len(stores) != len(expected):
        raise ValueError(f"the tier arena needs {len(expected)} layers' stores, got {len(stores)}")
    for layer, (got, want) in enumerate(zip(stores, expected, strict=True)):
        for name, tensor in want.tensors().items():
            have = got.tensors()[name]
            if have.shape != tensor.shape or have.dtype != tensor.dtype:
                raise ValueError(
                    f"tier arena layer {layer} {name}: {tuple(have.shape)} {have.dtype}, "
                    f"the format needs {tuple(tensor.shape)} {tensor.dtype}"
                )


class TierArena:
    """``num_groups`` group slots (plus the trash slot) of every layer."""

    def __init__(
        self,
        fmt: TierFormat,
        *,
        num_groups: int,
        num_layers: int,
        kv_heads: int,
        full_dtype: torch.dtype,
        device: str | torch.device = "cpu",
        stores: list[TierStore] | None = None,
    ) -> None:
        """``stores``: the layers' stores already allocated (memory a compactor sidecar
        maps: ``compactor_service.shared_arena``), checked against the format and sizes;
        otherwise allocated here."""
        if num_groups < 1:
            raise ValueError(
                f"the tier's arena holds {num_groups} groups: raise --kv-tier-pool-share "
                f"or the KV memory, or run without --kv-tier-bits"
            )
        self.fmt = fmt
        self.num_groups = num_groups
        self.trash = num_groups
        self.device = torch.device(device)
        expected = [
            TierStore.empty(
                fmt,
                num_groups + 1,
                kv_heads,
                full_dtype,
                device=self.device if stores is None else "meta",
                outliers=fmt.outliers_for_layer(layer),
            )
            for layer in range(num_layers)
        ]
        if stores is not None:
            _check_stores(stores, expected)
        self.stores = expected if stores is None else list(stores)
        self.scores = torch.zeros(num_groups + 1, dtype=torch.float32, device=self.device)
        self.positions = torch.full(
            (num_groups + 1, fmt.group_tokens), -1, dtype=torch.int32, device=self.device
        )
        self._free = list(range(num_groups - 1, -1, -1))  # pop() hands out slot 0 first
        self.owned: dict[str, list[int]] = {}
        self.row_table: Tensor | None = None
        self.row_counts: Tensor | None = None
        self.row_of: dict[str, int] = {}

    def enable_rows(self, num_rows: int, max_groups: int) -> None:
        """Keep the row tables (module docstring) for ``num_rows`` request-pool rows of
        at most ``max_groups`` groups each."""
        self.row_table = torch.full(
            (num_rows, max(max_groups, 1)), self.trash, dtype=torch.int32, device=self.device
        )
        self.row_counts = torch.zeros(num_rows, dtype=torch.int32, device=self.device)

    # --- host bookkeeping ------------------------------------------------------------

    @property
    def free_groups(self) -> int:
        return len(self._free)

    def groups_of(self, rid: str) -> list[int]:
        return self.owned.get(rid, [])

    def tokens_of(self, rid: str) -> int:
        return len(self.owned.get(rid, ())) * self.fmt.group_tokens

    def peek(self, count: int, after: int = 0) -> list[int]:
        """The ``count`` slots ``take`` would hand out after the next ``after``, in its
        order (O(count): a pass reads only what it takes)."""
        end = len(self._free) - after
        return self._free[max(end - count, 0) : end][::-1]

    def take(self, rid: str, count: int, row: int | None = None) -> list[int]:
        """Up to ``count`` free slots for ``rid`` (fewer when the arena runs short);
        ``row``: its request-pool row, whose table then lists its slots."""
        if row is not None and self.row_table is not None:
            self.row_of[rid] = row
        count = min(count, len(self._free))
        if count <= 0:
            return []
        got = [self._free.pop() for _ in range(count)]
        self.owned.setdefault(rid, []).extend(got)
        self._publish(rid)
        return got

    def take_claimed(self, claims: list[tuple[str, int | None, list[int], int, list[int]]]) -> None:
        """A sidecar demotion's commit (``tier.demotion``): ``claims`` holds, request
        after request, ``(rid, row, claimed, used, released)``, where ``claimed`` are
        the next free slots in ``peek`` order; each request keeps the first ``used`` of
        them and gives up ``released`` (old slots its swaps replace); the claimed slots
        it did not use go back to the free list."""
        expected = [slot for _, _, claimed, _, _ in claims for slot in claimed]
        if self.peek(len(expected)) != expected:
            raise AssertionError("a demotion's claimed tier slots are no longer the next free")
        del self._free[len(self._free) - len(expected) :]
        for rid, row, claimed, used, released in claims:
            if row is not None and self.row_table is not None:
                self.row_of[rid] = row
            gone = set(released)
            if not gone <= set(self.owned.get(rid, ())):
                raise AssertionError(f"request {rid} gives up tier slots it does not own")
            kept = [slot for slot in self.owned.get(rid, []) if slot not in gone]
            self.owned[rid] = kept + claimed[:used]
            self._free.extend(reversed(claimed[used:]))
            self._free.extend(released)
            if not self.owned[rid]:
                del self.owned[rid]
            self._publish(rid)

    def release(self, rid: str) -> int:
        """Give back every slot ``rid`` owns (finish, abort, retraction); the count."""
        slots = self.owned.pop(rid, [])
        self._free.extend(reversed(slots))
        row = self.row_of.pop(rid, None)
        if row is not None:
            self.row_counts[row] = 0
        return len(slots)

    def _publish(self, rid: str) -> None:
        row = self.row_of.get(rid)
        if row is None:
            return
        slots = self.owned.get(rid, [])
        width = self.row_table.shape[1]
        if len(slots) > width:
            raise AssertionError(f"request {rid} holds {len(slots)} tier groups, its row {width}")
        self.row_table[row, : len(slots)] = torch.tensor(slots, dtype=torch.int32).to(
            self.device, non_blocking=True
        )
        self.row_counts[row] = len(slots)

    def nbytes(self) -> int:
        """Bytes the arena's tensors hold on the device (every layer, trash included)."""
        extra = self.scores.numel() * 4 + self.positions.numel() * 4
        return sum(store.nbytes() for store in self.stores) + extra

    def positions_of(self, rid: str) -> list[list[int]]:
        """The positions of each group ``rid`` holds, in the order it got them (reads
        the device: tests and the kept-set trace only)."""
        slots = self.owned.get(rid, [])
        if not slots:
            return []
        index = torch.tensor(slots, dtype=torch.int64, device=self.device)
        return self.positions.index_select(0, index).cpu().tolist()

    def table(self, rids: list[str], device=None) -> tuple[Tensor, Tensor]:
        """``(group_table [B, max groups] int32, num_groups [B] int32)`` of ``rids`` for
        the tier's attention (padding: the trash slot, never read)."""
        lists = [self.owned.get(rid, []) for rid in rids]
        width = max((len(s) for s in lists), default=0)
        table = torch.full((len(rids), max(width, 1)), self.trash, dtype=torch.int32)
        for i, slots in enumerate(lists):
            if slots:
                table[i, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
        counts = torch.tensor([len(s) for s in lists], dtype=torch.int32)
        device = self.device if device is None else device
        return table.to(device), counts.to(device)

    def check(self, max_groups_per_request: int | None = None) -> None:
        """Raise ``AssertionError`` if the module docstring's invariants break."""
        seen: dict[int, str] = {}
        for rid, slots in self.owned.items():
            if max_groups_per_request is not None and len(slots) > max_groups_per_request:
                raise AssertionError(
                    f"request {rid} holds {len(slots)} tier groups, above its bound "
                    f"{max_groups_per_request}"
                )
            for slot in slots:
                if slot in seen:
                    raise AssertionError(f"tier slot {slot} owned by {seen[slot]} and {rid}")
                if not 0 <= slot < self.num_groups:
                    raise AssertionError(f"request {rid} owns slot {slot} outside the arena")
                seen[slot] = rid
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a tier slot is free twice")
        if free & set(seen):
            raise AssertionError(f"tier slots {sorted(free & set(seen))[:8]} are free and owned")
        if len(free) + len(seen) != self.num_groups:
            raise AssertionError(
                f"{self.num_groups - len(free) - len(seen)} tier slots are neither free nor owned"
            )
        if self.row_counts is not None:
            self._check_rows()

    def _check_rows(self) -> None:
        counts = self.row_counts.cpu().tolist()
        bound = {row: rid for rid, row in self.row_of.items()}
        if len(bound) != len(self.row_of):
            raise AssertionError("two requests are bound to one request-pool row")
        for row, count in enumerate(counts):
            rid = bound.get(row)
            slots = self.owned.get(rid, []) if rid is not None else []
            if count != len(slots):
                raise AssertionError(
                    f"row {row} lists {count} tier groups, its request {rid} holds {len(slots)}"
                )
            if slots and sorted(self.row_table[row, :count].cpu().tolist()) != sorted(slots):
                raise AssertionError(f"row {row}'s tier table differs from {rid}'s slots")


def make_arena(
    fmt: TierFormat,
    *,
    num_groups: int,
    num_layers: int,
    kv_heads: int,
    full_dtype: torch.dtype,
    device: str | torch.device = "cpu",
    shared_dir: str | None = None,
):
    """``(TierArena, SharedArena or None)``: with ``shared_dir`` (the compactor
    sidecar's pool directory) the arena's stores live where the sidecar maps them
    (``compactor_service.shared_arena``): a file of that directory on CPU (removed at
    exit), one device allocation exported by CUDA IPC on a GPU; otherwise in this
    process's memory."""
    shared = None
    if shared_dir is not None and torch.device(device).type == "cuda":
        from compactor_service.shared_arena import export_cuda_arena

        shared = export_cuda_arena(
            fmt,
            num_groups=num_groups,
            num_layers=num_layers,
            kv_heads=kv_heads,
            full_dtype=full_dtype,
            device=device,
        )
    elif shared_dir is not None:
        import atexit

        from compactor_service.shared_arena import create_shared_arena

        shared = create_shared_arena(
            fmt,
            num_groups=num_groups,
            num_layers=num_layers,
            kv_heads=kv_heads,
            full_dtype=full_dtype,
            directory=shared_dir,
        )
        atexit.register(shared.close)
    arena = TierArena(
        fmt,
        num_groups=num_groups,
        num_layers=num_layers,
        kv_heads=kv_heads,
        full_dtype=full_dtype,
        device=device,
        stores=None if shared is None else shared.stores,
    )
    return arena, shared
