"""The tier's policy: pure arithmetic on host ints, and the choice of the groups a full
tier gives up. No tensor is moved here; the mechanism applies what these return.

A pass keeps ``survivors`` tokens in full precision (``passes.batch.counts``); the
others, ``cold = kv_len - survivors``, are what eviction alone would drop. With a
tier, they enter the request's tier instead, in whole groups of ``G`` tokens (a group
is quantized together: its key ranges span its tokens). The ``cold % G`` tokens left
over stay in full precision, counted as such, until a later pass fills their group::

    full precision after the pass = survivors + waiting      waiting = cold % G
    tier after the pass           = tier + demoted - dropped  demoted = cold - waiting

The tier holds at most ``max_tier_tokens`` (a whole number of groups); beyond it the
tier gives up whole groups, those of lowest score (``groups_to_drop``): only there does
the scorer evict. A pass demotes at least one group, so a request under a tier is due
once ``cold >= max(cadence, G)`` (``due_cold_tokens``): a cadence below a group would
otherwise run a pass per step that demotes nothing.

What a request holds is counted in bytes (``kv_bytes``) across every layer and KV
head, and, for an allocator that counts token slots, in full-precision token slots
(``tier_slot_equivalent``); ``max_kv_bytes`` is the most a request can hold, the one
bound admission reads; ``tier_token_ratio`` is a tier token's bytes over a full one's
for a model's ``ModelShape`` (the accounting the demo, the benches and the quality
evaluation share).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from sglang_evict_kernels.tier_format import TierFormat


@dataclass(frozen=True)
class TierPolicy:
    """One server's (or request's) tier: the format and the bound per request."""

    fmt: TierFormat
    max_tier_tokens: int  # per request; a whole number of groups

    def __post_init__(self) -> None:
        g = self.fmt.group_tokens
        if self.max_tier_tokens < g or self.max_tier_tokens % g:
            raise ValueError(
                f"--kv-tier-tokens {self.max_tier_tokens}: the tier holds whole groups of "
                f"{g} tokens (--kv-tier-group); give a multiple of {g}, at least {g}"
            )

    @property
    def group_tokens(self) -> int:
        return self.fmt.group_tokens


@dataclass(frozen=True)
class TierCounts:
    """What one pass does to one request's tier (host ints)."""

    cold: int  # tokens eviction alone would drop
    demoted: int  # of them, entering the tier (whole groups)
    waiting: int  # of them, staying in full precision until their group fills
    dropped: int  # tier tokens given up beyond the bound (whole groups)
    tier_before: int
    tier_after: int


def tier_counts(*, kv_len: int, survivors: int, tier_tokens: int, policy: TierPolicy) -> TierCounts:
    """The module docstring's arithmetic for a request holding ``kv_len`` full-precision
    tokens and ``tier_tokens`` in its tier, of which a pass keeps ``survivors``."""
    if not 0 <= survivors <= kv_len:
        raise ValueError(f"survivors {survivors} outside [0, kv_len {kv_len}]")
    g = policy.group_tokens
    if tier_tokens < 0 or tier_tokens % g:
        raise ValueError(f"tier tokens {tier_tokens}: a whole number of groups of {g}")
    cold = kv_len - survivors
    waiting = cold % g
    demoted = cold - waiting
    over = tier_tokens + demoted - policy.max_tier_tokens
    dropped = math.ceil(over / g) * g if over > 0 else 0
    return TierCounts(
        cold=cold,
        demoted=demoted,
        waiting=waiting,
        dropped=dropped,
        tier_before=tier_tokens,
        tier_after=tier_tokens + demoted - dropped,
    )


def due_cold_tokens(cadence_tokens: int, policy: TierPolicy | None) -> int:
    """The cold tokens at which a pass is due: the cadence, and under a tier at least
    one group."""
    return cadence_tokens if policy is None else max(cadence_tokens, policy.group_tokens)


def group_scores(token_scores: Tensor, group_tokens: int) -> Tensor:
    """Each group's score from its tokens' (``[n * G]`` in group order -> ``[n]``): the
    highest. A group holding one token the scorer ranks high (a needle's code among
    filler) is worth keeping whole; a mean would dilute it by the group's other
    tokens. (Chosen on development prompts: docs/quality.md.)"""
    return token_scores.view(-1, group_tokens).amax(dim=1)


def groups_to_drop(group_scores: Tensor, count: int) -> Tensor:
    """int64 indices of the ``count`` groups a full tier gives up: lowest score first
    (higher = keep, as every scorer's), ties to the earlier group (the older one);
    ascending."""
    if not 0 <= count <= group_scores.numel():
        raise ValueError(f"cannot drop {count} of {group_scores.numel()} groups")
    order = torch.argsort(group_scores.float(), stable=True)
    return order[:count].sort().values


def tier_bytes_per_token(
    fmt: TierFormat, layers: int, kv_heads: int, full_dtype: torch.dtype
) -> float:
    """Bytes one tier token costs across every layer and KV head (the first layers
    hold no outlier tokens: ``TierFormat.outliers_for_layer``)."""
    return kv_heads * sum(
        fmt.bytes_per_token_head(full_dtype, outliers=fmt.outliers_for_layer(layer))
        for layer in range(layers)
    )


def full_bytes_per_token(
    fmt: TierFormat, layers: int, kv_heads: int, full_dtype: torch.dtype
) -> int:
    return layers * kv_heads * fmt.full_bytes_per_token_head(full_dtype)


def kv_bytes(
    *,
    full_tokens: int,
    tier_tokens: int,
    fmt: TierFormat,
    layers: int,
    kv_heads: int,
    full_dtype: torch.dtype,
) -> float:
    """Bytes a request holds: its full-precision tokens and its tier."""
    return full_tokens * full_bytes_per_token(
        fmt, layers, kv_heads, full_dtype
    ) + tier_tokens * tier_bytes_per_token(fmt, layers, kv_heads, full_dtype)


def max_kv_bytes(
    *,
    max_full_tokens: int,
    policy: TierPolicy,
    layers: int,
    kv_heads: int,
    full_dtype: torch.dtype,
) -> float:
    """The most a request can hold: ``max_full_tokens`` (what it holds in full precision
    at most without a tier, as admission counts it) plus the ``G - 1`` tokens that may
    wait for their group, and a full tier."""
    return kv_bytes(
        full_tokens=max_full_tokens + policy.group_tokens - 1,
        tier_tokens=policy.max_tier_tokens,
        fmt=policy.fmt,
        layers=layers,
        kv_heads=kv_heads,
        full_dtype=full_dtype,
    )


@dataclass(frozen=True)
class ModelShape:
    """What the byte accounting needs of a model: layers, KV heads, head dim; and its
    widest sliding window (0: none), which a tier's recent window must cover."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    window_tokens: int = 0

    @classmethod
    def of(cls, model) -> ModelShape:
        """The shape of an object with ``num_layers``, ``num_kv_heads``, ``head_dim``
        (and ``windows``, each layer's window, -1 for none, when it has windows)."""
        window = max((w for w in getattr(model, "windows", ()) if w >= 0), default=0)
        return cls(model.num_layers, model.num_kv_heads, model.head_dim, window)

    @classmethod
    def of_config(cls, config: dict) -> ModelShape:
        """The shape a Hugging Face ``config.json`` (as a dict) declares; a multimodal
        config's ``text_config`` when it has one."""
        config = config.get("text_config") or config
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        return cls(config["num_hidden_layers"], config.get("num_key_value_heads", heads), head_dim)

    @classmethod
    def of_folder(cls, model_path) -> ModelShape:
        """The shape a model folder's ``config.json`` declares."""
        import json
        from pathlib import Path

        return cls.of_config(json.loads((Path(model_path) / "config.json").read_text()))


def tier_token_ratio(
    fmt: TierFormat, shape: ModelShape, full_dtype: torch.dtype = torch.bfloat16
) -> float:
    """A tier token's bytes over a full-precision token's, across every layer and KV
    head of ``shape``; full precision in ``full_dtype`` (bfloat16 unless asked: what a
    GPU server holds)."""
    args = (fmt, shape.num_layers, shape.num_kv_heads, full_dtype)
    return tier_bytes_per_token(*args) / full_bytes_per_token(*args)


def tier_slot_equivalent(
    tier_tokens: int, fmt: TierFormat, layers: int, kv_heads: int, full_dtype: torch.dtype
) -> int:
    """The full-precision token slots ``tier_tokens`` tier tokens occupy when the tier
    is stored in the pool's own pages: its bytes over a slot's, rounded up."""
    per_slot = full_bytes_per_token(fmt, layers, kv_heads, full_dtype)
    return math.ceil(
        tier_tokens * tier_bytes_per_token(fmt, layers, kv_heads, full_dtype) / per_slot
    )
