"""Compaction planner: the reference oracle's exact figures, then properties over random
requests. Every plan is checked against all five invariants and applied bit-exactly to
KV buffers shaped like SGLang's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compactor_service.plan import CompactionPlan, PlanError
from sglang_evict.passes.planner import (
    NotEnoughFreshPages,
    check_plan_invariants,
    fresh_pages_needed,
    pages_freed_without_compaction,
    plan_compaction,
)
from sglang_evict_kernels import repack_kv_reference

STRATEGIES = ["repack", "hole_fill"]


def plan_and_check(row, survivors, page_size, strategy, positions=None, immovable=None):
    """Plan with exactly the fresh pages needed (ids past every slot in use), check the
    invariants, and return the plan."""
    need = fresh_pages_needed(
        row,
        survivors,
        page_size=page_size,
        strategy=strategy,
        positions=positions,
        immovable=immovable,
    )
    first_free_page = int(row.max()) // page_size + 1 if row.numel() else 1
    fresh = list(range(first_free_page, first_free_page + need))
    plan = plan_compaction(
        row,
        survivors,
        page_size=page_size,
        strategy=strategy,
        positions=positions,
        immovable=immovable,
        fresh_pages=fresh,
    )
    check_plan_invariants(
        plan,
        row=row,
        survivors=survivors,
        page_size=page_size,
        positions=positions,
        immovable=immovable,
    )
    assert plan.claimed_pages.tolist() == fresh
    return plan


def kv_buffers(num_slots, num_layers=2, heads=2, head_dim=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    make = lambda: [  # noqa: E731
        torch.randn(num_slots, heads, head_dim, generator=generator) for _ in range(num_layers)
    ]
    return make(), make()


# --- the oracle cases of the reference (shared/reference/kv-eviction-and-compaction) ----


def test_scattered_eviction_frees_no_page_without_compaction_and_900_with_it():
    row = torch.arange(16_000, dtype=torch.int64) + 16  # pages 1..1000 (page 0 is padding)
    survivors = torch.arange(0, 16_000, 10)  # keep every 10th token: 90% evicted
    assert survivors.numel() == 1_600
    assert pages_freed_without_compaction(16_000, survivors, 16) == 0
    for strategy in STRATEGIES:
        plan = plan_and_check(row, survivors, 16, strategy)
        assert plan.num_pages_freed == 900, strategy
        assert plan.new_row.numel() == 1_600


def test_aligned_whole_page_eviction_frees_one_page_without_compaction():
    alive = torch.ones(16_000, dtype=torch.bool)
    alive[32:48] = False  # page 2 exactly
    assert pages_freed_without_compaction(16_000, torch.nonzero(alive)[:, 0], 16) == 1


def test_one_survivor_per_page_pins_every_page_without_compaction():
    survivors = torch.arange(0, 16_000, 16)  # 93.75% evicted
    assert survivors.numel() == 1_000
    assert pages_freed_without_compaction(16_000, survivors, 16) == 0


def test_toy_6x4_repack_vs_hole_fill():
    """6 pages x 4 slots, evict T2, T9, T13, T21 (the reference's toy).

    hole_fill frees the page with 3 copies and T20 lands in T2's old slot, as in the
    reference. repack frees the same page; 18 survivors change their row index, the
    reference's count. Executing that slide in place would overwrite survivors before
    they are read (invariant 3), so our repack builds the 5 new pages in 5 staging
    pages: 20 copies, net 1 page freed.
    """
    row = torch.arange(24, dtype=torch.int64) + 40  # pages 10..15
    alive = torch.ones(24, dtype=torch.bool)
    alive[[2, 9, 13, 21]] = False
    survivors = torch.nonzero(alive)[:, 0]

    hole_fill = plan_and_check(row, survivors, 4, "hole_fill")
    assert (hole_fill.num_pages_freed, hole_fill.num_moves) == (1, 3)
    assert hole_fill.new_row[2] == row[2] and hole_fill.new_positions[2] == 20
    assert hole_fill.freed_pages.tolist() == [15]
    assert sorted(hole_fill.new_positions.tolist()) == survivors.tolist()
    assert not bool((hole_fill.new_positions.diff() > 0).all())  # order scrambled

    repack = plan_and_check(row, survivors, 4, "repack")
    assert repack.num_pages_freed == 1
    assert repack.new_positions.tolist() == survivors.tolist()  # logical order kept
    relocated = int((repack.new_positions != torch.arange(20)).sum())
    assert relocated == 18
    assert (repack.num_moves, repack.claimed_pages.numel()) == (20, 5)


# --- behaviour ----------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_page_size_one_moves_nothing_and_frees_every_evicted_slot(strategy):
    row = torch.randperm(50, generator=torch.Generator().manual_seed(1)) + 1
    survivors = torch.tensor([0, 3, 4, 10, 49])
    plan = plan_and_check(row, survivors, 1, strategy)
    assert plan.num_moves == 0
    assert sorted(plan.freed_pages.tolist()) == sorted(
        set(row.tolist()) - set(row[survivors].tolist())
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shared_prefix_pages_are_never_moved_or_freed(strategy):
    row = torch.arange(64, dtype=torch.int64) + 16
    immovable = torch.zeros(64, dtype=torch.bool)
    immovable[:32] = True  # two shared 16-token pages
    survivors = torch.cat([torch.arange(32), torch.arange(33, 64, 3)])
    plan = plan_and_check(row, survivors, 16, strategy, immovable=immovable)
    assert torch.equal(plan.new_row[:32], row[:32])
    shared = row[:32]
    assert not torch.isin(plan.src_slots, shared).any()
    assert not torch.isin(plan.dst_slots, shared).any()
    assert not torch.isin(plan.freed_pages, torch.tensor([1, 2])).any()


def test_survivors_dropping_a_shared_entry_are_refused():
    row = torch.arange(32, dtype=torch.int64)
    immovable = torch.zeros(32, dtype=torch.bool)
    immovable[:16] = True
    survivors = torch.arange(1, 32)  # drops shared entry 0
    with pytest.raises(ValueError, match="immovable"):
        plan_compaction(row, survivors, page_size=16, immovable=immovable)


def test_repack_builds_in_dead_pages_before_asking_for_fresh_ones():
    row = torch.arange(24, dtype=torch.int64)
    survivors = torch.tensor([0, 1, 3, 4, 5, 6, 7, 8])  # pages 3..5 hold no survivor
    assert fresh_pages_needed(row, survivors, page_size=4, strategy="repack") == 0
    plan = plan_and_check(row, survivors, 4, "repack")
    assert plan.claimed_pages.numel() == 0 and plan.num_pages_freed == 4


def test_repack_without_enough_fresh_pages_says_how_many():
    row = torch.arange(8, dtype=torch.int64)
    survivors = torch.tensor([0, 1, 3, 4, 5, 6, 7])  # every page holds a survivor
    with pytest.raises(NotEnoughFreshPages, match="needs 2 fresh pages") as error:
        plan_compaction(row, survivors, page_size=4, strategy="repack", fresh_pages=[])
    assert error.value.needed == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(row=torch.tensor([0, 1, 2, 2]), survivors=torch.tensor([0])), "repeats"),
        (dict(row=torch.tensor([1, 0, 2, 3]), survivors=torch.tensor([0]), page_size=2), "page"),
        (dict(row=torch.arange(4), survivors=torch.tensor([2, 1])), "ascending"),
        (dict(row=torch.arange(4), survivors=torch.tensor([4])), "ascending"),
        (dict(row=torch.arange(4), survivors=torch.tensor([0]), strategy="slide"), "known"),
        (dict(row=torch.arange(4), survivors=torch.tensor([0]), page_size=0), "page_size"),
    ],
)
def test_malformed_inputs_are_rejected(kwargs, message):
    kwargs.setdefault("page_size", 1)
    row, survivors = kwargs.pop("row"), kwargs.pop("survivors")
    with pytest.raises(ValueError, match=message):
        plan_compaction(row, survivors, **kwargs)


def test_structure_check_rejects_a_chained_move():
    plan = CompactionPlan(
        page_size=1,
        new_row=torch.tensor([5, 6]),
        new_positions=torch.tensor([0, 1]),
        src_slots=torch.tensor([2, 5]),
        dst_slots=torch.tensor([5, 6]),
        freed_pages=torch.tensor([], dtype=torch.int64),
        claimed_pages=torch.tensor([], dtype=torch.int64),
    )
    with pytest.raises(PlanError, match="both read and written"):
        plan.validate_structure()


# --- properties over random requests --------------------------------------------------


@st.composite
def requests(draw):
    page_size = draw(st.sampled_from([1, 2, 16, 64]))
    num_tokens = draw(st.integers(0, 6 * page_size if page_size > 2 else 40))
    num_pages = -(-num_tokens // page_size)
    pool_pages = num_pages + draw(st.integers(0, 4))
    physical = draw(st.permutations(list(range(1, pool_pages + 1))))[:num_pages]
    row = torch.tensor(
        [p * page_size + o for p in physical for o in range(page_size)][:num_tokens],
        dtype=torch.int64,
    )
    positions = torch.tensor(
        sorted(
            draw(
                st.sets(
                    st.integers(0, 10 * num_tokens + 10), min_size=num_tokens, max_size=num_tokens
                )
            )
        ),
        dtype=torch.int64,
    )
    if draw(st.booleans()):  # a previous hole_fill pass scrambled row order
        positions = positions[
            torch.tensor(draw(st.permutations(range(num_tokens))), dtype=torch.int64)
        ]
    frozen_pages = draw(st.integers(0, num_pages)) if draw(st.booleans()) else 0
    num_frozen = min(frozen_pages * page_size, num_tokens)
    immovable = torch.zeros(num_tokens, dtype=torch.bool)
    immovable[:num_frozen] = True
    alive = draw(st.lists(st.booleans(), min_size=num_tokens, max_size=num_tokens))
    alive = torch.tensor(alive, dtype=torch.bool) | immovable
    survivors = torch.nonzero(alive)[:, 0] if num_tokens else torch.zeros(0, dtype=torch.int64)
    strategy = draw(st.sampled_from(STRATEGIES))
    return row, survivors, page_size, strategy, positions, immovable


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.randoms(use_true_random=False))
def test_every_plan_keeps_all_invariants_and_survivor_kv_bit_for_bit(request, rng):
    row, survivors, page_size, strategy, positions, immovable = request
    plan = plan_and_check(row, survivors, page_size, strategy, positions, immovable)

    top_slot = max(
        [
            int(row.max()) if row.numel() else 0,
            *(((p + 1) * page_size) for p in plan.claimed_pages.tolist()),
        ]
    )
    k_before, v_before = kv_buffers(top_slot + page_size + 1, seed=rng.randint(0, 1000))
    k_after = [b.clone() for b in k_before]
    v_after = [b.clone() for b in v_before]

    # Interrupted at a random point: every survivor's KV is still in its old slot.
    cut = rng.randint(0, plan.num_moves)
    repack_kv_reference(k_after, v_after, plan.src_slots[:cut], plan.dst_slots[:cut])
    survivor_slots = row[survivors]
    for before, after in zip(k_before + v_before, k_after + v_after, strict=True):
        assert torch.equal(after[survivor_slots], before[survivor_slots])

    # Completing the pass from the same plan (a re-run of every move) is idempotent.
    repack_kv_reference(k_after, v_after, plan.src_slots, plan.dst_slots)
    entry_of_position = {int(p): i for i, p in enumerate(positions.tolist())}
    old_slot = torch.tensor(
        [int(row[entry_of_position[int(p)]]) for p in plan.new_positions], dtype=torch.int64
    )
    for before, after in zip(k_before + v_before, k_after + v_after, strict=True):
        assert torch.equal(after[plan.new_row], before[old_slot])
