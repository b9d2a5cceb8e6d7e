"""Per-head score normalisation and reduction of a batched pass, fused: two launches
instead of the ~18 tensor operations of the torch form.

A pass's scorer gives float32 per-head scores ``[layers, heads, R, N]`` (R requests
padded to N tokens). Each (layer, head, request) row is z-normalised over the request's
own tokens (``valid``, a bool ``[R, N]``), then the rows of a request are reduced over
layers and heads (mean or max) to one score per token:

    z = (x - mean) / (std + eps)      mean, std (population) over the valid entries
    out[r, n] = reduce over (layer, head) of z[layer, head, r, n]

``zscore_reduce_reference`` is the torch form (also the CPU path of the plugin);
``zscore_reduce_triton`` computes the statistics in one launch (a program per row,
one sweep, Welford's update per lane) and the normalised reduction in a second (a
program per request and block of tokens). Padding entries come out finite and
meaningless in both.
"""

from __future__ import annotations

import torch
from torch import Tensor

ZSCORE_EPS = 1e-6
REDUCTIONS = ("mean", "max")

# Tokens per program; not tuned (no GPU bench of this kernel has run).
BLOCK_TOKENS = 256

_KERNELS: dict = {}


def zscore_segments_reference(scores: Tensor, valid: Tensor, eps: float = ZSCORE_EPS) -> Tensor:
    """``(x - mean) / (std + eps)`` over the last axis, per request: ``scores`` float
    ``[..., R, N]``, mean and (population) std over each request's ``valid`` entries
    only; padding entries come out as anything finite."""
    mask = valid.to(scores.dtype)
    count = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    mean = (scores * mask).sum(dim=-1, keepdim=True) / count
    std = (((scores - mean) * mask).square().sum(dim=-1, keepdim=True) / count).sqrt()
    return (scores - mean) / (std + eps)


def zscore_reduce_reference(
    per_head: Tensor, valid: Tensor, reduction: str, eps: float = ZSCORE_EPS
) -> Tensor:
    """float32 ``[R, N]`` from per-head ``[layers, heads, R, N]`` (module docstring)."""
    check_per_head(per_head, valid, reduction)
    flat = zscore_segments_reference(per_head.float(), valid, eps).reshape(-1, *valid.shape)
    return flat.mean(dim=0) if reduction == "mean" else flat.max(dim=0).values


def check_per_head(per_head: Tensor, valid: Tensor, reduction: str) -> None:
    """Raise ``ValueError`` unless ``per_head`` is ``[layers, heads, *valid.shape]``
    with at least one (layer, head) and ``reduction`` is one of ``REDUCTIONS``."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown head_reduction {reduction!r}; known: {REDUCTIONS}")
    if (
        per_head.dim() != 4
        or per_head.shape[2:] != valid.shape
        or not per_head.shape[0] * per_head.shape[1]
    ):
        raise ValueError(
            f"per-head scores must be [layers, heads, {list(valid.shape)}] with at least one "
            f"(layer, head), got {tuple(per_head.shape)}"
        )


def _kernels():
    if _KERNELS:
        return _KERNELS["stats"], _KERNELS["reduce"]
    import triton
    import triton.language as tl

    @triton.jit
    def row_stats_kernel(
        scores_ptr, valid_ptr, mean_ptr, denom_ptr, num_requests, num_tokens, eps,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)  # (layer, head, request), request fastest
        base = row.to(tl.int64) * num_tokens
        valid_base = (row % num_requests).to(tl.int64) * num_tokens
        # One sweep, Welford's update per lane (lane i sees columns i, i + BLOCK, ...),
        # then the lanes merged exactly: stable like the reference's two sweeps.
        lane_n = tl.zeros([BLOCK], dtype=tl.float32)
        lane_mean = tl.zeros([BLOCK], dtype=tl.float32)
        lane_m2 = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, num_tokens, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < num_tokens
            keep = tl.load(valid_ptr + valid_base + cols, mask=inside, other=0) != 0
            x = tl.load(scores_ptr + base + cols, mask=inside, other=0.0)
            lane_n += keep.to(tl.float32)
            delta = tl.where(keep, x - lane_mean, 0.0)
            lane_mean += delta / tl.maximum(lane_n, 1.0)
            lane_m2 += delta * tl.where(keep, x - lane_mean, 0.0)
        n = tl.sum(lane_n, axis=0)
        mean = tl.sum(lane_n * lane_mean, axis=0) / tl.maximum(n, 1.0)
        spread = lane_mean - mean
        m2 = tl.sum(lane_m2 + lane_n * spread * spread, axis=0)
        std = tl.sqrt(m2 / tl.maximum(n, 1.0))
        tl.store(mean_ptr + row, mean)
        tl.store(denom_ptr + row, std + eps)

    @triton.jit
    def reduce_kernel(
        scores_ptr, mean_ptr, denom_ptr, out_ptr, num_requests, num_tokens, num_rows,
        MAX: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        request = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < num_tokens
        if MAX:
            acc = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
        for head_row in range(0, num_rows):  # (layer, head) pairs
            row = head_row * num_requests + request
            x = tl.load(scores_ptr + row.to(tl.int64) * num_tokens + cols, mask=inside, other=0.0)
            z = (x - tl.load(mean_ptr + row)) / tl.load(denom_ptr + row)
            if MAX:
                acc = tl.maximum(acc, z)
            else:
                acc += z
        if not MAX:
            acc = acc / num_rows
        tl.store(out_ptr + request.to(tl.int64) * num_tokens + cols, acc, mask=inside)

    _KERNELS["stats"], _KERNELS["reduce"] = row_stats_kernel, reduce_kernel
    return row_stats_kernel, reduce_kernel


def zscore_reduce_triton(
    per_head: Tensor, valid: Tensor, reduction: str, eps: float = ZSCORE_EPS
) -> Tensor:
    """Triton ``zscore_reduce_reference``: two launches, no host read of device data."""
    check_per_head(per_head, valid, reduction)
    layers, heads, num_requests, num_tokens = per_head.shape
    scores = per_head.float().contiguous()
    out = torch.empty(num_requests, num_tokens, dtype=torch.float32, device=scores.device)
    num_rows = layers * heads
    if out.numel() == 0:
        return out
    mean = torch.empty(num_rows * num_requests, dtype=torch.float32, device=scores.device)
    denom = torch.empty_like(mean)
    flags = valid.contiguous().view(torch.uint8)
    stats, reduce = _kernels()
    stats[(num_rows * num_requests,)](
        scores, flags, mean, denom, num_requests, num_tokens, eps, BLOCK=BLOCK_TOKENS
    )
    grid = (num_requests, -(-num_tokens // BLOCK_TOKENS))
    reduce[grid](
        scores, mean, denom, out, num_requests, num_tokens, num_rows,
        MAX=reduction == "max", BLOCK=BLOCK_TOKENS,
    )  # fmt: skip
    return out
