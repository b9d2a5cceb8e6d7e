"""select_survivors and protected_mask: pure functions on plain tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_evict.passes.selection import protected_mask, select_survivors


def test_protected_tokens_are_kept_and_the_rest_filled_by_score():
    scores = torch.tensor([0.0, 9.0, 1.0, 8.0, 2.0, 7.0])
    protected = torch.tensor([True, False, False, False, False, True])
    result = select_survivors(scores, budget=4, protected=protected)
    assert result.indices.tolist() == [0, 1, 3, 5]
    assert (result.num_protected, result.protected_over_budget) == (2, False)


def test_protected_alone_over_budget_keeps_all_protected_and_reports_it():
    protected = torch.tensor([True, True, True, False])
    result = select_survivors(torch.arange(4.0), budget=2, protected=protected)
    assert result.indices.tolist() == [0, 1, 2]
    assert result.protected_over_budget


def test_ties_go_to_the_later_token():
    result = select_survivors(torch.ones(6), budget=2, protected=torch.zeros(6, dtype=torch.bool))
    assert result.indices.tolist() == [4, 5]


def test_non_finite_candidate_scores_are_refused():
    scores = torch.tensor([1.0, float("nan"), 2.0])
    with pytest.raises(ValueError, match="NaN"):
        select_survivors(scores, budget=2, protected=torch.zeros(3, dtype=torch.bool))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="equal 1-D"):
        select_survivors(torch.zeros(3), 1, torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        select_survivors(torch.zeros(3), 1, torch.zeros(3))
    with pytest.raises(ValueError, match="budget=-1"):
        select_survivors(torch.zeros(3), -1, torch.zeros(3, dtype=torch.bool))


def test_protected_mask_covers_sinks_prefix_window_and_pinned():
    positions = torch.tensor([0, 1, 2, 3, 10, 11, 12, 30, 31])  # after an earlier pass
    pinned = torch.zeros(9, dtype=torch.bool)
    pinned[4] = True  # e.g. a shared prefix token
    mask = protected_mask(
        positions, sink_tokens=2, protected_tokens=1, window_tokens=2, pinned=pinned
    )
    assert mask.tolist() == [True, True, True, False, True, False, False, True, True]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_selection_properties(data):
    n = data.draw(st.integers(0, 60))
    scores = torch.tensor(
        data.draw(st.lists(st.floats(-5, 5, width=32), min_size=n, max_size=n)), dtype=torch.float32
    )
    protected = torch.tensor(
        data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=torch.bool
    )
    budget = data.draw(st.integers(0, n + 3))
    result = select_survivors(scores, budget, protected)
    kept = result.indices
    assert torch.equal(kept, torch.unique(kept))  # ascending, no repeats
    assert set(torch.nonzero(protected)[:, 0].tolist()) <= set(kept.tolist())
    assert kept.numel() == max(int(protected.sum()), min(budget, n))
    # Every evicted candidate scores no higher than every kept candidate.
    chosen = torch.zeros(n, dtype=torch.bool)
    chosen[kept] = True
    kept_free, evicted = scores[chosen & ~protected], scores[~chosen]
    if kept_free.numel() and evicted.numel():
        assert evicted.max() <= kept_free.min()
    # Same inputs, same survivors (tensor-parallel ranks agree).
    assert torch.equal(select_survivors(scores, budget, protected).indices, kept)
