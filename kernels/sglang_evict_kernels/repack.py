"""Repack: copy slots ``src -> dst`` in every layer's K and V buffer.

Buffers follow SGLang's MHA KV pool layout: one ``[slots, kv_heads, head_dim]`` tensor
per layer for K and one for V (fp8 caches are stored as uint8; K and V may be views of
one allocation). A move copies a slot's whole row (all heads) in every buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from sglang_evict_kernels._device import cached_int64


def _check_move_shapes(src_slots: Tensor, dst_slots: Tensor) -> None:
    """Equal 1-D int64 slot lists (checked from metadata only: no device read)."""
    if src_slots.shape != dst_slots.shape or src_slots.dim() != 1:
        raise ValueError(
            f"src_slots {tuple(src_slots.shape)} and dst_slots {tuple(dst_slots.shape)} must "
            f"be equal 1-D shapes"
        )
    if src_slots.dtype != torch.int64 or dst_slots.dtype != torch.int64:
        raise ValueError("src_slots and dst_slots must be int64")


def _check_moves(buffers: Sequence[Tensor], src_slots: Tensor, dst_slots: Tensor) -> bool:
    """Refuse moves outside the buffers' slots; return whether a destination is also a
    source (a chain, which needs staging). One host read of the device for both."""
    _check_move_shapes(src_slots, dst_slots)
    if src_slots.numel() == 0:
        return False
    num_slots = min(buf.shape[0] for buf in buffers)
    src, dst = src_slots.to(buffers[0].device), dst_slots.to(buffers[0].device)
    # Mark every source in a bitmap of the slots and look the destinations up in it;
    # clamped, so an out-of-range slot (refused below) indexes nothing outside it.
    is_source = torch.zeros(num_slots, dtype=torch.bool, device=src.device)
    is_source[src.clamp(0, num_slots - 1)] = True
    facts = torch.stack(
        [
            src.min() < 0,
            src.max() >= num_slots,
            dst.min() < 0,
            dst.max() >= num_slots,
            is_source[dst.clamp(0, num_slots - 1)].any(),
        ]
    ).tolist()
    for name, low, high in (("src_slots", *facts[0:2]), ("dst_slots", *facts[2:4])):
        if low or high:
            raise ValueError(f"{name} has slots outside [0, {num_slots})")
    return bool(facts[4])


def repack_kv_reference(
    k_buffers: Sequence[Tensor],
    v_buffers: Sequence[Tensor],
    src_slots: Tensor,
    dst_slots: Tensor,
) -> None:
    """Torch reference: ``buf[dst] = buf[src]`` for every buffer, in place.

    Overlap-safe by staging: each buffer's sources are gathered into a new tensor before
    any destination is written, so a destination that is also a source still yields
    the pre-pass content. (Plans from the planner never overlap; this reference does
    not rely on it.)
    """
    buffers = [*k_buffers, *v_buffers]
    _check_moves(buffers, src_slots, dst_slots)
    if src_slots.numel() == 0:
        return
    for buf in buffers:
        src = src_slots.to(buf.device)
        dst = dst_slots.to(buf.device)
        staged = buf.index_select(0, src)
        buf.index_copy_(0, dst, staged)


# --- Triton: one launch per row size over every layer's K and V ----------------------

# Copy unit: the widest integer word dividing every row's bytes (and address), so any
# dtype (bf16, fp16, fp32, fp8 stored as uint8) moves bit for bit.
_WORD_SIZES = (8, 4, 2, 1)
# Rows whose bytes and addresses are multiples of 16 move as 16-byte vectors (one
# LDG.128 / STG.128 per thread per vector on an NVIDIA GPU); any other row moves a word
# at a time.
VECTOR_BYTES = 16
# Bytes one program moves per chunk: MOVES_PER_PROGRAM = PROGRAM_BYTES // row bytes moves
# (a power of two, at least one), loaded as one [moves, row] tile before any is stored,
# so a program has PROGRAM_BYTES of loads in flight. 16 KiB over 4 warps is 8 vectors a
# thread: scripts/repack_kernel_sass.py counts 0.043 / 0.046 / 0.052 warp-instructions
# per moved byte at 128-byte / 1 KiB / 2 KiB rows on sm_90 (the kernel before it: 4.05
# / 0.51 / 0.25), 56 registers at most, no spill (a static count, not a measurement).
PROGRAM_BYTES = 16384
# Rows longer than this many bytes move in chunks of it (one static loop per program).
CHUNK_BYTES = 8192
NUM_WARPS = 4

_KERNEL = None


def _kernel():
    """The ``@triton.jit`` function, built on first use (importing the package does not
    import Triton)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def repack_tile_kernel(
        anchor_ptr,  # word-typed pointer every row address is counted from
        read_table_ptr,  # int64 [buffers]: vectors from anchor to the buffer rows are read in
        write_table_ptr,  # int64 [buffers]: vectors from anchor to the buffer rows go to
        src_ptr,  # int64 [moves]
        dst_ptr,  # int64 [moves]
        num_moves,
        ROW_WORDS: tl.constexpr,  # words per slot row (every buffer of this launch)
        CHUNK: tl.constexpr,  # words per tile column block: a power of two
        VEC: tl.constexpr,  # words per vector: row and table offsets are multiples of it
        MOVES: tl.constexpr,  # moves per program: a power of two
        SKIP_SELF: tl.constexpr,  # moves with src == dst are padding: copy nothing
    ):
        move_block = tl.program_id(0)
        buffer = tl.program_id(1)
        # Table entries count whole vectors, so every address below is a known multiple
        # of VEC words: the compiler emits vector loads and stores.
        read_base = tl.load(read_table_ptr + buffer) * VEC
        write_base = tl.load(write_table_ptr + buffer) * VEC
        moves = move_block * MOVES + tl.arange(0, MOVES)
        real = moves < num_moves
        src = tl.load(src_ptr + moves, mask=real, other=0)
        dst = tl.load(dst_ptr + moves, mask=real, other=0)
        if SKIP_SELF:
            real = real & (src != dst)
        src_rows = anchor_ptr + (read_base + src * ROW_WORDS)[:, None]
        dst_rows = anchor_ptr + (write_base + dst * ROW_WORDS)[:, None]
        cols = tl.arange(0, CHUNK)[None, :]
        for start in tl.static_range(0, ROW_WORDS, CHUNK):
            if ROW_WORDS % CHUNK == 0:
                mask = real[:, None]  # constant along the row: whole vectors
            else:
                mask = real[:, None] & (start + cols < ROW_WORDS)
            words = tl.load(src_rows + start + cols, mask=mask)
            tl.store(dst_rows + start + cols, words, mask=mask)

    _KERNEL = repack_tile_kernel
    return _KERNEL


def _row_bytes(buffer: Tensor) -> int:
    return buffer[0].numel() * buffer.element_size()


def _word_size(buffers: Sequence[Tensor]) -> int:
    for size in _WORD_SIZES:
        if all(_row_bytes(b) % size == 0 and b.data_ptr() % size == 0 for b in buffers):
            return size
    return 1


_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def launch_shape(row_bytes: int, word: int) -> dict:
    """The constexprs of one launch over rows of ``row_bytes``, moved as ``word``-byte
    words: ``ROW_WORDS``, ``CHUNK`` (a power of two of at most ``CHUNK_BYTES``),
    ``MOVES`` (a program's moves: ``PROGRAM_BYTES`` of rows, at least one) and ``VEC``
    (words per 16-byte vector when the row's bytes allow it)."""
    row_words = row_bytes // word
    chunk = min(_pow2_ceil(row_words), max(1, CHUNK_BYTES // word))
    vec = VECTOR_BYTES // word if row_bytes % VECTOR_BYTES == 0 else 1
    moves = _pow2_floor(max(1, PROGRAM_BYTES // max(row_bytes, 1)))
    return {"ROW_WORDS": row_words, "CHUNK": chunk, "VEC": vec, "MOVES": moves}


def _launch(
    read: Sequence[Tensor],
    write: Sequence[Tensor],
    src: Tensor,
    dst: Tensor,
    skip_self: bool = False,
) -> None:
    """``write[i][dst[j]] = read[i][src[j]]`` for every buffer i, move j (with
    ``skip_self``, moves whose ``src == dst`` copy nothing): one launch per distinct row
    size (K and V usually share one)."""
    by_row: dict[int, list[int]] = {}
    for i, buffer in enumerate(read):
        by_row.setdefault(_row_bytes(buffer), []).append(i)
    for row_bytes, members in by_row.items():
        _launch_rows(
            [read[i] for i in members], [write[i] for i in members], src, dst, row_bytes, skip_self
        )


def _launch_rows(read, write, src, dst, row_bytes: int, skip_self: bool) -> None:
    device = read[0].device
    word = _word_size([*read, *write])
    shape = launch_shape(row_bytes, word)
    if any(b.data_ptr() % (word * shape["VEC"]) for b in (*read, *write)):
        shape = {**shape, "VEC": 1}
    unit = word * shape["VEC"]
    anchor = read[0].view(-1).view(_WORD_DTYPES[word])
    tables = [
        cached_int64(
            ("vectors", anchor.data_ptr(), unit, tuple(b.data_ptr() for b in bufs)),
            [(b.data_ptr() - anchor.data_ptr()) // unit for b in bufs],
            device,
        )
        for bufs in (read, write)
    ]
    grid = (-(-src.numel() // shape["MOVES"]), len(read))
    _kernel()[grid](
        anchor,
        tables[0],
        tables[1],
        src,
        dst,
        src.numel(),
        **shape,
        SKIP_SELF=skip_self,
        num_warps=NUM_WARPS,
    )


def repack_kv_triton(
    k_buffers: Sequence[Tensor],
    v_buffers: Sequence[Tensor],
    src_slots: Tensor,
    dst_slots: Tensor,
) -> None:
    """Triton repack: ``buf[dst] = buf[src]`` for every buffer, in one launch per row
    size (grid: move blocks x buffers; a table of offsets addresses the per-layer
    buffers, so K and V may be views of one allocation and may differ in row size).

    The moves are checked with one host read (slots in range, and whether any
    destination is also a source). Overlap safety: when no destination is also a
    source (the planner guarantees it: invariant 3), moves are independent and run in
    one pass, in any order. Otherwise every source row is first staged in scratch
    buffers (one launch) and then written to its destination (a second launch): no
    destination is written before all sources were read. Bit-exact against
    ``repack_kv_reference``.
    """
    buffers = [*k_buffers, *v_buffers]
    _check_move_shapes(src_slots, dst_slots)
    if src_slots.numel() == 0:
        return
    for buf in buffers:
        if not buf.is_contiguous() or buf.dim() < 2:
            raise ValueError("repack_kv_triton needs contiguous [slots, heads, dim] buffers")
    chained = _check_moves(buffers, src_slots, dst_slots)
    device = buffers[0].device
    src = src_slots.to(device, torch.int64)
    dst = dst_slots.to(device, torch.int64)
    if chained:
        staging = [
            torch.empty((src.numel(), *b.shape[1:]), dtype=b.dtype, device=device) for b in buffers
        ]
        order = torch.arange(src.numel(), dtype=torch.int64, device=device)
        _launch(buffers, staging, src, order)
        _launch(staging, buffers, order, dst)
        return
    _launch(buffers, buffers, src, dst)


# --- independent moves from a device plan: no check that reads device data -----------


def copy_independent_moves(buffers: Sequence[Tensor], src_slots: Tensor, dst_slots: Tensor) -> None:
    """``buf[dst] = buf[src]`` per buffer in two tensor operations (every source read
    before any write, so independent moves need no staging); self-moves are copied too.
    The torch form of ``repack_kv_independent``; reads no device data on the host."""
    for buf in buffers:
        buf.index_copy_(0, dst_slots, buf.index_select(0, src_slots))


def repack_kv_independent(
    k_buffers: Sequence[Tensor],
    v_buffers: Sequence[Tensor],
    src_slots: Tensor,
    dst_slots: Tensor,
) -> None:
    """``buf[dst] = buf[src]`` for moves already known to be independent (no slot both
    read and written), where a move with ``src == dst`` is padding and copies nothing.

    For plans made on the device (``sglang_evict.passes.batch``): the number of real
    moves is data the host never reads, so a plan comes as a fixed-size tensor padded
    with self-moves (slot 0 -> slot 0, SGLang's padding slot), and nothing here may
    read device data on the host: no range check, no overlap check (``_check_moves``
    and the chain test of ``repack_kv_triton`` each synchronise). The planner's
    invariants, property-tested, are what make the moves independent and in range.

    CUDA: one Triton launch (``SKIP_SELF``: a padding move loads its two indices and
    stops). CPU: the self-moves are dropped by a boolean mask (no device to wait for)
    and the rest are copied with ``index_select``/``index_copy_`` per buffer. Any other
    device (``meta`` included): every move is copied, self-moves too, with the same two
    operations and no host read. A self-move writes back the value it read: no other
    move reads or writes its slot (independence), and every read precedes every write.
    """
    buffers = [*k_buffers, *v_buffers]
    _check_move_shapes(src_slots, dst_slots)
    if src_slots.numel() == 0:
        return
    device = buffers[0].device
    if device.type != "cuda":
        src, dst = src_slots.to(device), dst_slots.to(device)
        if device.type == "cpu":
            real = src != dst
            src, dst = src[real], dst[real]
        copy_independent_moves(buffers, src, dst)
        return
    for buf in buffers:
        if not buf.is_contiguous() or buf.dim() < 2:
            raise ValueError("repack_kv_independent needs contiguous [slots, heads, dim] buffers")
    _launch(buffers, buffers, src_slots.to(device), dst_slots.to(device), skip_self=True)
