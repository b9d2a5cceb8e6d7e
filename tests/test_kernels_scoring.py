"""Scoring kernels against their torch references and the foundation's scorers.

The kernels run on the GPU when there is one, else under Triton's interpreter
(``tests/kernel_device.py``); references and scorers run on CPU tensors.

Tolerances: float32 accumulation in both; 1e-4 relative / 1e-4 absolute covers the
different summation orders (and half-precision keys are read exactly as stored).
"""

from __future__ import annotations

import pytest
import torch

from sglang_evict.scorers import KVView
from sglang_evict.scorers.knorm import KNormScorer
from sglang_evict.scorers.triattention import (
    TriAttentionScorer,
    triattention_key_weights,
    triattention_scores_from_parts,
)
from sglang_evict.scorers.triattention_stats import TriAttentionStats
from sglang_evict_kernels.scoring import (
    key_norms_reference,
    key_norms_triton,
    key_pair_scores_reference,
    key_pair_scores_triton,
)
from tests.kernel_device import on_host, on_kernel_device

TOLERANCE = dict(rtol=1e-4, atol=1e-4)


def pool(num_slots, layers=2, kv_heads=2, head_dim=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dtype) for _ in range(layers)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# 288 and 576: MLA's latent rows (rank 256 + rope 32, DeepSeek V3's 512 + 64), one head
@pytest.mark.parametrize(
    ("num_tokens", "head_dim"), [(1, 64), (3, 128), (17, 64), (63, 128), (9, 288), (5, 576)]
)
def test_key_norms_kernel_matches_reference_and_knorm_scorer(dtype, num_tokens, head_dim):
    k = pool(80, head_dim=head_dim, dtype=dtype)
    slots = torch.randperm(80, generator=torch.Generator().manual_seed(num_tokens))[:num_tokens]
    got = on_host(key_norms_triton(on_kernel_device(k), on_kernel_device(slots)))
    torch.testing.assert_close(got, key_norms_reference(k, slots), **TOLERANCE)
    keys = torch.stack([b[slots] for b in k])  # what the scorer's view holds
    view = KVView(keys=keys, positions=torch.arange(num_tokens), current_position=num_tokens)
    torch.testing.assert_close(-got, KNormScorer().head_scores(view), **TOLERANCE)


def stats(layers, q_heads, head_dim, style, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (layers, q_heads, head_dim // 2)
    real, imag = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    return TriAttentionStats(
        q_mean_real=real,
        q_mean_imag=imag,
        q_abs_mean=torch.hypot(real, imag) + torch.rand(shape, generator=g),
        freq_scale=torch.ones(head_dim // 2),
        rope_style=style,
        rope_theta=10000.0,
        head_dim=head_dim,
    )


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("reduction", ["mean", "max"])
@pytest.mark.parametrize("num_tokens", [1, 17, 63])
def test_triattention_from_the_pool_kernel_matches_the_scorer(style, reduction, num_tokens):
    layers, kv_heads, q_heads, head_dim, position = 2, 2, 4, 64, 500
    k = pool(70, layers, kv_heads, head_dim)
    slots = torch.arange(num_tokens, dtype=torch.int64) * 1 + 3
    st = stats(layers, q_heads, head_dim, style)
    scorer = TriAttentionScorer(stats=st, offset_reduction=reduction, head_normalization="none")
    weights = triattention_key_weights(st, position, scorer.offsets)
    dots, norm_term = on_host(
        key_pair_scores_triton(
            on_kernel_device(k), on_kernel_device(slots), *on_kernel_device(weights), style
        )
    )
    ref_dots, ref_norm = key_pair_scores_reference(k, slots, *weights, style)
    torch.testing.assert_close(dots, ref_dots, **TOLERANCE)
    torch.testing.assert_close(norm_term, ref_norm, **TOLERANCE)
    keys = torch.stack([b[slots] for b in k])
    view = KVView(keys=keys, positions=torch.arange(num_tokens), current_position=position)
    expected = scorer.head_scores(view)
    got = triattention_scores_from_parts(dots, norm_term, reduction)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)


def test_scoring_kernels_refuse_bad_input():
    k = on_kernel_device(pool(8))
    with pytest.raises(ValueError, match="outside"):
        key_norms_triton(k, on_kernel_device(torch.tensor([8])))
    with pytest.raises(ValueError, match="int64"):
        key_norms_triton(k, on_kernel_device(torch.tensor([1], dtype=torch.int32)))
    weights = on_kernel_device(torch.zeros(2, 3, 1, 32))  # 3 query heads for 2 kv heads
    with pytest.raises(ValueError, match="do not fit"):
        key_pair_scores_triton(
            k,
            on_kernel_device(torch.tensor([1])),
            weights,
            weights,
            on_kernel_device(torch.zeros(2, 3, 32)),
            "half",
        )


def test_empty_token_list_gives_empty_scores():
    k = on_kernel_device(pool(8))
    empty = on_kernel_device(torch.zeros(0, dtype=torch.int64))
    assert key_norms_triton(k, empty).shape == (2, 2, 0)


@pytest.mark.parametrize("mode", ["sum", "last"])
@pytest.mark.parametrize("num_tokens", [1, 17, 63])
def test_window_logits_kernel_feeds_the_window_scorer_signal(mode, num_tokens):
    from sglang_evict.scorers.window import WindowScorer, weights_from_logits
    from sglang_evict_kernels.scoring import query_key_logits_reference, query_key_logits_triton

    layers, kv_heads, q_heads, head_dim, window = 2, 2, 4, 64, 5
    k = pool(80, layers, kv_heads, head_dim)
    slots = torch.randperm(80, generator=torch.Generator().manual_seed(3))[:num_tokens]
    queries = torch.randn(
        layers, window, q_heads, head_dim, generator=torch.Generator().manual_seed(4)
    )
    logits = on_host(
        query_key_logits_triton(
            on_kernel_device(k), on_kernel_device(slots), on_kernel_device(queries)
        )
    )
    torch.testing.assert_close(logits, query_key_logits_reference(k, slots, queries), **TOLERANCE)
    positions = torch.arange(num_tokens)
    query_positions = torch.arange(num_tokens - window, num_tokens).clamp(min=0)
    keys = torch.stack([b[slots] for b in k])
    view = KVView(
        keys=keys,
        positions=positions,
        current_position=num_tokens,
        queries=queries,
        query_positions=query_positions,
    )
    expected = WindowScorer(mode=mode).head_scores(view)
    got = weights_from_logits(logits, positions, query_positions, mode, pool_kernel=1)
    torch.testing.assert_close(got, expected, **TOLERANCE)


# --- the fused z-score and head reduction of a batched pass --------------------------


@pytest.mark.parametrize("reduction", ["mean", "max"])
@pytest.mark.parametrize(
    ("layers", "heads", "lengths", "width"),
    [(1, 1, [5], 5), (2, 3, [7, 300, 0], 300), (3, 2, [513, 1, 260], 600)],
)
def test_fused_zscore_reduction_matches_its_reference_and_the_scorers_torch_form(
    reduction, layers, heads, lengths, width
):
    """Rows of different lengths in one padded batch (a request of no tokens, widths
    past one block of tokens): the two launches equal the torch form the plugin runs
    on CPU, on every request's own tokens."""
    from sglang_evict.scorers.base import aggregate_segments
    from sglang_evict_kernels.normalize import zscore_reduce_reference, zscore_reduce_triton

    g = torch.Generator().manual_seed(width + len(lengths))
    per_head = torch.randn(layers, heads, len(lengths), width, generator=g) * 3 + 1
    valid = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    got = on_host(
        zscore_reduce_triton(on_kernel_device(per_head), on_kernel_device(valid), reduction)
    )
    want = zscore_reduce_reference(per_head, valid, reduction)
    torch.testing.assert_close(got[valid], want[valid], **TOLERANCE)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(want, aggregate_segments(per_head, valid, "zscore", reduction))


def test_fused_zscore_reduction_refuses_bad_shapes_and_reductions_clearly():
    from sglang_evict_kernels.normalize import zscore_reduce_triton

    valid = torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="head_reduction 'median'"):
        zscore_reduce_triton(torch.zeros(1, 1, 2, 4), valid, "median")
    with pytest.raises(ValueError, match=r"\[layers, heads, \[2, 4\]\]"):
        zscore_reduce_triton(torch.zeros(1, 1, 3, 4), valid, "mean")
    with pytest.raises(ValueError, match="at least one"):
        zscore_reduce_triton(torch.zeros(0, 1, 2, 4), valid, "mean")
