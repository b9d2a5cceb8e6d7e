"""``triattention``: pre-RoPE trigonometric geometry scoring (TriAttention, Mao et al.,
arXiv 2604.04921).

No runtime attention score is needed: the importance of a cached key is predicted from
offline per-(layer, head) statistics of the model's pre-RoPE queries (see
``triattention_stats``). Split head vectors into complex pairs, one per RoPE frequency
f with angular speed ω_f = rope_theta^(-2f / head_dim). A query at position p, after
RoPE, is q_f·e^{i p ω_f}; its logit against a cached key k_f (stored after RoPE) is
Σ_f Re(q_f e^{i p ω_f} conj(k_f)). Replacing q_f by the calibrated mean q̄_f:

    A_f = Re(q̄_f · conj(k_f)),   B_f = Im(q̄_f · conj(k_f))
    geo(p) = Σ_f s_f² (A_f cos(p ω_f) − B_f sin(p ω_f))
    score  = AGG_{δ ∈ offsets} geo(t + δ) + Σ_f s_f² (E|q_f| − |q̄_f|)⁺ |k_f|

t is the request's current position, offsets 1, 2, 4, …, 2^max_offset_log2 look at the
future queries the key must serve; AGG is mean (default) or max. The phase depends
only on t, never on the key's own position (keys already carry their rotation), so no
RoPE inversion is needed. The norm term credits keys whose magnitude matters for
queries that deviate from the mean; (·)⁺ clamps round-off negatives. Per-head scores
are z-normalised and averaged by the base class.

Phases are formed in float64 and reduced mod 2π before the float32 cos/sin: at
t + 65536 the raw angle of the fastest frequency exceeds 10^5 rad, where float32
keeps only ~2 decimal digits of the angle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sglang_evict.scorers.base import KVView, Scorer, expand_kv_heads
from sglang_evict.scorers.triattention_stats import TriAttentionStats, load_stats

OFFSET_REDUCTIONS = ("mean", "max")


def split_rope_pairs(x: Tensor, rope_style: str) -> tuple[Tensor, Tensor]:
    """``[..., D]`` -> (real, imag) ``[..., D/2]`` under the model's RoPE pairing."""
    half = x.shape[-1] // 2
    if rope_style == "half":
        return x[..., :half], x[..., half:]
    return x[..., 0::2], x[..., 1::2]


def rope_frequencies(head_dim: int, rope_theta: float) -> Tensor:
    """float64 ω_f for f in [0, head_dim/2)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    return rope_theta ** (-exponents)


def triattention_head_scores(
    keys: Tensor,
    stats: TriAttentionStats,
    current_position: int,
    offsets: Tensor,
    offset_reduction: str,
) -> Tensor:
    """float32 ``[layers, q_heads, tokens]`` geometry scores (before normalisation)."""
    num_layers, _, _, head_dim = keys.shape
    omega = rope_frequencies(head_dim, stats.rope_theta)
    angles = (current_position + offsets.to(torch.float64)).unsqueeze(1) * omega.unsqueeze(0)
    angles = torch.remainder(angles, 2 * math.pi)
    cos, sin = angles.cos().float().to(keys.device), angles.sin().float().to(keys.device)
    weight = (stats.freq_scale.float() ** 2).to(keys.device)  # s_f^2, [F]
    per_layer = []
    for layer in range(num_layers):  # one layer at a time: [tokens, heads, F] live at once
        q_real = stats.q_mean_real[layer].to(keys.device)  # [q_heads, F]
        q_imag = stats.q_mean_imag[layer].to(keys.device)
        k_layer = expand_kv_heads(keys[layer].float(), q_real.shape[0])  # [N, Hq, D]
        k_real, k_imag = split_rope_pairs(k_layer, stats.rope_style)
        a = (q_real * k_real + q_imag * k_imag) * weight  # s_f^2 A_f
        b = (q_imag * k_real - q_real * k_imag) * weight  # s_f^2 B_f
        geo = torch.einsum("nhf,of->hno", a, cos) - torch.einsum("nhf,of->hno", b, sin)
        geo = geo.mean(dim=-1) if offset_reduction == "mean" else geo.max(dim=-1).values
        q_spread = (stats.q_abs_mean[layer].to(keys.device) - torch.hypot(q_real, q_imag)).clamp(
            min=0.0
        )
        norm_term = torch.einsum("nhf,hf->hn", torch.hypot(k_real, k_imag), q_spread * weight)
        per_layer.append(geo + norm_term)
    return torch.stack(per_layer)


@dataclass(frozen=True, kw_only=True)
class TriAttentionScorer(Scorer):
    name = "triattention"
    stats_path: str = ""
    max_offset_log2: int = 16
    offset_reduction: str = "mean"
    stats: TriAttentionStats | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.offset_reduction not in OFFSET_REDUCTIONS:
            raise ValueError(
                f"unknown offset_reduction {self.offset_reduction!r}; "
                f"known: {list(OFFSET_REDUCTIONS)}"
            )
        if not 0 <= self.max_offset_log2 <= 24:
            raise ValueError(
                f"max_offset_log2={self.max_offset_log2} is out of range; allowed: [0, 24]"
            )
        if self.stats is None:
            if not self.stats_path:
                raise ValueError(
                    "scorer 'triattention' needs stats_path (--kv-scorer-stats), the file "
                    "written by `sglang-evict calibrate`"
                )
            object.__setattr__(self, "stats", load_stats(self.stats_path))

    @property
    def offsets(self) -> Tensor:
        return 2 ** torch.arange(self.max_offset_log2 + 1, dtype=torch.int64)

    def pool_head_scores(
        self, k_buffers, slots: Tensor, current_position: int, *, check_slots: bool = True
    ) -> Tensor:
        from sglang_evict_kernels.scoring import key_pair_scores_triton

        stats = self.stats
        assert stats is not None  # set in __post_init__
        weights = triattention_key_weights(stats, current_position, self.offsets)
        dots, norm_term = key_pair_scores_triton(
            k_buffers, slots, *weights, stats.rope_style, check_slots=check_slots
        )
        return triattention_scores_from_parts(dots, norm_term, self.offset_reduction)

    def head_scores(self, view: KVView) -> Tensor:
        stats = self.stats
        assert stats is not None  # set in __post_init__
        num_layers, _, num_kv_heads, head_dim = view.keys.shape
        if stats.num_layers != num_layers or stats.head_dim != head_dim:
            raise ValueError(
                f"triattention stats are for {stats.num_layers} layers x head_dim "
                f"{stats.head_dim}, but the cache has {num_layers} layers x head_dim {head_dim}"
            )
        if stats.num_heads % num_kv_heads:
            raise ValueError(
                f"triattention stats have {stats.num_heads} heads, not a multiple of the "
                f"cache's {num_kv_heads} kv heads"
            )
        return triattention_head_scores(
            view.keys, stats, view.current_position, self.offsets, self.offset_reduction
        )


def triattention_key_weights(
    stats: TriAttentionStats, current_position: int, offsets: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The score as linear weights on the key's RoPE pairs, for the pool-reading kernel
    (``sglang_evict_kernels.scoring.key_pair_scores``):

        geo(t + δ) = Σ_f kr_f·Wr[δ, f] + ki_f·Wi[δ, f]
        with Wr = s_f² (q̄r cos − q̄i sin), Wi = s_f² (q̄i cos + q̄r sin) at angle (t + δ)ω_f
        norm term = Σ_f a_f |k_f|,  a_f = s_f² (E|q_f| − |q̄_f|)⁺

    Returns ``(Wr, Wi)`` ``[layers, q_heads, offsets, head_dim/2]`` and ``a``
    ``[layers, q_heads, head_dim/2]`` (float32).
    """
    omega = rope_frequencies(stats.head_dim, stats.rope_theta)
    angles = (current_position + offsets.to(torch.float64)).unsqueeze(1) * omega.unsqueeze(0)
    angles = torch.remainder(angles, 2 * math.pi)
    cos, sin = angles.cos().float(), angles.sin().float()  # [O, F]
    weight = stats.freq_scale.float() ** 2
    q_real, q_imag = stats.q_mean_real.unsqueeze(2), stats.q_mean_imag.unsqueeze(2)  # [L,H,1,F]
    weight_real = weight * (q_real * cos - q_imag * sin)
    weight_imag = weight * (q_imag * cos + q_real * sin)
    spread = (stats.q_abs_mean - torch.hypot(stats.q_mean_real, stats.q_mean_imag)).clamp(min=0)
    return weight_real, weight_imag, weight * spread


def triattention_scores_from_parts(
    dots: Tensor, norm_term: Tensor, offset_reduction: str
) -> Tensor:
    """``[layers, q_heads, tokens]`` geometry scores from the kernel's outputs."""
    geo = dots.mean(dim=2) if offset_reduction == "mean" else dots.max(dim=2).values
    return geo + norm_term
