"""Triton repack kernel against its torch reference, bit for bit.

On a GPU the kernel is compiled and its programs run in parallel; on CPU it runs under
Triton's interpreter (conftest selects it before anything imports Triton kernels), so
shapes stay tiny (``tests/kernel_device.py``). The interpreter runs programs one after
another, in move order, which hides races; chained moves are therefore tested both
ways: there, the single-pass launch over a chain really does corrupt (the hazard
exists), and on either device the public launcher, which stages chains, matches the
reference.
"""

from __future__ import annotations

import random

import pytest
import torch

from compactor_service.compactor import InProcessCompactor
from sglang_evict.passes.planner import fresh_pages_needed, plan_compaction
from sglang_evict_kernels import repack_kv_reference, repack_kv_triton
from sglang_evict_kernels.repack import _launch, _row_bytes, launch_shape
from tests.kernel_device import INTERPRETED, on_kernel_device

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]  # uint8: fp8 storage


def make_buffers(
    num_slots,
    layers=2,
    heads=2,
    head_dim=64,
    v_head_dim=None,
    dtype=torch.float32,
    one_allocation=False,
    seed=0,
):
    """Per-layer K and V ``[slots, heads, dim]`` buffers with random bits."""
    g = torch.Generator().manual_seed(seed)
    v_head_dim = v_head_dim or head_dim

    def rand(*shape):
        bits = torch.randint(
            0,
            256,
            (*shape[:-1], shape[-1] * torch.empty(0, dtype=dtype).element_size()),
            generator=g,
            dtype=torch.uint8,
        )
        return bits.view(dtype)

    if one_allocation:  # K and V as views of one tensor, like some pools allocate them
        whole = on_kernel_device(rand(2, layers, num_slots, heads, head_dim))
        return [whole[0, i] for i in range(layers)], [whole[1, i] for i in range(layers)]
    return (
        on_kernel_device([rand(num_slots, heads, head_dim) for _ in range(layers)]),
        on_kernel_device([rand(num_slots, heads, v_head_dim) for _ in range(layers)]),
    )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (random bit patterns include NaNs, which torch.equal rejects)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_same_as_reference(k, v, src, dst):
    k_ref, v_ref = [b.clone() for b in k], [b.clone() for b in v]
    repack_kv_reference(k_ref, v_ref, src, dst)
    repack_kv_triton(k, v, on_kernel_device(src), on_kernel_device(dst))
    for name, got, want in [("K", k, k_ref), ("V", v, v_ref)]:
        for layer, (g, w) in enumerate(zip(got, want, strict=True)):
            assert same_bits(g, w), f"{name}[{layer}]"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_moves", [1, 3, 17, 63])
def test_disjoint_moves_match_the_reference(dtype, num_moves):
    num_slots = 2 * num_moves + 5
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(num_moves))
    src, dst = slots[:num_moves], slots[num_moves : 2 * num_moves]
    k, v = make_buffers(num_slots, dtype=dtype, head_dim=64 if num_moves % 2 else 128)
    assert_same_as_reference(k, v, src, dst)


def test_k_and_v_as_views_of_one_allocation_and_different_value_head_dim():
    src, dst = torch.tensor([0, 5, 9]), torch.tensor([3, 7, 1])
    assert_same_as_reference(*make_buffers(12, dtype=torch.bfloat16, one_allocation=True), src, dst)
    assert_same_as_reference(*make_buffers(12, head_dim=128, v_head_dim=64), src, dst)


def test_empty_plan_changes_nothing():
    k, v = make_buffers(4)
    before = [b.clone() for b in (*k, *v)]
    empty = on_kernel_device(torch.zeros(0, dtype=torch.int64))
    repack_kv_triton(k, v, empty, empty)
    assert all(same_bits(a, b) for a, b in zip(before, (*k, *v), strict=True))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("strategy", ["repack", "hole_fill"])
def test_planner_plans_match_the_reference(page_size, strategy):
    rng = random.Random(page_size)
    num_tokens = 63
    row = torch.arange(num_tokens, dtype=torch.int64) + page_size
    survivors = torch.tensor(sorted(rng.sample(range(num_tokens), 17)))
    need = fresh_pages_needed(row, survivors, page_size=page_size, strategy=strategy)
    first = (num_tokens + 2 * page_size) // page_size
    plan = plan_compaction(
        row,
        survivors,
        page_size=page_size,
        strategy=strategy,
        fresh_pages=list(range(first, first + need)),
    )
    k, v = make_buffers((first + need + 1) * page_size, head_dim=64)
    assert plan.num_moves or page_size == 1
    assert_same_as_reference(k, v, plan.src_slots, plan.dst_slots)


def test_chained_moves_are_staged_so_no_destination_is_written_before_it_is_read():
    src, dst = torch.tensor([1, 2, 3, 4]), torch.tensor([2, 3, 4, 5])  # each dst is a src
    assert_same_as_reference(*make_buffers(8), src, dst)
    # A chain longer than one program's moves: a program loads all its rows before it
    # stores any, so the hazard is between programs.
    k, v = make_buffers(8)
    moves = 2 * launch_shape(_row_bytes(k[0]), 8)["MOVES"] + 3
    src, dst = torch.arange(1, moves + 1), torch.arange(2, moves + 2)
    assert_same_as_reference(*make_buffers(moves + 3), src, dst)
    if not INTERPRETED:
        return  # in parallel, whether a read beats the write of its row is a race
    # The hazard is real: one unstaged pass in program order reads overwritten rows.
    k, v = make_buffers(moves + 3)
    k_ref, v_ref = [b.clone() for b in k], [b.clone() for b in v]
    repack_kv_reference(k_ref, v_ref, src, dst)
    buffers = [*k, *v]
    _launch(buffers, buffers, src, dst)
    assert not same_bits(k[0], k_ref[0])


def test_move_order_does_not_matter_for_disjoint_plans():
    src, dst = torch.tensor([0, 1, 2, 3, 4]), torch.tensor([9, 8, 7, 6, 5])
    k1, v1 = make_buffers(10)
    k2, v2 = [b.clone() for b in k1], [b.clone() for b in v1]
    src, dst = on_kernel_device(src), on_kernel_device(dst)
    repack_kv_triton(k1, v1, src, dst)
    order = on_kernel_device(torch.tensor([3, 0, 4, 2, 1]))
    repack_kv_triton(k2, v2, src[order], dst[order])
    assert all(same_bits(a, b) for a, b in zip((*k1, *v1), (*k2, *v2), strict=True))


def test_bad_moves_are_refused_before_anything_moves():
    k, v = make_buffers(4)
    before = [b.clone() for b in (*k, *v)]
    slots = {i: on_kernel_device(torch.tensor([i])) for i in (0, 1, 4)}
    with pytest.raises(ValueError, match="outside"):
        repack_kv_triton(k, v, slots[0], slots[4])
    with pytest.raises(ValueError, match="int64"):
        repack_kv_triton(k, v, slots[0].to(torch.int32), slots[1])
    with pytest.raises(ValueError, match="contiguous"):
        repack_kv_triton([b[:, :, ::2] for b in k], v, slots[0], slots[1])
    assert all(same_bits(a, b) for a, b in zip(before, (*k, *v), strict=True))


def test_in_process_compactor_runs_the_triton_kernel_when_asked():
    k, v = make_buffers(40)
    row = torch.arange(32, dtype=torch.int64)
    plan = plan_compaction(row, torch.tensor([0, 1, 2, 3, 20, 30]), page_size=4)
    k_ref, v_ref = [b.clone() for b in k], [b.clone() for b in v]
    InProcessCompactor(k_ref, v_ref).compact([plan])
    result = InProcessCompactor(k, v, kernel="triton").compact([plan])
    assert result.kernel == "triton" and result.slots_moved == plan.num_moves
    assert all(same_bits(a, b) for a, b in zip((*k, *v), (*k_ref, *v_ref), strict=True))


@pytest.mark.parametrize(
    ("heads", "head_dim", "dtype"),
    [
        (1, 5, torch.uint8),  # 5-byte rows: one byte a word, no vectors
        (3, 6, torch.bfloat16),  # 36-byte rows: 4-byte words, no vectors
        (2, 72, torch.bfloat16),  # 288-byte rows: vectors, a masked tile column
        (2, 2304, torch.float32),  # 18 KiB rows: three chunks of 8 KiB, the last partial
    ],
)
def test_rows_of_any_size_move_bit_for_bit(heads, head_dim, dtype):
    num_moves = 9
    slots = torch.randperm(2 * num_moves + 3, generator=torch.Generator().manual_seed(head_dim))
    src, dst = slots[:num_moves], slots[num_moves : 2 * num_moves]
    k, v = make_buffers(2 * num_moves + 3, heads=heads, head_dim=head_dim, dtype=dtype)
    assert_same_as_reference(k, v, src, dst)


def test_a_plan_padded_with_self_moves_moves_its_real_rows_exactly():
    # the device plan's launch: self-moves (slot 0 -> 0) pad a fixed-size plan, and the
    # launch skips them; the real moves among them, in two programs, must still land
    k, v = make_buffers(40, head_dim=64)
    src = on_kernel_device(torch.tensor([5, 0, 7, 0, 0, 9] + [0] * 40))
    dst = on_kernel_device(torch.tensor([20, 0, 21, 0, 0, 22] + [0] * 40))
    k_ref, v_ref = [b.clone() for b in k], [b.clone() for b in v]
    repack_kv_reference(k_ref, v_ref, torch.tensor([5, 7, 9]), torch.tensor([20, 21, 22]))
    buffers = [*k, *v]
    _launch(buffers, buffers, src, dst, skip_self=True)
    assert all(same_bits(a, b) for a, b in zip(buffers, (*k_ref, *v_ref), strict=True))
