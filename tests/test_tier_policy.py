"""The tier's policy (``sglang_evict.tier.policy``): pure arithmetic of what a pass
demotes, leaves waiting and drops; the groups a full tier gives up; the bytes a request
holds and can hold at most, against the format's formula."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sglang_evict.tier.policy import (
    TierPolicy,
    due_cold_tokens,
    full_bytes_per_token,
    groups_to_drop,
    kv_bytes,
    max_kv_bytes,
    tier_bytes_per_token,
    tier_counts,
    tier_slot_equivalent,
)
from sglang_evict_kernels.tier_format import TierFormat, TierStore

FMT = TierFormat(bits=3, group_tokens=32, head_dim=64, outlier_tokens=3)


@given(
    kv_len=st.integers(0, 4000),
    kept=st.floats(0, 1),
    groups=st.integers(0, 40),
    bound_groups=st.integers(1, 40),
    group=st.sampled_from([8, 32, 128]),
)
def test_a_pass_demotes_whole_groups_keeps_the_rest_waiting_and_never_exceeds_the_bound(
    kv_len, kept, groups, bound_groups, group
):
    policy = TierPolicy(
        TierFormat(bits=3, group_tokens=group, head_dim=64), max_tier_tokens=bound_groups * group
    )
    survivors = int(kv_len * kept)
    tier = min(groups, bound_groups) * group
    c = tier_counts(kv_len=kv_len, survivors=survivors, tier_tokens=tier, policy=policy)
    assert c.cold == kv_len - survivors == c.demoted + c.waiting
    assert c.demoted % group == 0 and 0 <= c.waiting < group
    assert c.dropped % group == 0 and 0 <= c.dropped < c.demoted + group
    assert c.tier_after == tier + c.demoted - c.dropped <= policy.max_tier_tokens
    # Nothing is dropped while the tier has room for everything demoted.
    if tier + c.demoted <= policy.max_tier_tokens:
        assert c.dropped == 0


def test_a_pass_of_less_than_a_group_demotes_nothing_and_a_pass_is_due_only_then():
    policy = TierPolicy(FMT, max_tier_tokens=256)
    c = tier_counts(kv_len=100, survivors=80, tier_tokens=0, policy=policy)
    assert (c.demoted, c.waiting, c.dropped) == (0, 20, 0)
    assert due_cold_tokens(16, policy) == 32 and due_cold_tokens(64, policy) == 64
    assert due_cold_tokens(16, None) == 16


def test_a_full_tier_drops_the_groups_beyond_its_bound():
    policy = TierPolicy(FMT, max_tier_tokens=128)
    c = tier_counts(kv_len=200, survivors=100, tier_tokens=96, policy=policy)
    assert (c.demoted, c.waiting, c.dropped, c.tier_after) == (96, 4, 64, 128)


@pytest.mark.parametrize("bound", [0, 16, 48, 100])
def test_a_bound_that_cannot_hold_whole_groups_is_refused_naming_the_flag(bound):
    with pytest.raises(ValueError, match="--kv-tier-tokens"):
        TierPolicy(FMT, max_tier_tokens=bound)


def test_bad_counts_are_refused():
    policy = TierPolicy(FMT, max_tier_tokens=128)
    with pytest.raises(ValueError, match="survivors"):
        tier_counts(kv_len=10, survivors=11, tier_tokens=0, policy=policy)
    with pytest.raises(ValueError, match="whole number of groups"):
        tier_counts(kv_len=10, survivors=5, tier_tokens=33, policy=policy)


def test_a_full_tier_gives_up_its_lowest_scored_groups_ties_to_the_older():
    scores = torch.tensor([0.5, 0.1, 0.9, 0.1, 0.3])
    assert groups_to_drop(scores, 3).tolist() == [1, 3, 4]
    assert groups_to_drop(scores, 0).tolist() == []
    with pytest.raises(ValueError):
        groups_to_drop(scores, 6)


@pytest.mark.parametrize("full_dtype", [torch.bfloat16, torch.float32])
def test_the_bytes_of_a_request_are_the_stores_bytes(full_dtype):
    """``tier_bytes_per_token`` against real stores: one per layer, the first layers
    without outlier tokens, as the mechanism allocates them."""
    layers, heads, groups = 4, 3, 2
    stores = [
        TierStore.empty(FMT, groups, heads, full_dtype, outliers=FMT.outliers_for_layer(layer))
        for layer in range(layers)
    ]
    measured = sum(s.nbytes() for s in stores) / (groups * FMT.group_tokens)
    assert tier_bytes_per_token(FMT, layers, heads, full_dtype) == pytest.approx(measured)
    full = full_bytes_per_token(FMT, layers, heads, full_dtype)
    assert full == layers * heads * 2 * 64 * torch.empty((), dtype=full_dtype).element_size()
    held = kv_bytes(
        full_tokens=10,
        tier_tokens=64,
        fmt=FMT,
        layers=layers,
        kv_heads=heads,
        full_dtype=full_dtype,
    )
    assert held == pytest.approx(10 * full + 64 * measured)


def test_the_most_a_request_holds_counts_the_waiting_tokens_and_a_full_tier():
    policy = TierPolicy(FMT, max_tier_tokens=1024)
    args = dict(layers=30, kv_heads=3, full_dtype=torch.bfloat16)
    bound = max_kv_bytes(max_full_tokens=200, policy=policy, **args)
    assert bound == pytest.approx(kv_bytes(full_tokens=200 + 31, tier_tokens=1024, fmt=FMT, **args))
    # 3 bits at groups of 32 (bfloat16): 64 bytes of a token-head's 256 are codes and
    # scales; 3 outlier tokens a group add 3 * 258 / 32 from the third layer on.
    per_token_head = (28 * (64 + 3 * 258 / 32) + 2 * 64) / 30
    slots = tier_slot_equivalent(1024, FMT, **args)
    assert slots == -(-1024 * per_token_head // 256)


def test_a_group_scores_as_its_highest_token_so_one_needle_keeps_its_group():
    from sglang_evict.tier.policy import group_scores, groups_to_drop

    # group 0: filler with one high token (a needle); group 1: uniformly middling
    tokens = torch.tensor([0.0, 0.0, 9.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    scores = group_scores(tokens, 4)
    assert scores.tolist() == [9.0, 2.0]
    assert groups_to_drop(scores, 1).tolist() == [1]  # the needle's group stays
