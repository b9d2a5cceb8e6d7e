"""The batched planner against the numpy planner (the reference), over random batches:
every request's plan keeps all five planner invariants, frees the same number of pages
as the reference, keeps exactly the survivors, and the allocator gets back exactly the
freed pages and the unused staging pages. Applied to KV buffers, the moves keep every
survivor bit for bit, also when interrupted."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_evict.passes.batch import PlanInputs, plan_hole_fill, plan_repack
from sglang_evict.passes.batch.counts import ceil_div
from sglang_evict.passes.planner import check_plan_invariants, plan_compaction
from sglang_evict_kernels import repack_kv_independent, repack_kv_reference
from sglang_evict_kernels.repack import copy_independent_moves

STRATEGIES = ["repack", "hole_fill"]


@st.composite
def request(draw, page_size: int, physical: list[int]):
    """A row of whole pages at the given physical pages, positions (scrambled by an
    earlier hole_fill pass, or not; the frozen prefix holds positions 0, 1, ...), a
    frozen (shared) prefix of whole pages and survivors that keep it."""
    num_pages = len(physical)
    num_tokens = draw(st.integers((num_pages - 1) * page_size + 1, num_pages * page_size))
    row = torch.tensor([p * page_size + o for p in physical for o in range(page_size)][:num_tokens])
    frozen_pages = draw(st.integers(0, num_pages - 1)) if draw(st.booleans()) else 0
    frozen_len = frozen_pages * page_size
    rest = sorted(
        draw(
            st.sets(
                st.integers(frozen_len, 10 * num_tokens),
                min_size=num_tokens - frozen_len,
                max_size=num_tokens - frozen_len,
            )
        )
    )
    if draw(st.booleans()):
        rest = draw(st.permutations(rest))
    positions = torch.tensor([*range(frozen_len), *rest], dtype=torch.int64)
    keep = torch.tensor(draw(st.lists(st.booleans(), min_size=num_tokens, max_size=num_tokens)))
    keep[:frozen_len] = True
    return row, keep, positions, frozen_len


@st.composite
def batches(draw):
    """Requests own disjoint pages of one pool (page 0 is SGLang's padding page)."""
    page_size = draw(st.sampled_from([1, 16, 64]))
    max_pages = 60 if page_size == 1 else 6
    pages = draw(st.lists(st.integers(1, max_pages), min_size=1, max_size=4))
    physical = draw(st.permutations(range(1, sum(pages) + 5)))
    starts = [sum(pages[:i]) for i in range(len(pages))]
    requests = [
        draw(request(page_size, physical[start : start + n]))
        for start, n in zip(starts, pages, strict=True)
    ]
    return page_size, requests, draw(st.sampled_from(STRATEGIES))


def plan_batch(page_size, requests, strategy):
    rows, keeps, positions, frozen = (list(x) for x in zip(*requests, strict=True))
    survivors = [int(k.sum()) for k in keeps]
    staging = [
        ceil_div(k - f, page_size) if strategy == "repack" and page_size > 1 else 0
        for k, f in zip(survivors, frozen, strict=True)
    ]
    inputs = PlanInputs.from_requests(page_size, rows, keeps, positions, frozen, staging)
    if strategy == "hole_fill":
        return plan_hole_fill(inputs), survivors, None
    # Staging pages past every page in use, laid out per request like the evictor's.
    first = max(int(r.max()) for r in rows) // page_size + 1
    width = max(staging)
    pages = torch.zeros(len(rows), width, dtype=torch.int64)
    given_mask = torch.arange(width).unsqueeze(0) < torch.tensor(staging).unsqueeze(1)
    pages[given_mask] = torch.arange(first, first + sum(staging))
    return plan_repack(inputs, pages, given_mask), survivors, pages[given_mask]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.randoms(use_true_random=False))
def test_batched_plans_keep_the_invariants_and_free_what_the_reference_frees(batch, rng):
    page_size, requests, strategy = batch
    plan, survivors, claimed = plan_batch(page_size, requests, strategy)
    host_plans = plan.to_host_plans(survivors)
    released = []
    for (row, keep, positions, frozen_len), host in zip(requests, host_plans, strict=True):
        kept = torch.nonzero(keep)[:, 0]
        immovable = torch.zeros(row.numel(), dtype=torch.bool)
        immovable[:frozen_len] = True
        request = dict(row=row, survivors=kept, page_size=page_size, positions=positions)
        check_plan_invariants(host, immovable=immovable, **request)
        reference = plan_compaction(strategy="hole_fill", immovable=immovable, **request)
        assert host.num_pages_freed == reference.num_pages_freed
        if strategy == "repack":  # survivors in logical order
            assert torch.equal(host.new_positions, torch.sort(positions[kept]).values)
        else:  # the frozen prefix stays in place
            assert torch.equal(host.new_row[:frozen_len], row[:frozen_len])
        released += host.freed_pages.tolist()
    if claimed is not None:
        used = {p for host in host_plans for p in host.claimed_pages.tolist()}
        released += [p for p in claimed.tolist() if p not in used]
    assert sorted(plan.release.tolist()) == sorted(released)

    # On KV buffers: an interrupted pass leaves survivors intact; a complete one moves
    # each survivor's bits to its new slot.
    top = max(
        int(plan.new_row.max()) if plan.new_row.numel() else 0,
        *(int(r.max()) for r, *_ in requests),
    )
    top += page_size + 1
    generator = torch.Generator().manual_seed(rng.randint(0, 1000))
    k = [torch.randn(top, 2, 4, generator=generator) for _ in range(2)]
    v = [torch.randn(top, 2, 4, generator=generator) for _ in range(2)]
    before = [b.clone() for b in k + v]
    src, dst = plan.src.reshape(-1), plan.dst.reshape(-1)
    cut = rng.randint(0, src.numel())
    repack_kv_independent(k, v, src[:cut], dst[:cut])
    for row, keep, *_ in requests:
        for old, new in zip(before, k + v, strict=True):
            assert torch.equal(new[row[keep]], old[row[keep]])
    repack_kv_independent(k, v, src, dst)
    for r, (row, _, positions, _) in enumerate(requests):
        entry = {int(p): i for i, p in enumerate(positions.tolist())}
        old_slots = row[[entry[int(p)] for p in plan.new_positions[r, : survivors[r]]]]
        for old, new in zip(before, k + v, strict=True):
            assert torch.equal(new[plan.new_row[r, : survivors[r]]], old[old_slots])
    # The form for devices without the kernel copies every move, self-moves and
    # padding included, at once: the same buffers, bit for bit.
    every_move = [b.clone() for b in before]
    copy_independent_moves(every_move, src, dst)
    assert all(torch.equal(a, b) for a, b in zip(every_move, k + v, strict=True))


def test_independent_repack_skips_padding_moves_like_the_reference():
    k = [torch.arange(40.0).view(10, 2, 2)]
    v = [-torch.arange(40.0).view(10, 2, 2)]
    expected_k, expected_v = [k[0].clone()], [v[0].clone()]
    src, dst = torch.tensor([0, 3, 5, 0]), torch.tensor([0, 7, 8, 0])  # 0 -> 0: padding
    repack_kv_reference(expected_k, expected_v, torch.tensor([3, 5]), torch.tensor([7, 8]))
    repack_kv_independent(k, v, src, dst)
    assert torch.equal(k[0], expected_k[0]) and torch.equal(v[0], expected_v[0])


def test_the_triton_launch_with_padding_moves_copies_only_the_real_ones():
    """The CUDA path of ``repack_kv_independent`` (Triton's interpreter here), reading
    one set of buffers and writing another so that a skipped move is visible: padding
    self-moves copy nothing, real moves copy every layer's K and V bit for bit."""
    from sglang_evict_kernels.repack import _launch

    generator = torch.Generator().manual_seed(3)
    read = [torch.randn(12, 2, 8, generator=generator) for _ in range(4)]
    write = [torch.zeros(12, 2, 8) for _ in range(4)]
    src, dst = torch.tensor([0, 2, 0, 5, 9]), torch.tensor([0, 6, 0, 7, 9])
    _launch(read, write, src, dst, skip_self=True)
    for got, source in zip(write, read, strict=True):
        expected = torch.zeros(12, 2, 8)
        expected[[6, 7]] = source[[2, 5]]
        assert torch.equal(got, expected)  # slots 0 and 9 (self-moves) untouched
