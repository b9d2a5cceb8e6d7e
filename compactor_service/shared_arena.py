"""The quantized tier's arena in memory two processes map, as the KV pool is.

The scheduler owns the arena (``sglang_evict.tier.arena.TierArena``: group slots of
every layer, each a ``TierStore``); a compactor that demotes for it writes the groups.
A CPU arena lives in one file of the compactor's pool directory beside the pool's file
(mode 0600, named ``sglang-evict-tier-<pid>-<hex>``): every layer's store tensors in
``TierStore.tensors()`` order, each at a 64-byte aligned offset that the layout's
format and sizes alone determine, so the layout on the wire carries the format and the
file's path, never an offset a client chose::

    file layout    [ layer 0: k_codes | k_scale | ... | out_v ][ layer 1: ... ] ...
    slots          num_slots = arena groups + 1 (the trash slot, last)

Registration (``ArenaLayout.validate``, ``check_matches``) refuses a format the tier's
kernels do not run (bits, head dim, group, value group, outliers, scale dtype), an
arena whose layers, KV heads, head dim, KV dtype or device differ from its pool's, and
a file that is not an arena file of exactly the size the layout implies or that is the
pool's own file (an arena may never overlap the pool it demotes from). The compactor
opens the file under the checks of ``PoolDirectory`` and never maps it (``ArenaFile``).

Transport-free, like ``shared_pool``: the gRPC layer converts ``ArenaLayout`` to and
from its message.
"""

from __future__ import annotations

import dataclasses
import os
import re
import uuid
from dataclasses import dataclass

import torch
from torch import Tensor

from compactor_service.cuda_ipc import check_ipc_handle, open_storage
from compactor_service.limits import MAX_DEVICE_INDEX, MAX_LAYERS, clip
from compactor_service.runtime_dir import ensure_private_dir
from compactor_service.shared_pool import (
    DEVICE_CPU,
    DEVICE_CUDA,
    DTYPES,
    CudaIpcBuffer,
    GuardedMapping,
    PoolDeviceUnavailable,
    PoolDirectory,
    PoolLayout,
    PoolMappingError,
    _map_fd,
    slot_runs,
)
from sglang_evict_kernels.tier_format import TierFormat, TierStore

ARENA_FILE_PREFIX = "sglang-evict-tier-"
ARENA_FILE_NAME = re.compile(re.escape(ARENA_FILE_PREFIX) + r"[0-9]{1,10}-[0-9a-f]{12}")
TENSOR_ALIGN_BYTES = 64
SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
SCALE_DTYPE_NAMES = {dtype: name for name, dtype in SCALE_DTYPES.items()}
# Arena slots one registration may declare: far above any arena a KV memory holds (a
# slot is a group of at least 8 tokens of every layer), low enough that the layout's
# sizes cannot overflow.
MAX_ARENA_SLOTS = 1 << 32


class ArenaMappingError(PoolMappingError):
    """An arena layout cannot be registered: malformed, unsupported, or not its pool's."""


@dataclass(frozen=True)
class TensorSpec:
    """One store tensor of one layer inside the arena's file."""

    layer: int
    name: str  # a ``TierStore`` field
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset_bytes: int

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * self.dtype.itemsize


@dataclass(frozen=True)
class ArenaLayout:
    """What a compactor needs to write a scheduler's tier arena."""

    bits: int
    group_tokens: int
    value_group_channels: int
    outlier_tokens: int
    head_dim: int
    scale_dtype: str
    full_dtype: str  # the KV pool's dtype: the outlier tokens' precision
    num_layers: int
    num_slots: int  # arena groups + the trash slot
    num_kv_heads: int
    device: str
    device_index: int = 0
    shm_path: str = ""  # CPU: the arena's file
    cuda: CudaIpcBuffer | None = None  # CUDA: the arena's one allocation, exported

    def format(self) -> TierFormat:
        """The tier format, or ``ArenaMappingError`` naming what its kernels refuse."""
        if self.scale_dtype not in SCALE_DTYPES:
            raise ArenaMappingError(
                f"arena.scale_dtype: unknown dtype {clip(self.scale_dtype)}; known: "
                f"{sorted(SCALE_DTYPES)}"
            )
        try:
            return TierFormat(
                bits=self.bits,
                group_tokens=self.group_tokens,
                value_group_channels=self.value_group_channels,
                outlier_tokens=self.outlier_tokens,
                head_dim=self.head_dim,
                scale_dtype=SCALE_DTYPES[self.scale_dtype],
            )
        except ValueError as error:
            raise ArenaMappingError(f"arena: {error}") from None

    def tensor_specs(self) -> list[TensorSpec]:
        """Every store tensor of every layer at its offset in the file (format first:
        call ``validate`` before trusting sizes)."""
        fmt = self.format()
        full = DTYPES[self.full_dtype]
        specs, offset = [], 0
        for layer in range(self.num_layers):
            meta = TierStore.empty(
                fmt,
                self.num_slots,
                self.num_kv_heads,
                full,
                device="meta",
                outliers=fmt.outliers_for_layer(layer),
            )
            for name, tensor in meta.tensors().items():
                spec = TensorSpec(layer, name, tuple(tensor.shape), tensor.dtype, offset)
                specs.append(spec)
                offset += -(-spec.nbytes // TENSOR_ALIGN_BYTES) * TENSOR_ALIGN_BYTES
        return specs

    @property
    def file_bytes(self) -> int:
        last = self.tensor_specs()[-1]
        return -(-(last.offset_bytes + last.nbytes) // TENSOR_ALIGN_BYTES) * TENSOR_ALIGN_BYTES

    def validate(self) -> None:
        """Raise ``ArenaMappingError`` unless the layout is self-consistent and its
        format one the tier's kernels run."""
        if self.full_dtype not in DTYPES:
            raise ArenaMappingError(
                f"arena.full_dtype: unknown dtype {clip(self.full_dtype)}; known: {sorted(DTYPES)}"
            )
        if self.device not in (DEVICE_CPU, DEVICE_CUDA):
            raise ArenaMappingError(f"arena.device: unknown device {clip(self.device)}")
        for name in ("num_layers", "num_slots", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ArenaMappingError(f"arena.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_slots < 2:
            raise ArenaMappingError(
                f"arena.num_slots {self.num_slots}: at least one group slot and the trash slot"
            )
        if self.num_layers > MAX_LAYERS:
            raise ArenaMappingError(f"arena.num_layers {self.num_layers} > {MAX_LAYERS}")
        if self.num_slots > MAX_ARENA_SLOTS:
            raise ArenaMappingError(f"arena.num_slots {self.num_slots} > {MAX_ARENA_SLOTS}")
        if not 0 <= self.device_index <= MAX_DEVICE_INDEX:
            raise ArenaMappingError(
                f"arena.device_index {self.device_index} is outside [0, {MAX_DEVICE_INDEX}]"
            )
        self.format()
        if self.device == DEVICE_CPU and (not self.shm_path or self.cuda is not None):
            raise ArenaMappingError(
                "arena.shm_path: a CPU arena names its file (and carries no CUDA export)"
            )
        if self.device == DEVICE_CUDA:
            if self.cuda is None or self.shm_path:
                raise ArenaMappingError(
                    "arena.cuda: a CUDA arena carries its IPC export (and names no file)"
                )
            check_ipc_handle("arena", self.cuda, self.file_bytes)

    def check_matches(self, pool: PoolLayout) -> None:
        """Refuse an arena that is not its pool's: another model's layers, heads, head
        dim, KV dtype or device."""
        pairs = (
            ("num_layers", self.num_layers, pool.num_layers),
            ("num_kv_heads", self.num_kv_heads, pool.num_kv_heads),
            ("head_dim", self.head_dim, pool.head_dim),
            ("full_dtype", self.full_dtype, pool.dtype),
            ("device", self.device, pool.device),
            ("device_index", self.device_index, pool.device_index),
        )
        for name, arena_value, pool_value in pairs:
            if arena_value != pool_value:
                shown = [v if isinstance(v, int) else clip(v) for v in (arena_value, pool_value)]
                raise ArenaMappingError(
                    f"arena.{name} is {shown[0]}, its pool's is {shown[1]}: an arena serves "
                    f"the pool it was sized from"
                )


def arena_layout_for(
    fmt: TierFormat,
    *,
    num_groups: int,
    num_layers: int,
    kv_heads: int,
    full_dtype: torch.dtype,
    device: str = DEVICE_CPU,
    shm_path: str = "",
) -> ArenaLayout:
    """The layout of an arena of ``num_groups`` groups (and the trash slot)."""
    return ArenaLayout(
        bits=fmt.bits,
        group_tokens=fmt.group_tokens,
        value_group_channels=fmt.value_group_channels,
        outlier_tokens=fmt.outlier_tokens,
        head_dim=fmt.head_dim,
        scale_dtype=SCALE_DTYPE_NAMES[fmt.scale_dtype],
        full_dtype={v: k for k, v in DTYPES.items()}[full_dtype],
        num_layers=num_layers,
        num_slots=num_groups + 1,
        num_kv_heads=kv_heads,
        device=device,
        shm_path=shm_path,
    )


@dataclass
class SharedArena:
    """The scheduler's side of a CPU shared arena: per-layer stores viewing one file.
    ``close`` removes the file (mappings stay valid until their tensors are dropped)."""

    path: str  # "" for a CUDA arena (no file)
    stores: list[TierStore]
    layout: ArenaLayout

    def close(self) -> None:
        if not self.path:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def stores_of(whole: Tensor, layout: ArenaLayout) -> list[TierStore]:
    """Per-layer ``TierStore`` views of an arena file mapped as ``uint8`` ``whole``."""
    by_layer: list[dict[str, Tensor]] = [{} for _ in range(layout.num_layers)]
    for spec in layout.tensor_specs():
        view = whole[spec.offset_bytes : spec.offset_bytes + spec.nbytes]
        by_layer[spec.layer][spec.name] = view.view(spec.dtype).view(spec.shape)
    return [TierStore(**tensors) for tensors in by_layer]


def create_shared_arena(
    fmt: TierFormat,
    *,
    num_groups: int,
    num_layers: int,
    kv_heads: int,
    full_dtype: torch.dtype,
    directory: str | os.PathLike,
    flag: str = "--kv-compactor-pool-dir",
) -> SharedArena:
    """Allocate a CPU arena of ``num_groups`` groups in a new file (mode 0600, zeroed)
    of the pool ``directory``."""
    directory = ensure_private_dir(directory, flag)
    path = str(directory / f"{ARENA_FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
    layout = arena_layout_for(
        fmt,
        num_groups=num_groups,
        num_layers=num_layers,
        kv_heads=kv_heads,
        full_dtype=full_dtype,
        shm_path=path,
    )
    layout.validate()
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, layout.file_bytes)
        stores = stores_of(_map_fd(fd, layout.file_bytes), layout)
    finally:
        os.close(fd)
    return SharedArena(path=path, stores=stores, layout=layout)


def open_arena_file(directory: PoolDirectory, layout: ArenaLayout) -> int:
    """A read-write descriptor of a CPU arena's file, under the pool directory's checks
    (``PoolFileRefused``, ``PoolFileMissing``, ``PoolMappingError`` for a wrong size)."""
    return directory.open_checked(
        layout.shm_path,
        "arena.shm_path",
        ARENA_FILE_NAME,
        f"a tier arena file ({ARENA_FILE_PREFIX}<pid>-<hex>)",
        layout.file_bytes,
    )


class ArenaFile:
    """A registered CPU arena as the compactor sees it: the file's descriptor, written
    through its guarded mapping once that is ready (``shared_pool.GuardedMapping``, for
    the reason ``shared_pool.PoolFile`` gives), else with ``pwrite``."""

    def __init__(self, fd: int, layout: ArenaLayout) -> None:
        self.fd = fd
        self.layout = layout
        self.specs = layout.tensor_specs()
        self.file_bytes = layout.file_bytes  # computed once: it walks every spec
        self.mapping = GuardedMapping.of(fd, self.file_bytes)

    def _truncated(self) -> ArenaMappingError:
        return ArenaMappingError(
            f"the arena's file {clip(self.layout.shm_path)} ended under a write: its client "
            f"truncated it"
        )

    def write_rows(self, spec: TensorSpec, slots: Tensor, rows: Tensor) -> None:
        """Write ``rows`` (one per slot, ``spec``'s row shape) at ``slots`` of the file's
        tensor ``spec``: through the mapping, or through the descriptor with one call
        per run of consecutive slots."""
        row_bytes = spec.nbytes // spec.shape[0]
        if row_bytes == 0 or not len(slots):
            return
        if self.mapping.ready():
            if os.fstat(self.fd).st_size < self.file_bytes:
                raise self._truncated()
            offsets = spec.offset_bytes + slots.numpy().astype("int64") * row_bytes
            if not self.mapping.scatter(offsets, row_bytes, rows):
                raise self._truncated()
            return
        data = rows.contiguous().view(torch.uint8).reshape(-1).numpy()
        done = 0
        for first, count in slot_runs(slots):
            chunk = data[done * row_bytes : (done + count) * row_bytes]
            written = os.pwrite(self.fd, chunk, spec.offset_bytes + first * row_bytes)
            if written != count * row_bytes:
                raise self._truncated()
            done += count

    def close(self) -> None:
        self.mapping.close()
        os.close(self.fd)


def export_cuda_arena(
    fmt: TierFormat,
    *,
    num_groups: int,
    num_layers: int,
    kv_heads: int,
    full_dtype: torch.dtype,
    device: torch.device | str,
) -> SharedArena:
    """Allocate a CUDA arena of ``num_groups`` groups as one device allocation (zeroed),
    its stores views at the layout's offsets, and export it by CUDA IPC (as the KV
    buffers are: ``cuda_ipc``; the scheduler keeps owning it)."""
    device = torch.device(device)
    layout = arena_layout_for(
        fmt,
        num_groups=num_groups,
        num_layers=num_layers,
        kv_heads=kv_heads,
        full_dtype=full_dtype,
        device=DEVICE_CUDA,
    )
    whole = torch.zeros(layout.file_bytes, dtype=torch.uint8, device=device)
    _, mem_handle, size_bytes, offset_bytes, *_ = whole.untyped_storage()._share_cuda_()
    export = CudaIpcBuffer(
        mem_handle=bytes(mem_handle),
        storage_offset_bytes=int(offset_bytes),
        storage_size_bytes=int(size_bytes),
        tensor_offset=int(whole.storage_offset()),
    )
    layout = dataclasses.replace(layout, device_index=device.index or 0, cuda=export)
    layout.validate()
    return SharedArena(path="", stores=stores_of(whole, layout), layout=layout)


@dataclass
class CudaArena:
    """A registered CUDA arena as the compactor holds it: the stores over the opened
    IPC allocation (``close`` drops them)."""

    layout: ArenaLayout
    stores: list[TierStore] | None

    def close(self) -> None:
        self.stores = None


def open_cuda_arena(layout: ArenaLayout) -> CudaArena:
    """Open a validated CUDA ``layout``'s allocation in this process: raises
    ``PoolDeviceUnavailable`` without the device, ``PoolMappingError`` when the handle
    does not open or the arena does not lie inside it; opens nothing then."""
    if not torch.cuda.is_available() or layout.device_index >= torch.cuda.device_count():
        raise PoolDeviceUnavailable(
            f"arena.device_index {layout.device_index}: the compactor sees "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA devices"
        )
    torch.cuda._lazy_init()
    with torch.cuda.device(layout.device_index):
        storage = open_storage("arena", layout.cuda, layout.device_index)
        empty = torch.empty((0,), dtype=torch.uint8, device=storage.device)
        whole = empty.set_(storage, layout.cuda.tensor_offset, (layout.file_bytes,), (1,))
    return CudaArena(layout, stores_of(whole, layout))
