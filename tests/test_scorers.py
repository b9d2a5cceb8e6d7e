"""Scorers on constructed inputs whose right answer is known."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_evict.passes.selection import protected_mask, select_survivors
from sglang_evict.scorers import SCORERS, KVView, aggregate_head_scores, build_scorer
from sglang_evict.scorers.triattention import TriAttentionScorer
from sglang_evict.scorers.triattention_stats import TriAttentionStats


def make_view(num_tokens=32, layers=2, kv_heads=2, head_dim=8, window=4, q_heads=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(layers, num_tokens, kv_heads, head_dim, generator=g)
    queries = torch.randn(layers, window, q_heads, head_dim, generator=g)
    positions = torch.arange(num_tokens, dtype=torch.int64)
    return KVView(
        keys=keys,
        values=torch.randn_like(keys),
        positions=positions,
        current_position=num_tokens,
        queries=queries,
        query_positions=torch.arange(num_tokens - window, num_tokens, dtype=torch.int64),
    )


def test_registry_lists_every_scorer():
    assert sorted(SCORERS) == ["knorm", "random", "rkv", "streaming", "triattention", "window"]


def test_unknown_scorer_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown scorer 'knrom'; known: \['knorm'"):
        build_scorer("knrom")


def test_unknown_scorer_parameter_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"has no parameter.*'windw'.*allowed"):
        build_scorer("window", {"windw": 3})


@pytest.mark.parametrize("name", ["streaming", "knorm", "window", "rkv", "random"])
def test_scores_are_float32_per_token_and_deterministic(name):
    view = make_view()
    scorer = build_scorer(name)
    first, second = scorer.score(view), scorer.score(view)
    assert first.shape == (32,) and first.dtype == torch.float32
    assert torch.equal(first, second)
    assert torch.isfinite(first).all()


def test_streaming_keeps_exactly_sinks_and_window():
    view = make_view(num_tokens=100)
    scores = build_scorer("streaming").score(view)
    mask = protected_mask(view.positions, sink_tokens=4, protected_tokens=0, window_tokens=20)
    kept = select_survivors(scores, budget=24, protected=mask).indices
    assert kept.tolist() == [0, 1, 2, 3, *range(80, 100)]
    # A larger budget is filled with the most recent tokens.
    kept = select_survivors(scores, budget=34, protected=mask).indices
    assert kept.tolist() == [0, 1, 2, 3, *range(70, 100)]


def test_knorm_keeps_the_smallest_norm_keys():
    view = make_view(num_tokens=40)
    small = [5, 17, 23, 31]
    keys = view.keys.clone()
    keys[:, small] *= 0.01
    view = KVView(keys=keys, positions=view.positions, current_position=40)
    scores = build_scorer("knorm").score(view)
    kept = select_survivors(scores, 4, torch.zeros(40, dtype=torch.bool)).indices
    assert kept.tolist() == small


def test_window_keeps_the_token_the_queries_attend_to():
    view = make_view(num_tokens=40, window=4)
    target = 11
    queries = view.keys[:, target].repeat_interleave(2, dim=1)  # [L, q_heads, D]
    queries = (queries * 20).unsqueeze(1).expand(-1, 4, -1, -1).contiguous()
    view = KVView(
        keys=view.keys,
        positions=view.positions,
        current_position=40,
        queries=queries,
        query_positions=view.query_positions,
    )
    for mode in ("sum", "last"):
        scores = build_scorer("window", {"mode": mode}).score(view)
        assert int(scores.argmax()) == target, mode


def test_window_queries_do_not_see_future_keys():
    view = make_view(num_tokens=10, window=1)
    # The only query sits at position 4: keys 5..9 are invisible and get zero weight.
    view = KVView(
        keys=view.keys,
        positions=view.positions,
        current_position=10,
        queries=view.queries,
        query_positions=torch.tensor([4]),
    )
    weights = build_scorer("window", {"head_normalization": "none"}).score(view)
    assert (weights[5:] == 0).all() and (weights[:5] > 0).all()


def test_window_cumulative_adds_carried_scores_and_needs_raw_scores():
    with pytest.raises(ValueError, match="head_normalization='none'"):
        build_scorer("window", {"mode": "cumulative"})
    view = make_view()
    scorer = build_scorer("window", {"mode": "cumulative", "head_normalization": "none"})
    carried = torch.zeros(32)
    carried[3] = 100.0
    plain = scorer.score(view)
    view = KVView(**{**view.__dict__, "accumulated_scores": carried})
    assert torch.allclose(scorer.score(view), plain + carried)


def test_scorers_that_need_queries_refuse_without_them():
    view = make_view()
    view = KVView(keys=view.keys, positions=view.positions, current_position=32)
    for name in ("window", "rkv"):
        with pytest.raises(ValueError, match="needs captured queries"):
            build_scorer(name).score(view)


def test_rkv_prefers_a_distinct_key_over_duplicates():
    view = make_view(num_tokens=30, window=2)
    keys = view.keys.clone()
    keys[:, 10:20] = keys[:, 10:11]  # ten identical keys: redundant
    view = KVView(
        keys=keys,
        positions=view.positions,
        current_position=30,
        queries=torch.zeros_like(view.queries),
        query_positions=view.query_positions,
    )
    # With uniform attention (zero queries), redundancy decides.
    scores = build_scorer("rkv", {"mix_lambda": 0.0}).score(view)
    assert scores[10:20].max() < torch.cat([scores[:10], scores[20:]]).min()


def test_random_is_seeded_by_seed_and_position():
    view = make_view()
    a = build_scorer("random", {"seed": 1}).score(view)
    b = build_scorer("random", {"seed": 2}).score(view)
    assert not torch.equal(a, b)
    assert torch.equal(a, build_scorer("random", {"seed": 1}).score(view))


def test_head_aggregation_zscore_then_mean_or_max():
    per_head = torch.tensor([[[1.0, 2.0, 3.0], [300.0, 100.0, 200.0]]])  # [1 layer, 2 heads, 3]
    raw_mean = aggregate_head_scores(per_head, "none", "mean")
    assert int(raw_mean.argmax()) == 0  # the large-scale head dominates raw scores
    z = aggregate_head_scores(per_head, "zscore", "mean")
    # Head 0 z-scores to [-a, 0, a], head 1 to [a, -a, 0] with a = sqrt(3/2).
    a = math.sqrt(1.5)
    torch.testing.assert_close(z, torch.tensor([0.0, -a / 2, a / 2]), rtol=1e-4, atol=1e-4)
    assert int(aggregate_head_scores(per_head, "zscore", "max").argmax()) == 0


# --- triattention ---------------------------------------------------------------------


def rope_rotate(x: torch.Tensor, position: float, theta: float, style: str) -> torch.Tensor:
    """Independent RoPE: rotate ``x`` [..., D] as the model does at ``position``."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = position * inv_freq
    cos, sin = angle.cos(), angle.sin()
    x = x.double()
    if style == "half":
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    out = x.clone()
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 1::2] * cos + x[..., 0::2] * sin
    return out


def stats_for(q_centre: torch.Tensor, style: str, theta=10000.0, abs_extra=0.0):
    """Stats whose mean query (per layer, head) is ``q_centre`` [L, H, D]."""
    d = q_centre.shape[-1]
    real = q_centre[..., : d // 2] if style == "half" else q_centre[..., 0::2]
    imag = q_centre[..., d // 2 :] if style == "half" else q_centre[..., 1::2]
    return TriAttentionStats(
        q_mean_real=real.float(),
        q_mean_imag=imag.float(),
        q_abs_mean=torch.hypot(real, imag).float() + abs_extra,
        freq_scale=torch.ones(d // 2),
        rope_style=style,
        rope_theta=theta,
        head_dim=d,
    )


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_triattention_matches_explicit_rotated_query_dot_products(style):
    layers, kv_heads, q_heads, d, n, t = 2, 2, 4, 16, 12, 50
    g = torch.Generator().manual_seed(3)
    centre = torch.randn(layers, q_heads, d, generator=g)
    keys = torch.randn(layers, n, kv_heads, d, generator=g)
    stats = stats_for(centre, style, abs_extra=0.5)
    scorer = TriAttentionScorer(stats=stats, max_offset_log2=10, head_normalization="none")
    view = KVView(keys=keys, positions=torch.arange(n), current_position=t)
    got = scorer.head_scores(view)

    expected = torch.zeros(layers, q_heads, n, dtype=torch.float64)
    offsets = [2**i for i in range(11)]
    for layer in range(layers):
        for h in range(q_heads):
            k = keys[layer, :, h // 2].double()  # GQA: 2 query heads per kv head
            dots = [k @ rope_rotate(centre[layer, h], t + off, 10000.0, style) for off in offsets]
            k_re, k_im = (
                (k[:, : d // 2], k[:, d // 2 :]) if style == "half" else (k[:, 0::2], k[:, 1::2])
            )
            norm_term = 0.5 * torch.hypot(k_re, k_im).sum(dim=-1)
            expected[layer, h] = torch.stack(dots).mean(dim=0) + norm_term
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_triattention_ranks_aligned_key_above_anti_aligned(style):
    d, t, theta = 64, 1000, 10000.0
    centre = torch.zeros(1, 1, d)
    slow = d // 2 - 1  # the slowest RoPE frequency pair
    centre[0, 0, slow if style == "half" else 2 * slow] = 1.0
    centre[0, 0, d - 1 if style == "half" else 2 * slow + 1] = 0.5
    key_position = 990
    aligned = rope_rotate(centre[0, 0], key_position, theta, style).float()
    keys = torch.stack([aligned, -aligned, torch.zeros(d)]).reshape(1, 3, 1, d)
    scorer = TriAttentionScorer(stats=stats_for(centre, style))
    view = KVView(keys=keys, positions=torch.tensor([990, 991, 992]), current_position=t)
    scores = scorer.score(view)
    assert scores[0] > scores[2] > scores[1]


def test_triattention_rejects_a_cache_of_another_shape():
    stats = stats_for(torch.randn(2, 4, 16), "half")
    scorer = TriAttentionScorer(stats=stats)
    view = KVView(keys=torch.randn(3, 5, 2, 16), positions=torch.arange(5), current_position=5)
    with pytest.raises(ValueError, match="2 layers"):
        scorer.score(view)


def test_view_rejects_inconsistent_shapes():
    with pytest.raises(ValueError, match="positions must be"):
        KVView(keys=torch.zeros(1, 4, 1, 8), positions=torch.arange(3), current_position=4)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        KVView(
            keys=torch.zeros(1, 4, 2, 8),
            positions=torch.arange(4),
            current_position=4,
            queries=torch.zeros(1, 2, 3, 8),
            query_positions=torch.arange(2),
        )
