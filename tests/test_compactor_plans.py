"""What the compactor checks about a batch of plans before any byte moves (the list is in
``compactor_service.plan``'s docstring): ranges, the plan's own structure, ownership
across the plans of one pass, shared-prefix pages, and the caller's deadline."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from compactor_service.compactor import InProcessCompactor, PassAbandoned
from compactor_service.plan import CompactionPlan, PlanError
from sglang_evict.passes.planner import plan_compaction

PAGE = 4
SLOTS = 64  # 16 pages
SHARED_PAGE = 1  # a prefix page two requests share


def _cat(values: torch.Tensor, extra: list[int]) -> torch.Tensor:
    return torch.cat([values, torch.tensor(extra, dtype=torch.int64)])


def shared_prefix_plans() -> list[CompactionPlan]:
    """Two requests whose rows start with the shared page 1 (frozen: immovable), then
    their private pages (2, 3, 4 and 6, 7, 8); both evict scattered private tokens and
    repack, with fresh pages 10, 11 and 12, 13 to build in."""
    plans = []
    for private, fresh in (((2, 3, 4), (10, 11)), ((6, 7, 8), (12, 13))):
        pages = [SHARED_PAGE, *private]
        row = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])
        immovable = torch.zeros(row.numel(), dtype=torch.bool)
        immovable[:PAGE] = True
        survivors = torch.tensor([0, 1, 2, 3, 4, 6, 7, 9, 11, 13])
        plans.append(
            plan_compaction(
                row,
                survivors,
                page_size=PAGE,
                immovable=immovable,
                strategy="repack",
                fresh_pages=fresh,
            )
        )
    assert all(p.num_moves for p in plans)
    return plans


def buffers():
    generator = torch.Generator().manual_seed(0)
    k = [torch.randn(SLOTS, 2, 8, generator=generator) for _ in range(2)]
    v = [torch.randn(SLOTS, 2, 8, generator=generator) for _ in range(2)]
    return k, v


def test_plans_sharing_a_frozen_prefix_page_are_accepted_and_move_exactly():
    k, v = buffers()
    plans = shared_prefix_plans()
    expected = [b.clone() for b in k + v]
    for plan in plans:
        for buffer in expected:
            buffer[plan.dst_slots] = buffer[plan.src_slots]
    result = InProcessCompactor(k, v, page_size=PAGE).compact(plans)
    assert result.slots_moved == sum(p.num_moves for p in plans)
    assert all(torch.equal(a, b) for a, b in zip(k + v, expected, strict=True))


def _set(plans, index: int, **fields) -> list[CompactionPlan]:
    plans = list(plans)
    plans[index] = replace(plans[index], **fields)
    return plans


def _intruder(plans) -> list[CompactionPlan]:
    """The batch plus a request whose new row keeps the page plan 0 writes into."""
    page = int(plans[0].dst_slots[0]) // PAGE
    empty = torch.zeros(0, dtype=torch.int64)
    row = torch.arange(page * PAGE, (page + 1) * PAGE)
    return [*plans, CompactionPlan(PAGE, row, torch.arange(100, 104), *(empty,) * 4)]


MALFORMED = {
    "freed page -1": (
        lambda ps: _set(ps, 0, freed_pages=_cat(ps[0].freed_pages, [-1])),
        "freed_pages holds [-1], outside [0, 16)",
    ),
    "freed page 2**63-1": (
        lambda ps: _set(ps, 0, freed_pages=_cat(ps[0].freed_pages, [2**63 - 1])),
        "outside [0, 16)",
    ),
    "claimed page out of range": (
        lambda ps: _set(ps, 0, claimed_pages=_cat(ps[0].claimed_pages, [16])),
        "claimed_pages holds [16], outside [0, 16)",
    ),
    "position -1": (
        lambda ps: _set(ps, 1, new_positions=_cat(ps[1].new_positions[1:], [-1])),
        "new_positions holds [-1]",
    ),
    "position 2**63-1": (
        lambda ps: _set(ps, 1, new_positions=_cat(ps[1].new_positions[1:], [2**63 - 1])),
        "new_positions holds",
    ),
    "position repeated": (
        lambda ps: _set(
            ps, 1, new_positions=_cat(ps[1].new_positions[:-1], [int(ps[1].new_positions[0])])
        ),
        "new_positions repeats",
    ),
    "slot out of range": (
        lambda ps: _set(ps, 0, src_slots=_cat(ps[0].src_slots[1:], [SLOTS])),
        "src_slots holds [64], outside [0, 64)",
    ),
    "source slot shared by two plans": (
        lambda ps: _set(ps, 1, src_slots=_cat(ps[1].src_slots[1:], [int(ps[0].src_slots[0])])),
        "two plans of one batch read the same slot",
    ),
    "source slot kept by another plan's row": (
        lambda ps: _set(ps, 0, src_slots=_cat(ps[0].src_slots[1:], [int(ps[1].new_row[-1])])),
        "read by one plan and kept by another",
    ),
    "page freed by two plans": (
        lambda ps: _set(ps, 1, freed_pages=_cat(ps[1].freed_pages, [int(ps[0].freed_pages[0])])),
        "two plans of one batch free the same slot or page",
    ),
    "page freed while another row uses it": (
        lambda ps: _set(ps, 0, freed_pages=_cat(ps[0].freed_pages, [int(ps[1].new_row[-1]) // 4])),
        "freed while a row uses them",
    ),
    "destination on the shared prefix": (
        lambda ps: _set(ps, 0, dst_slots=_cat(ps[0].dst_slots[1:], [SHARED_PAGE * PAGE + 1])),
        "held by several rows of the batch",
    ),
    "destination on a kept slot of another request": (
        _intruder,
        "held by several rows of the batch",
    ),
    "claimed page shared by two rows": (
        lambda ps: _set(ps, 0, claimed_pages=_cat(ps[0].claimed_pages, [SHARED_PAGE])),
        "held by several rows of the batch",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_batch_is_refused_with_its_reason_and_moves_nothing(case):
    mutate, message = MALFORMED[case]
    k, v = buffers()
    before = [b.clone() for b in k + v]
    with pytest.raises(PlanError) as refused:
        InProcessCompactor(k, v, page_size=PAGE).compact(mutate(shared_prefix_plans()))
    assert message in str(refused.value)
    assert all(torch.equal(a, b) for a, b in zip(k + v, before, strict=True))


def test_validation_stops_between_plans_once_the_caller_gave_up():
    k, v = buffers()
    plans = shared_prefix_plans()  # valid plans; the caller gives up after the first
    asked = []

    def still_wanted() -> bool:
        asked.append(True)
        return len(asked) < 2

    with pytest.raises(PassAbandoned, match="while plan 1 of 2"):
        InProcessCompactor(k, v, page_size=PAGE).compact(plans, still_wanted=still_wanted)
    assert len(asked) == 2  # plan 1 was never validated, the kernel never ran
