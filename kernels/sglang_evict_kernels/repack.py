"""Repack: copy slots ``src -> dst`` in every layer's K and V buffer.

Buffers follow SGLang's MHA KV pool layout: one ``[slots, kv_heads, head_dim]`` tensor
per layer for K and one for V (fp8 caches are stored as uint8; K and V may be views of
one allocation). A move copies a slot's whole row (all heads) in every buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from sglang_evict_kernels._device import cached_int64, pointer_table


def _check_move_shapes(src_slots: Tensor, dst_slots: Tensor) -> None:
    """Equal 1-D int64 slot lists (checked from metadata only: no device read)."""
    if src_slots.shape != dst_slots.shape or src_slots.dim() != 1:
        raise ValueError(
            f"src_slots {tuple(src_slots.shape)} and dst_slots {tuple(dst_slots.shape)} must "
            f"be equal 1-D shapes"
        )
    if src_slots.dtype != torch.int64 or dst_slots.dtype != torch.int64:
        raise ValueError("src_slots and dst_slots must be int64")


def _check_moves(buffers: Sequence[Tensor], src_slots: Tensor, dst_slots: Tensor) -> None:
    _check_move_shapes(src_slots, dst_slots)
    if src_slots.numel() == 0:
        return
    num_slots = min(buf.shape[0] for buf in buffers)
    for name, slots in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        if int(slots.min()) < 0 or int(slots.max()) >= num_slots:
            raise ValueError(f"{name} has slots outside [0, {num_slots})")


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


# --- Triton: one launch over every layer's K and V ------------------------------------

# Copy unit: the widest integer word dividing every row's bytes (and address), so any
# dtype (bf16, fp16, fp32, fp8 stored as uint8) moves bit for bit.
_WORD_SIZES = (8, 4, 2, 1)
# Words copied per loop iteration of one program. Not tuned yet: the benchmark that
# chooses it (benches/bench_repack.py on the lent GPU) has not run; 1024 x 4-byte words
# cover a 4 KiB row in one iteration.
BLOCK_WORDS = 1024
# Moves per program: amortises the pointer-table loads over several rows (not tuned yet).
MOVES_PER_PROGRAM = 4

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
    def repack_rows_kernel(
        read_table_ptr,  # int64 [buffers]: base address each row is read from
        write_table_ptr,  # int64 [buffers]: base address each row is written to
        row_words_ptr,  # int64 [buffers]: words per slot row
        src_ptr,  # int64 [moves]
        dst_ptr,  # int64 [moves]
        num_moves,
        WORD: tl.constexpr,
        BLOCK: tl.constexpr,
        MOVES: tl.constexpr,
        SKIP_SELF: tl.constexpr,  # moves with src == dst are padding: copy nothing
    ):
        move_block = tl.program_id(0)
        buffer = tl.program_id(1)
        if WORD == 8:
            word_type = tl.int64
        elif WORD == 4:
            word_type = tl.int32
        elif WORD == 2:
            word_type = tl.int16
        else:
            word_type = tl.uint8
        read_base = tl.load(read_table_ptr + buffer).to(tl.pointer_type(word_type))
        write_base = tl.load(write_table_ptr + buffer).to(tl.pointer_type(word_type))
        row_words = tl.load(row_words_ptr + buffer)
        for m in tl.static_range(MOVES):
            move = move_block * MOVES + m
            if move < num_moves:
                src = tl.load(src_ptr + move)
                dst = tl.load(dst_ptr + move)
                copy_words = row_words
                if SKIP_SELF:
                    copy_words = tl.where(src == dst, 0, row_words)
                for start in range(0, copy_words, BLOCK):
                    offsets = start + tl.arange(0, BLOCK)
                    mask = offsets < copy_words
                    words = tl.load(read_base + src * row_words + offsets, mask=mask)
                    tl.store(write_base + dst * row_words + offsets, words, mask=mask)

    _KERNEL = repack_rows_kernel
    return _KERNEL


def _row_bytes(buffer: Tensor) -> int:
    return buffer[0].numel() * buffer.element_size()


def _word_size(buffers: Sequence[Tensor]) -> int:
    for size in _WORD_SIZES:
        if all(_row_bytes(b) % size == 0 and b.data_ptr() % size == 0 for b in buffers):
            return size
    return 1


def _launch(
    read: Sequence[Tensor],
    write: Sequence[Tensor],
    src: Tensor,
    dst: Tensor,
    skip_self: bool = False,
) -> None:
    """One launch: ``write[i][dst[j]] = read[i][src[j]]`` for every buffer i, move j
    (with ``skip_self``, moves whose ``src == dst`` copy nothing)."""
    device = read[0].device
    word = _word_size([*read, *write])
    tables = [pointer_table(bufs) for bufs in (read, write)]
    sizes = tuple(_row_bytes(b) // word for b in read)
    row_words = cached_int64(("row-words", sizes), sizes, device)
    grid = (-(-src.numel() // MOVES_PER_PROGRAM), len(read))
    _kernel()[grid](
        tables[0],
        tables[1],
        row_words,
        src,
        dst,
        src.numel(),
        WORD=word,
        BLOCK=BLOCK_WORDS,
        MOVES=MOVES_PER_PROGRAM,
        SKIP_SELF=skip_self,
    )


def repack_kv_triton(
    k_buffers: Sequence[Tensor],
    v_buffers: Sequence[Tensor],
    src_slots: Tensor,
    dst_slots: Tensor,
) -> None:
    """Triton repack: ``buf[dst] = buf[src]`` for every buffer, in one launch (grid: move
    blocks x buffers; a pointer table addresses the per-layer buffers, so K and V may be
    views of one allocation and may differ in row size).

    Overlap safety: when no destination is also a source (the planner guarantees it:
    invariant 3), moves are independent and run in one pass, in any order. Otherwise
    every source row is first staged in scratch buffers (one launch) and then written to
    its destination (a second launch): no destination is written before all sources
    were read. Bit-exact against ``repack_kv_reference``.
    """
    buffers = [*k_buffers, *v_buffers]
    _check_moves(buffers, src_slots, dst_slots)
    if src_slots.numel() == 0:
        return
    for buf in buffers:
        if not buf.is_contiguous() or buf.dim() < 2:
            raise ValueError("repack_kv_triton needs contiguous [slots, heads, dim] buffers")
    device = buffers[0].device
    src = src_slots.to(device, torch.int64)
    dst = dst_slots.to(device, torch.int64)
    if torch.isin(dst, src).any():
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
