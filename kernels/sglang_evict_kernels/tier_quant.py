"""Quantize-and-pack: whole groups of tokens from a layer's full-precision KV buffers
into the tier's group slots (``tier_format``), in one launch.

``quantize_into(store, group_slots, k_buffer, v_buffer, token_slots, fmt)`` reads the
``G`` tokens of each group where they lie (``token_slots [N, G]`` into the buffers
``[tokens, H, D]``) and writes group ``n`` at ``store``'s slot ``group_slots[n]``.
``quantize_into_reference`` gathers and runs ``quantize_groups_reference``;
``tier_cpu.quantize_into_cpu`` is the compiled CPU kernel (one task per group and KV
head); ``quantize_into_triton`` is one program per (group, KV head): outlier tokens by
iterated ``argmin`` over float64 L1 norms (ties to the earlier token, as the
reference's stable sort), the key ranges over the others, codes with
round-to-nearest divisions (``div_rn``: the reference's IEEE float32 division), packed
eight codes to ``bits`` bytes in registers. The tests hold both kernels to the reference
bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sglang_evict_kernels.tier_cpu import cpu_kernel_in_use, quantize_into_cpu
from sglang_evict_kernels.tier_format import (
    TierFormat,
    TierStore,
    check_quantize_inputs,
    quantize_groups_reference,
)


def quantize_into_reference(
    store: TierStore,
    group_slots: Tensor,
    k_buffer: Tensor,
    v_buffer: Tensor,
    token_slots: Tensor,
    fmt: TierFormat,
) -> None:
    check_quantize_inputs(store, group_slots, k_buffer, v_buffer, token_slots, fmt)
    if group_slots.numel() == 0:
        return
    rows = token_slots.long()
    groups = quantize_groups_reference(k_buffer[rows], v_buffer[rows], fmt, store.outliers)
    store.write(group_slots.long(), groups)


def quantize_into(
    store: TierStore,
    group_slots: Tensor,
    k_buffer: Tensor,
    v_buffer: Tensor,
    token_slots: Tensor,
    fmt: TierFormat,
    use_triton: bool | None = None,
) -> None:
    """The Triton kernel on a GPU (or when asked); on CPU the compiled kernel
    (``tier_cpu``) where it builds, the reference otherwise: the same bytes."""
    run = quantize_function(k_buffer.device.type, use_triton)
    run(store, group_slots, k_buffer, v_buffer, token_slots, fmt)


def quantize_function(device_type: str, use_triton: bool | None = None):
    """What ``quantize_into`` runs for buffers on ``device_type``."""
    if use_triton if use_triton is not None else device_type == "cuda":
        return quantize_into_triton
    if device_type == "cpu" and cpu_kernel_in_use():
        return quantize_into_cpu
    return quantize_into_reference


def _kernel():
    from sglang_evict_kernels import tier_jit

    return tier_jit.quantize_kernel


def quantize_into_triton(
    store: TierStore,
    group_slots: Tensor,
    k_buffer: Tensor,
    v_buffer: Tensor,
    token_slots: Tensor,
    fmt: TierFormat,
) -> None:
    check_quantize_inputs(store, group_slots, k_buffer, v_buffer, token_slots, fmt)
    store.check_contiguous()
    n = group_slots.numel()
    if n == 0:
        return
    heads = k_buffer.shape[1]
    n_out = store.outliers
    _kernel()[(n, heads)](
        k_buffer.contiguous(),
        v_buffer.contiguous(),
        token_slots.to(torch.int64).contiguous(),
        group_slots.to(torch.int64).contiguous(),
        *store.kernel_args(),
        H=heads,
        D=fmt.head_dim,
        G=fmt.group_tokens,
        C=fmt.value_group_channels,
        BITS=fmt.bits,
        N_OUT=n_out,
    )
