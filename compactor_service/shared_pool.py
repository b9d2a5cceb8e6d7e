"""KV buffers that two processes map: the scheduler owns them, the compactor writes them.

A CPU pool lives in one file of the pool directory (a private tmpfs directory, see
``runtime_dir``; the file is mode 0600): every layer's K and V buffer at its own 4 KiB-
aligned offset. The scheduler maps the file ``MAP_SHARED`` and the compactor writes it
through its descriptor, so a copy made by the compactor is the scheduler's KV. A GPU
pool is exported with CUDA IPC as plain fields (``cuda_ipc``); the compactor opens each
handle once per pool and keeps it open for the pool's life. Nothing is ever unpickled.

    file layout (one pool)   [ k0 | pad ][ k1 | pad ] ... [ v0 | pad ] ... [ v(L-1) ]
    handle of buffer i        (shm_path, i * stride),  stride = buffer bytes rounded up

What the compactor maps (``PoolDirectory.open_pool_file``), so that a client can make
it write nowhere but into a pool the client created for it:

* the file's directory is the compactor's pool directory, its name has the form
  ``create_shared_buffers`` gives (``sglang-evict-kv-<pid>-<hex>``), every buffer of
  the pool names that one file, at exactly the offsets above;
* opened relative to the directory with ``O_NOFOLLOW`` (no symlink), then checked on
  the open descriptor: a regular file, one link, owned by the compactor's uid (gRPC does
  not expose the peer's credentials, and the pool directory is private to that uid), of
  exactly the size the layout implies; kept open, so nothing can swap the file after
  the check.

The scheduler maps its file; the compactor never does (``PoolFile``): it copies slots
with ``pread``/``pwrite`` on that descriptor, which see the same page cache as the
scheduler's mapping, and which fail with a short count where a mapping of a file its
client truncated would fault (SIGBUS) and take every other client's pool down with the
compactor.

This module is transport-free: ``PoolLayout`` is a plain dataclass, converted to and
from the proto message by the gRPC layer.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from compactor_service.limits import MAX_DEVICE_INDEX, MAX_LAYERS, clip
from compactor_service.runtime_dir import ensure_private_dir

ALIGN_BYTES = 4096
DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "uint8": torch.uint8,  # fp8 pools store uint8
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
DEVICE_CPU = "cpu"
DEVICE_CUDA = "cuda"
POOL_FILE_PREFIX = "sglang-evict-kv-"
_POOL_FILE_NAME = re.compile(re.escape(POOL_FILE_PREFIX) + r"[0-9]{1,10}-[0-9a-f]{12}")


class PoolMappingError(ValueError):
    """A pool layout cannot be mapped: malformed, inconsistent, or not what it says."""


class PoolFileRefused(PoolMappingError):
    """The layout names a file the compactor must not map (outside its pool directory, a
    symlink, not a pool file, someone else's)."""


class PoolFileMissing(PoolMappingError):
    """The pool's file does not exist (the scheduler removed it, or never created it)."""


class PoolDeviceUnavailable(PoolMappingError):
    """The pool is on a device this host does not have (a CUDA pool without CUDA)."""


@dataclass(frozen=True)
class CudaIpcBuffer:
    """The fields of torch's CUDA storage sharing, as data (see ``cuda_ipc``)."""

    mem_handle: bytes
    storage_offset_bytes: int
    storage_size_bytes: int
    tensor_offset: int  # elements


@dataclass(frozen=True)
class BufferHandle:
    shm_path: str = ""  # CPU: the pool's file
    offset_bytes: int = 0
    cuda: CudaIpcBuffer | None = None  # CUDA: the buffer's IPC export


@dataclass(frozen=True)
class PoolLayout:
    """What a compactor needs to map a scheduler's KV pool."""

    num_layers: int
    num_slots: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    device: str  # "cpu" or "cuda"
    device_index: int = 0
    k_buffers: tuple[BufferHandle, ...] = field(default_factory=tuple)
    v_buffers: tuple[BufferHandle, ...] = field(default_factory=tuple)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_slots, self.num_kv_heads, self.head_dim)

    @property
    def buffer_bytes(self) -> int:
        itemsize = DTYPES[self.dtype].itemsize
        return self.num_slots * self.num_kv_heads * self.head_dim * itemsize

    @property
    def stride_bytes(self) -> int:
        """Distance between two buffers in a CPU pool's file."""
        return -(-self.buffer_bytes // ALIGN_BYTES) * ALIGN_BYTES

    @property
    def file_bytes(self) -> int:
        return 2 * self.num_layers * self.stride_bytes

    def handles(self) -> list[tuple[str, BufferHandle]]:
        """Every buffer handle with its field name, K buffers first."""
        return [
            (f"layout.{side}[{i}]", handle)
            for side, handles in (("k_buffers", self.k_buffers), ("v_buffers", self.v_buffers))
            for i, handle in enumerate(handles)
        ]

    def validate(self) -> None:
        """Raise ``PoolMappingError`` unless the layout is self-consistent."""
        if self.dtype not in DTYPES:
            raise PoolMappingError(
                f"layout.dtype: unknown dtype {clip(self.dtype)}; known: {sorted(DTYPES)}"
            )
        if self.device not in (DEVICE_CPU, DEVICE_CUDA):
            raise PoolMappingError(f"layout.device: unknown device {clip(self.device)}")
        for name in ("num_layers", "num_slots", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) < 1:
                raise PoolMappingError(f"layout.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_layers > MAX_LAYERS:
            raise PoolMappingError(f"layout.num_layers {self.num_layers} > {MAX_LAYERS}")
        if self.page_size > self.num_slots:
            raise PoolMappingError(
                f"layout.page_size {self.page_size} exceeds num_slots {self.num_slots}"
            )
        if not 0 <= self.device_index <= MAX_DEVICE_INDEX:
            raise PoolMappingError(
                f"layout.device_index {self.device_index} is outside [0, {MAX_DEVICE_INDEX}]"
            )
        if len(self.k_buffers) != self.num_layers or len(self.v_buffers) != self.num_layers:
            raise PoolMappingError(
                f"need {self.num_layers} K and V buffer handles, got "
                f"{len(self.k_buffers)} and {len(self.v_buffers)}"
            )
        for name, handle in self.handles():
            if self.device == DEVICE_CPU and (handle.cuda is not None or not handle.shm_path):
                raise PoolMappingError(f"{name}: a CPU buffer needs shm_path and no cuda export")
            if self.device == DEVICE_CUDA and (handle.cuda is None or handle.shm_path):
                raise PoolMappingError(f"{name}: a CUDA buffer needs its cuda export, no shm_path")
        if self.device == DEVICE_CPU:
            self._validate_cpu_file_layout()

    def _validate_cpu_file_layout(self) -> None:
        path = self.k_buffers[0].shm_path
        for index, (name, handle) in enumerate(self.handles()):
            if handle.shm_path != path:
                raise PoolMappingError(
                    f"{name}.shm_path differs from layout.k_buffers[0].shm_path: a pool is one file"
                )
            if handle.offset_bytes != index * self.stride_bytes:
                raise PoolMappingError(
                    f"{name}.offset_bytes is {handle.offset_bytes}, expected "
                    f"{index * self.stride_bytes} (buffer {index} of the pool's file)"
                )


def _views(whole: Tensor, layout: PoolLayout) -> tuple[list[Tensor], list[Tensor]]:
    """Per-layer K and V views of a pool file mapped as ``uint8`` ``whole``."""
    dtype = DTYPES[layout.dtype]
    views = [
        whole[i * layout.stride_bytes : i * layout.stride_bytes + layout.buffer_bytes]
        .view(dtype)
        .view(layout.shape)
        for i in range(2 * layout.num_layers)
    ]
    return views[: layout.num_layers], views[layout.num_layers :]


def _map_fd(fd: int, size_bytes: int) -> Tensor:
    """The whole file behind ``fd`` as a shared, writable ``uint8`` tensor."""
    mapping = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive


class PoolDirectory:
    """The compactor's pool directory: created 0700 if missing, refused if others can
    write it; held open so that files are looked up in this very directory."""

    def __init__(self, path: str | os.PathLike, flag: str = "--pool-dir") -> None:
        self.path = ensure_private_dir(path, flag)
        self.flag = flag
        self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)

    def close(self) -> None:
        os.close(self._fd)

    def open_pool_file(self, layout: PoolLayout) -> int:
        """A read-write descriptor of the CPU pool's file, after every check of the
        module docstring; raises ``PoolFileRefused``, ``PoolFileMissing`` or
        ``PoolMappingError`` (wrong size)."""
        return self.open_checked(
            layout.k_buffers[0].shm_path,
            "layout.k_buffers[0].shm_path",
            _POOL_FILE_NAME,
            f"a pool file ({POOL_FILE_PREFIX}<pid>-<hex>, as create_shared_buffers names them)",
            layout.file_bytes,
        )

    def open_fence_file(self, path: str) -> int:
        """A read-write descriptor of a pool's fence file (``compactor_service.fence``),
        under the same checks as a pool file."""
        from compactor_service.fence import FENCE_BYTES, FENCE_FILE_NAME, FENCE_FILE_PREFIX

        return self.open_checked(
            path,
            "fence_file",
            FENCE_FILE_NAME,
            f"a fence file ({FENCE_FILE_PREFIX}<pid>-<hex>)",
            FENCE_BYTES,
        )

    def open_checked(
        self, path: str, where: str, pattern: re.Pattern, kind: str, size_bytes: int
    ) -> int:
        """A read-write descriptor of ``path`` (named ``where`` in refusals) after the
        module docstring's checks: in this directory, named by ``pattern``, a regular
        file of one link owned by this uid, of exactly ``size_bytes``."""
        shown = clip(path)
        if os.path.dirname(path) != str(self.path):
            raise PoolFileRefused(
                f"{where} {shown} is not in the compactor's pool directory {self.path}; "
                f"start the scheduler with --kv-compactor-pool-dir {self.path}"
            )
        name = os.path.basename(path)
        if not pattern.fullmatch(name):
            raise PoolFileRefused(f"{where} {shown} is not {kind}")
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=self._fd)
        except FileNotFoundError:
            raise PoolFileMissing(f"{where} {shown} does not exist") from None
        except IsADirectoryError:
            raise PoolMappingError(f"{where} {shown} is a directory, not {kind}") from None
        except OSError as error:
            raise PoolFileRefused(f"{where} {shown} cannot be opened ({error.strerror})") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise PoolMappingError(f"{where} {shown} is not a regular file")
            if info.st_uid != os.geteuid():
                raise PoolFileRefused(
                    f"{where} {shown} is owned by uid {info.st_uid}, not by the compactor's "
                    f"uid {os.geteuid()}"
                )
            if info.st_nlink != 1:
                raise PoolFileRefused(f"{where} {shown} has {info.st_nlink} links, expected 1")
            if info.st_size != size_bytes:
                raise PoolMappingError(
                    f"{where} {shown} holds {info.st_size} bytes; the layout needs exactly "
                    f"{size_bytes}"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open_pool(self, layout: PoolLayout) -> PoolFile:
        return PoolFile(self.open_pool_file(layout), layout)


class PoolFileTruncated(RuntimeError):
    """A registered pool's file lost bytes (its client truncated it): the copy stopped
    there and the pool is dropped. Slots of that call may have been partly copied."""


# A read of scattered rows (``PoolFile.read_tokens``) reads through gaps up to this
# size rather than issuing another call.
READ_GAP_BYTES = 64 << 10


def slot_runs(slots: Tensor) -> list[tuple[int, int]]:
    """``(first slot, count)`` of each run of consecutive values of ``slots``, in order
    (one ``pread``/``pwrite`` a run)."""
    values = slots.numpy()
    if not len(values):
        return []
    starts = np.concatenate([[0], np.nonzero(np.diff(values) != 1)[0] + 1])
    lengths = np.diff(np.concatenate([starts, [len(values)]]))
    return [(int(values[s]), int(n)) for s, n in zip(starts, lengths, strict=True)]


class GuardedMapping:
    """A file's shared mapping whose copies run under the guarded copy module's SIGBUS
    guard (``sglang_evict_kernels.guarded_copy``), made once the module is loaded (never
    waited for: until then ``ready`` is False and callers use the descriptor)."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self.fd, self.nbytes = fd, nbytes
        self.addr: int | None = None
        self.module = None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, fd: int, nbytes: int) -> GuardedMapping:
        return cls(fd, nbytes)

    def ready(self) -> bool:
        if self.addr is not None:
            return True
        from sglang_evict_kernels import guarded_copy

        module = guarded_copy.loaded()
        if module is None or self.nbytes <= 0:
            return False
        with self._lock:
            if self.addr is None and os.fstat(self.fd).st_size >= self.nbytes:
                self.addr = int(module.map_shared(self.fd, self.nbytes))
                self.module = module
        return self.addr is not None

    def copy_runs(self, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> bool:
        return bool(
            self.module.copy_runs(
                self.addr,
                self.nbytes,
                torch.from_numpy(np.ascontiguousarray(src, dtype=np.int64)),
                torch.from_numpy(np.ascontiguousarray(dst, dtype=np.int64)),
                torch.from_numpy(np.ascontiguousarray(lengths, dtype=np.int64)),
            )
        )

    def gather(
        self, offsets: np.ndarray, row_bytes: int, out: Tensor | None = None
    ) -> Tensor | None:
        """Rows at byte ``offsets`` into ``out`` (uint8 ``[n, row_bytes]``, made when
        None), or None when the file ended under the read."""
        if out is None:
            out = torch.empty((len(offsets), row_bytes), dtype=torch.uint8)
        offsets = torch.from_numpy(np.ascontiguousarray(offsets, dtype=np.int64))
        ok = self.module.gather_rows(self.addr, self.nbytes, offsets, row_bytes, out)
        return out if ok else None

    def scatter(self, offsets: np.ndarray, row_bytes: int, rows: Tensor) -> bool:
        offsets = torch.from_numpy(np.ascontiguousarray(offsets, dtype=np.int64))
        rows = rows.contiguous().view(torch.uint8).reshape(-1)
        return bool(self.module.scatter_rows(self.addr, self.nbytes, offsets, row_bytes, rows))

    def close(self) -> None:
        with self._lock:
            if self.addr is not None:
                self.module.unmap(self.addr, self.nbytes)
                self.addr = None


class PoolFile:
    """A registered CPU pool as the compactor sees it: the file's descriptor, never a
    mapping. Slots are copied with ``pread``/``pwrite`` (contiguous runs of moves in one
    call each, per buffer), which return short counts on a file its client truncated
    under them, where an unguarded access through a mapping would kill the whole
    compactor with SIGBUS (and with it every other client's pool). Once the guarded
    copy module is loaded (``sglang_evict_kernels.guarded_copy``), the file is mapped
    and every copy runs under its SIGBUS guard instead: the same bytes, no system call a
    run, and a truncation still only drops this pool."""

    KERNEL = "pread-pwrite"
    MAPPED_KERNEL = "guarded-mapping"

    def __init__(self, fd: int, layout: PoolLayout) -> None:
        self.fd = fd
        self.layout = layout
        self.dtype = DTYPES[layout.dtype]
        self.row_bytes = layout.num_kv_heads * layout.head_dim * self.dtype.itemsize
        self.bytes_per_slot = 2 * layout.num_layers * self.row_bytes
        self.mapping = GuardedMapping.of(fd, layout.file_bytes)

    @property
    def kernel(self) -> str:
        return self.MAPPED_KERNEL if self.mapping.ready() else self.KERNEL

    def _truncated(self, what: str) -> PoolFileTruncated:
        return PoolFileTruncated(
            f"the pool's file {clip(self.layout.k_buffers[0].shm_path)} {what}: its client "
            f"truncated it; the pool is dropped (register it again)"
        )

    def copy_slots(self, src: Tensor, dst: Tensor) -> None:
        """Copy every buffer's row ``src[i]`` to row ``dst[i]`` (validated moves: no slot
        both read and written, so the order does not matter)."""
        size = os.fstat(self.fd).st_size
        if size < self.layout.file_bytes:
            raise self._truncated(f"holds {size} of its {self.layout.file_bytes} bytes")
        src_np, dst_np = src.numpy(), dst.numpy()
        # Runs: consecutive moves whose sources and destinations both continue by one.
        breaks = (np.diff(src_np) != 1) | (np.diff(dst_np) != 1)
        starts = np.concatenate([[0], np.nonzero(breaks)[0] + 1])
        lengths = np.diff(np.concatenate([starts, [len(src_np)]]))
        row = self.row_bytes
        if self.mapping.ready():
            bases = np.arange(2 * self.layout.num_layers, dtype=np.int64)[:, None]
            bases = bases * self.layout.stride_bytes
            src_bytes = (bases + src_np[starts][None, :] * row).reshape(-1)
            dst_bytes = (bases + dst_np[starts][None, :] * row).reshape(-1)
            counts = np.broadcast_to(lengths[None, :] * row, (len(bases), len(starts)))
            if not self.mapping.copy_runs(src_bytes, dst_bytes, counts.reshape(-1)):
                raise self._truncated("ended under the copy")
            return
        runs = [
            (int(src_np[s]) * row, int(dst_np[s]) * row, int(n) * row)
            for s, n in zip(starts, lengths, strict=True)
        ]
        pread, pwrite, fd = os.pread, os.pwrite, self.fd
        for buffer in range(2 * self.layout.num_layers):
            base = buffer * self.layout.stride_bytes
            for src_bytes, dst_bytes, count in runs:
                data = pread(fd, count, base + src_bytes)
                if len(data) != count or pwrite(fd, data, base + dst_bytes) != count:
                    raise self._truncated("ended under the copy")

    def read_tokens(self, buffer: int, slots: Tensor, out: Tensor | None = None) -> Tensor:
        """Buffer ``buffer``'s rows ``slots`` (K buffers first, then V) as the pool's
        dtype, ``[len(slots), kv heads, head dim]``, into ``out`` when given (a
        contiguous tensor of that shape and dtype, which a caller reading layer after
        layer reuses: a fresh tensor a read costs its page faults every time), through
        the guarded mapping once it is ready, else through the descriptor: the
        slots sorted, and each span of them whose gaps stay under ``READ_GAP_BYTES`` read
        in one call (the unwanted rows between read and dropped: a scattered eviction's
        tokens cost a few calls a request, not one a token)."""
        row, base = self.row_bytes, buffer * self.layout.stride_bytes
        shape = (len(slots), self.layout.num_kv_heads, self.layout.head_dim)
        if self.mapping.ready():
            size = os.fstat(self.fd).st_size
            if size < self.layout.file_bytes:
                raise self._truncated(f"holds {size} of its {self.layout.file_bytes} bytes")
            into = None if out is None else out.view(torch.uint8).view(len(slots), row)
            rows = self.mapping.gather(base + slots.numpy().astype(np.int64) * row, row, into)
            if rows is None:
                raise self._truncated("ended under a read")
            return rows.view(self.dtype).view(shape) if out is None else out
        values = slots.numpy()
        order = np.argsort(values, kind="stable")
        ordered = values[order]
        if out is None:
            out = torch.empty(shape, dtype=self.dtype)
        out_np = out.view(torch.uint8).view(len(values), row).numpy()
        if len(values):
            gap_slots = max(1, READ_GAP_BYTES // row)
            breaks = np.nonzero(np.diff(ordered) > gap_slots)[0] + 1
            starts = np.concatenate([[0], breaks])
            ends = np.concatenate([breaks, [len(values)]])
            for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
                first, count = int(ordered[s]), int(ordered[e - 1] - ordered[s]) + 1
                data = os.pread(self.fd, count * row, base + first * row)
                if len(data) != count * row:
                    raise self._truncated("ended under a read")
                block = np.frombuffer(data, dtype=np.uint8).reshape(count, row)
                out_np[order[s:e]] = block[ordered[s:e] - first]
        return out

    def close(self) -> None:
        self.mapping.close()
        os.close(self.fd)


@dataclass
class SharedKVBuffers:
    """The scheduler's side of a CPU shared pool: per-layer views into one pool file.

    ``close`` removes the file; mappings stay valid in processes that hold them until
    they drop their tensors (POSIX unlink semantics).
    """

    path: Path
    k: list[Tensor]
    v: list[Tensor]
    layout: PoolLayout

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


def create_shared_buffers(
    *,
    num_layers: int,
    num_slots: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    page_size: int,
    directory: str | os.PathLike,
    copy_from: tuple[Sequence[Tensor], Sequence[Tensor]] | None = None,
    flag: str = "--kv-compactor-pool-dir",
) -> SharedKVBuffers:
    """Allocate a CPU pool in a new file (mode 0600) of the pool ``directory`` (created
    0700 if missing, refused if others can write it), optionally copying the current
    contents of ``copy_from = (k_buffers, v_buffers)`` into it."""
    if dtype not in DTYPE_NAMES:
        raise PoolMappingError(f"unsupported KV dtype {dtype}; known: {sorted(DTYPES)}")
    directory = ensure_private_dir(directory, flag)
    layout = PoolLayout(
        num_layers=num_layers,
        num_slots=num_slots,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=DTYPE_NAMES[dtype],
        page_size=page_size,
        device=DEVICE_CPU,
    )
    path = directory / f"{POOL_FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    handles = tuple(BufferHandle(str(path), i * layout.stride_bytes) for i in range(2 * num_layers))
    layout = replace(layout, k_buffers=handles[:num_layers], v_buffers=handles[num_layers:])
    layout.validate()
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, layout.file_bytes)
        k, v = _views(_map_fd(fd, layout.file_bytes), layout)
    finally:
        os.close(fd)
    if copy_from is not None:
        for dst, src in zip(k + v, [*copy_from[0], *copy_from[1]], strict=True):
            dst.copy_(src)
    return SharedKVBuffers(path=path, k=k, v=v, layout=layout)
