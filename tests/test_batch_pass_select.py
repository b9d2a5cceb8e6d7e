"""Batched selection and the host-known counts, against the reference selection
(``protected_mask`` + ``select_survivors``) on random requests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_evict.passes.batch import pass_counts, protected_ranges_mask, select_keep
from sglang_evict.passes.batch.select import eviction_keys
from sglang_evict.passes.selection import protected_mask, select_survivors


@st.composite
def requests(draw):
    """A request as a pass finds it: its policy, lengths, and the positions it holds
    (all of them before its first pass; after earlier passes, the protected ranges
    plus a random subset of the rest)."""
    page_size = draw(st.sampled_from([1, 16, 64]))
    sinks, protected, window = (draw(st.integers(0, 12)) for _ in range(3))
    budget = sinks + protected + window + draw(st.integers(1, 60))
    prompt_len = draw(st.integers(1, 80))
    evict_prompt = draw(st.booleans())
    next_position = prompt_len + draw(st.integers(0, 200))
    num_shared = min(draw(st.integers(0, prompt_len)), next_position)
    frozen = min(-(-num_shared // page_size) * page_size, next_position)
    lead_end = max(sinks + protected, 0 if evict_prompt else prompt_len, frozen)
    must_hold = set(range(min(lead_end, next_position))) | set(
        range(max(next_position - window, 0), next_position)
    )
    if draw(st.booleans()):  # after earlier passes: some positions are gone
        others = sorted(set(range(next_position)) - must_hold)
        kept = draw(st.lists(st.sampled_from(others), unique=True)) if others else []
        held = sorted(must_hold | set(kept))
    else:
        held = list(range(next_position))
    # Row order: the frozen prefix leads in place, the rest in any order.
    head = [p for p in held if p < frozen]
    rest = draw(st.permutations([p for p in held if p >= frozen]))
    positions = torch.tensor(head + list(rest), dtype=torch.int64)
    # Scores with ties (integers) so the tie rule matters.
    scores = torch.tensor(
        draw(st.lists(st.integers(-3, 3), min_size=len(held), max_size=len(held))),
        dtype=torch.float32,
    )
    return dict(
        page_size=page_size,
        sinks=sinks,
        protected=protected,
        window=window,
        budget=budget,
        prompt_len=prompt_len,
        evict_prompt=evict_prompt,
        num_shared=num_shared,
        frozen=frozen,
        positions=positions,
        scores=scores,
        offset=next_position - len(held),
    )


def reference_keep(req) -> tuple[torch.Tensor, bool]:
    positions = req["positions"]
    pinned = torch.zeros(positions.numel(), dtype=torch.bool)
    pinned[: req["frozen"]] = True
    if not req["evict_prompt"]:
        pinned |= positions < req["prompt_len"]
    order = torch.argsort(positions)  # the reference selects in logical order
    mask = protected_mask(
        positions[order],
        sink_tokens=req["sinks"],
        protected_tokens=req["protected"],
        window_tokens=req["window"],
        pinned=pinned[order],
    )
    chosen = select_survivors(req["scores"][order], req["budget"], mask)
    keep = torch.zeros(positions.numel(), dtype=torch.bool)
    keep[order[chosen.indices]] = True
    return keep, chosen.protected_over_budget


def counts_of(req):
    return pass_counts(
        kv_len=req["positions"].numel(),
        position_offset=req["offset"],
        num_shared=req["num_shared"],
        prompt_len=req["prompt_len"],
        page_size=req["page_size"],
        budget=req["budget"],
        sink_tokens=req["sinks"],
        protected_tokens=req["protected"],
        window_tokens=req["window"],
        evict_prompt=req["evict_prompt"],
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(requests(), min_size=1, max_size=5))
def test_batched_selection_keeps_exactly_the_reference_survivors(batch):
    counts = [counts_of(req) for req in batch]
    width = max(req["positions"].numel() for req in batch)
    rows = len(batch)
    scores = torch.zeros(rows, width)
    positions = torch.zeros(rows, width, dtype=torch.int64)
    valid = torch.zeros(rows, width, dtype=torch.bool)
    for r, req in enumerate(batch):
        n = req["positions"].numel()
        scores[r, :n], positions[r, :n], valid[r, :n] = req["scores"], req["positions"], True
        scores[r, n:] = 100.0  # padding scores must not matter
    protected = protected_ranges_mask(
        positions,
        valid,
        torch.tensor([c.lead_end for c in counts]),
        torch.tensor([c.window_start for c in counts]),
    )
    evicted = [c.tokens_evicted for c in counts]
    keep, nonfinite = select_keep(
        scores, positions, valid, protected, torch.tensor(evicted), max(evicted)
    )
    assert nonfinite.tolist() == [0] * rows
    for r, (req, c) in enumerate(zip(batch, counts, strict=True)):
        n = req["positions"].numel()
        expected, over_budget = reference_keep(req)
        # The host-known counts are the reference's, and so are the survivors.
        assert c.survivors == int(expected.sum())
        assert c.protected_over_budget == over_budget
        assert c.num_protected == int(protected[r].sum())
        assert torch.equal(keep[r, :n], expected)
        assert not keep[r, n:].any()


def test_eviction_keys_order_by_score_then_position_with_signed_zeros_and_infinities():
    scores = torch.tensor([-float("inf"), -2.0, -0.0, 0.0, 0.0, 1.5, float("inf")])
    positions = torch.tensor([9, 9, 8, 7, 3, 0, 0])
    keys = eviction_keys(scores, positions)
    # -0.0 == 0.0: ordered by position only; otherwise by score.
    assert torch.argsort(keys).tolist() == [0, 1, 4, 3, 2, 5, 6]


def test_nan_scores_are_evicted_first_and_counted_instead_of_raising():
    scores = torch.tensor([[1.0, float("nan"), 2.0, 3.0]])
    positions = torch.arange(4).unsqueeze(0)
    valid = torch.ones(1, 4, dtype=torch.bool)
    protected = torch.zeros(1, 4, dtype=torch.bool)
    keep, nonfinite = select_keep(scores, positions, valid, protected, torch.tensor([1]), 1)
    assert keep.tolist() == [[True, False, True, True]] and nonfinite.tolist() == [1]


def test_a_long_protected_prompt_keeps_the_cadence():
    """120 protected prompt tokens, budget 80, window 16, cadence 16: nothing is due
    until a pass would evict a whole cadence of tokens."""
    common = dict(
        position_offset=0,
        num_shared=112,
        prompt_len=120,
        page_size=16,
        budget=80,
        sink_tokens=4,
        protected_tokens=0,
        window_tokens=16,
        evict_prompt=False,
    )
    evicted = [pass_counts(kv_len=n, **common).tokens_evicted for n in range(120, 160)]
    assert evicted[:17] == [0] * 17  # up to 136 tokens: the prompt and the window
    assert evicted[136 - 120 + 16] == 16  # 152 tokens: the first pass is due
    over = pass_counts(kv_len=152, **common)
    assert over.protected_over_budget and over.survivors == 136 and over.pages_freed == 1


def test_cached_index_vectors_are_views_of_one_arange_that_grows():
    from sglang_evict.passes.batch.indices import arange

    first = arange(5, "cpu")
    assert first.tolist() == [0, 1, 2, 3, 4] and first.dtype == torch.int64
    assert arange(3, torch.device("cpu")).data_ptr() == first.data_ptr()  # one storage
    long = arange(100_000, "cpu")  # past the cached length: grown, same values
    assert torch.equal(long, torch.arange(100_000)) and arange(0, "cpu").numel() == 0
    with pytest.raises(ValueError, match="negative length"):
        arange(-1, "cpu")
