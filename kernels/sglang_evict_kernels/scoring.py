"""Scoring kernels: per-(layer, head, token) signals read from the KV pool by slot, one
read of each key, never an attention pass.

``key_norms``          L2 norm of each cached key per KV head (the ``knorm`` signal).
``key_pair_scores``    for each query head h (GQA: KV head h // group) and each of O
                       weight vectors: ``Σ_f kr_f·Wr[o,f] + ki_f·Wi[o,f]``, plus
                       ``Σ_f a_f·|k_f|``, with the key split into RoPE pairs (kr_f, ki_f).
                       The ``triattention`` score is exactly this: with post-RoPE keys
                       the geometry term at offset o is linear in the key (the weights
                       fold the calibrated query centre, the offset's phase and the
                       frequency scaling; see ``sglang_evict.scorers.triattention``).

Each has a torch reference (``*_reference``) that tests compare against. Buffers are
SGLang's per-layer ``[slots, kv_heads, head_dim]`` tensors, read through a pointer table.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from sglang_evict_kernels._device import cached_int64, pointer_table, to_device

# Tokens per program; not tuned yet (benches/bench_scoring.py on the lent GPU has not run).
BLOCK_TOKENS = 32

_KERNELS: dict = {}


def pair_indices(head_dim: int, rope_style: str) -> tuple[Tensor, Tensor]:
    """Dimension indices of the real and imaginary part of each RoPE pair."""
    f = torch.arange(head_dim // 2, dtype=torch.int64)
    if rope_style == "half":
        return f, f + head_dim // 2
    if rope_style == "interleaved":
        return 2 * f, 2 * f + 1
    raise ValueError(f"unknown rope_style {rope_style!r}; known: ['half', 'interleaved']")


def _check(k_buffers: Sequence[Tensor], slots: Tensor, check_slots: bool = True) -> None:
    """Argument checks. ``check_slots=False`` skips the slot range check, the only one
    that reads device data (two synchronising reductions): for slots made on the device
    by the batched pass, whose host never reads them (``sglang_evict.passes.batch``)."""
    if not k_buffers:
        raise ValueError("need at least one layer's key buffer")
    if slots.dim() != 1 or slots.dtype != torch.int64:
        raise ValueError("slots must be a 1-D int64 tensor")
    if (
        check_slots
        and slots.numel()
        and (int(slots.min()) < 0 or int(slots.max()) >= k_buffers[0].shape[0])
    ):
        raise ValueError(f"slots outside [0, {k_buffers[0].shape[0]})")
    for buf in k_buffers:
        if not buf.is_contiguous() or buf.dim() != 3:
            raise ValueError("key buffers must be contiguous [slots, kv_heads, head_dim]")


# --- references -------------------------------------------------------------------------


def key_norms_reference(k_buffers: Sequence[Tensor], slots: Tensor) -> Tensor:
    """float32 ``[layers, kv_heads, tokens]``."""
    _check(k_buffers, slots)
    return torch.stack([b[slots.to(b.device)].float().norm(dim=-1).T for b in k_buffers])


def key_pair_scores_reference(
    k_buffers: Sequence[Tensor],
    slots: Tensor,
    weight_real: Tensor,
    weight_imag: Tensor,
    abs_weight: Tensor,
    rope_style: str,
) -> tuple[Tensor, Tensor]:
    """``(dots [layers, q_heads, O, tokens], pair_norm_term [layers, q_heads, tokens])``
    for weights ``[layers, q_heads, O, head_dim/2]`` and ``abs_weight [layers, q_heads,
    head_dim/2]`` (all float32)."""
    _check(k_buffers, slots)
    real_idx, imag_idx = pair_indices(k_buffers[0].shape[-1], rope_style)
    dots, norm_terms = [], []
    for layer, buf in enumerate(k_buffers):
        keys = buf[slots.to(buf.device)].float()  # [N, Hkv, D]
        group = weight_real.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)  # [N, Hq, D]
        kr, ki = keys[..., real_idx], keys[..., imag_idx]
        dots.append(
            torch.einsum("nhf,hof->hon", kr, weight_real[layer])
            + torch.einsum("nhf,hof->hon", ki, weight_imag[layer])
        )
        norm_terms.append(torch.einsum("nhf,hf->hn", torch.hypot(kr, ki), abs_weight[layer]))
    return torch.stack(dots), torch.stack(norm_terms)


# --- Triton -----------------------------------------------------------------------------


def _table(buffers: Sequence[Tensor]) -> Tensor:
    return pointer_table(buffers)


def _element_type(tl, dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[
        dtype
    ]


def _norms_kernel():
    if "norms" in _KERNELS:
        return _KERNELS["norms"]
    import triton
    import triton.language as tl

    @triton.jit
    def key_norms_kernel(
        table_ptr,
        slots_ptr,
        out_ptr,
        num_tokens,
        num_heads,
        HEAD_DIM: tl.constexpr,
        BLOCK_DIM: tl.constexpr,  # HEAD_DIM rounded up to a power of two
        DTYPE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        block = tl.program_id(0)
        layer = tl.program_id(1)
        base = tl.load(table_ptr + layer).to(tl.pointer_type(DTYPE))
        tokens = block * BLOCK + tl.arange(0, BLOCK)
        live = tokens < num_tokens
        slots = tl.load(slots_ptr + tokens, mask=live, other=0)
        dims = tl.arange(0, BLOCK_DIM)
        inside = live[:, None] & (dims < HEAD_DIM)[None, :]
        for head in range(num_heads):
            rows = (slots * num_heads + head) * HEAD_DIM
            k = tl.load(base + rows[:, None] + dims[None, :], mask=inside, other=0.0)
            k = k.to(tl.float32)
            norms = tl.sqrt(tl.sum(k * k, axis=1))
            out = out_ptr + (layer * num_heads + head) * num_tokens + tokens
            tl.store(out, norms, mask=live)

    _KERNELS["norms"] = key_norms_kernel
    return key_norms_kernel


def key_norms_triton(
    k_buffers: Sequence[Tensor], slots: Tensor, *, check_slots: bool = True
) -> Tensor:
    """Triton ``key_norms_reference``: one launch over all layers (``check_slots``: see
    ``_check``)."""
    import triton
    import triton.language as tl

    _check(k_buffers, slots, check_slots)
    num_layers, (_, num_heads, head_dim) = len(k_buffers), k_buffers[0].shape
    device = k_buffers[0].device
    out = torch.empty(num_layers, num_heads, slots.numel(), dtype=torch.float32, device=device)
    if slots.numel() == 0:
        return out
    grid = (-(-slots.numel() // BLOCK_TOKENS), num_layers)
    _norms_kernel()[grid](
        _table(k_buffers),
        slots.to(device),
        out,
        slots.numel(),
        num_heads,
        HEAD_DIM=head_dim,
        # MLA's latent rows are 288 or 576 wide: the block covers them, masked
        BLOCK_DIM=triton.next_power_of_2(head_dim),
        DTYPE=_element_type(tl, k_buffers[0].dtype),
        BLOCK=BLOCK_TOKENS,
    )
    return out


def _pair_kernel():
    if "pairs" in _KERNELS:
        return _KERNELS["pairs"]
    import triton
    import triton.language as tl

    @triton.jit
    def key_pair_scores_kernel(
        table_ptr,
        slots_ptr,
        real_idx_ptr,
        imag_idx_ptr,
        wr_ptr,
        wi_ptr,
        wa_ptr,
        dots_ptr,
        norm_ptr,
        num_tokens,
        num_q_heads,
        num_kv_heads,
        num_weights,
        HEAD_DIM: tl.constexpr,
        PAIRS: tl.constexpr,
        DTYPE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        block = tl.program_id(0)
        layer = tl.program_id(1)
        base = tl.load(table_ptr + layer).to(tl.pointer_type(DTYPE))
        tokens = block * BLOCK + tl.arange(0, BLOCK)
        live = tokens < num_tokens
        slots = tl.load(slots_ptr + tokens, mask=live, other=0)
        f = tl.arange(0, PAIRS)
        real_idx = tl.load(real_idx_ptr + f)
        imag_idx = tl.load(imag_idx_ptr + f)
        group = num_q_heads // num_kv_heads
        for q_head in range(num_q_heads):
            rows = (slots * num_kv_heads + q_head // group) * HEAD_DIM
            kr = tl.load(base + rows[:, None] + real_idx[None, :], mask=live[:, None], other=0.0)
            ki = tl.load(base + rows[:, None] + imag_idx[None, :], mask=live[:, None], other=0.0)
            kr = kr.to(tl.float32)
            ki = ki.to(tl.float32)
            head_row = layer * num_q_heads + q_head
            wa = tl.load(wa_ptr + head_row * PAIRS + f)
            norm_term = tl.sum(tl.sqrt(kr * kr + ki * ki) * wa[None, :], axis=1)
            tl.store(norm_ptr + head_row * num_tokens + tokens, norm_term, mask=live)
            for o in range(num_weights):
                w_row = (head_row * num_weights + o) * PAIRS
                wr = tl.load(wr_ptr + w_row + f)
                wi = tl.load(wi_ptr + w_row + f)
                dot = tl.sum(kr * wr[None, :] + ki * wi[None, :], axis=1)
                out = dots_ptr + (head_row * num_weights + o) * num_tokens + tokens
                tl.store(out, dot, mask=live)

    _KERNELS["pairs"] = key_pair_scores_kernel
    return key_pair_scores_kernel


def key_pair_scores_triton(
    k_buffers: Sequence[Tensor],
    slots: Tensor,
    weight_real: Tensor,
    weight_imag: Tensor,
    abs_weight: Tensor,
    rope_style: str,
    *,
    check_slots: bool = True,
) -> tuple[Tensor, Tensor]:
    """Triton ``key_pair_scores_reference``: one launch over all layers (``check_slots``:
    see ``_check``)."""
    import triton.language as tl

    _check(k_buffers, slots, check_slots)
    num_layers, (_, num_kv_heads, head_dim) = len(k_buffers), k_buffers[0].shape
    _, num_q_heads, num_weights, pairs = weight_real.shape
    if pairs != head_dim // 2 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"weights {tuple(weight_real.shape)} do not fit keys of head_dim {head_dim} with "
            f"{num_kv_heads} kv heads"
        )
    device = k_buffers[0].device
    dots = torch.empty(
        num_layers, num_q_heads, num_weights, slots.numel(), dtype=torch.float32, device=device
    )
    norm_term = torch.empty(
        num_layers, num_q_heads, slots.numel(), dtype=torch.float32, device=device
    )
    if slots.numel() == 0:
        return dots, norm_term
    real_idx, imag_idx = (
        cached_int64(("pairs", head_dim, rope_style, part), i.tolist(), device)
        for part, i in enumerate(pair_indices(head_dim, rope_style))
    )
    grid = (-(-slots.numel() // BLOCK_TOKENS), num_layers)
    _pair_kernel()[grid](
        _table(k_buffers),
        slots.to(device),
        real_idx,
        imag_idx,
        to_device(weight_real.float().contiguous(), device),
        to_device(weight_imag.float().contiguous(), device),
        to_device(abs_weight.float().contiguous(), device),
        dots,
        norm_term,
        slots.numel(),
        num_q_heads,
        num_kv_heads,
        num_weights,
        HEAD_DIM=head_dim,
        PAIRS=pairs,
        DTYPE=_element_type(tl, k_buffers[0].dtype),
        BLOCK=BLOCK_TOKENS,
    )
    return dots, norm_term


# --- query-key logits (window / SnapKV / TOVA signal) ------------------------------------


def query_key_logits_reference(
    k_buffers: Sequence[Tensor], slots: Tensor, queries: Tensor
) -> Tensor:
    """float32 ``[layers, q_heads, window, tokens]``: ``q·k / sqrt(head_dim)`` of captured
    queries ``[layers, window, q_heads, head_dim]`` against the keys at ``slots``."""
    _check(k_buffers, slots)
    out = []
    for layer, buf in enumerate(k_buffers):
        keys = buf[slots.to(buf.device)].float()
        group = queries.shape[2] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)
        out.append(torch.einsum("whd,nhd->hwn", queries[layer].float(), keys))
    return torch.stack(out) / (k_buffers[0].shape[-1] ** 0.5)


def _logits_kernel():
    if "logits" in _KERNELS:
        return _KERNELS["logits"]
    import triton
    import triton.language as tl

    @triton.jit
    def query_key_logits_kernel(
        table_ptr,
        slots_ptr,
        q_ptr,
        out_ptr,
        num_tokens,
        num_q_heads,
        num_kv_heads,
        window,
        scale,
        HEAD_DIM: tl.constexpr,
        DTYPE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        block = tl.program_id(0)
        layer = tl.program_id(1)
        base = tl.load(table_ptr + layer).to(tl.pointer_type(DTYPE))
        tokens = block * BLOCK + tl.arange(0, BLOCK)
        live = tokens < num_tokens
        slots = tl.load(slots_ptr + tokens, mask=live, other=0)
        dims = tl.arange(0, HEAD_DIM)
        group = num_q_heads // num_kv_heads
        for kv_head in range(num_kv_heads):
            rows = (slots * num_kv_heads + kv_head) * HEAD_DIM
            k = tl.load(base + rows[:, None] + dims[None, :], mask=live[:, None], other=0.0)
            k = k.to(tl.float32)  # read once, used by every query of the group
            for g in range(group):
                q_head = kv_head * group + g
                for w in range(window):
                    q_row = ((layer * window + w) * num_q_heads + q_head) * HEAD_DIM
                    q = tl.load(q_ptr + q_row + dims).to(tl.float32)
                    logits = tl.sum(k * q[None, :], axis=1) * scale
                    out = out_ptr + ((layer * num_q_heads + q_head) * window + w) * num_tokens
                    tl.store(out + tokens, logits, mask=live)

    _KERNELS["logits"] = query_key_logits_kernel
    return query_key_logits_kernel


def query_key_logits_triton(k_buffers: Sequence[Tensor], slots: Tensor, queries: Tensor) -> Tensor:
    """Triton ``query_key_logits_reference``: each key tile is read once for every query
    of its GQA group; the softmax over tokens (cheap, on these logits) stays in torch."""
    import triton.language as tl

    _check(k_buffers, slots)
    num_layers, (_, num_kv_heads, head_dim) = len(k_buffers), k_buffers[0].shape
    if queries.dim() != 4 or queries.shape[0] != num_layers or queries.shape[3] != head_dim:
        raise ValueError(
            f"queries must be [{num_layers}, window, q_heads, {head_dim}], got "
            f"{tuple(queries.shape)}"
        )
    _, window, num_q_heads, _ = queries.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads is not a multiple of {num_kv_heads}")
    device = k_buffers[0].device
    out = torch.empty(
        num_layers, num_q_heads, window, slots.numel(), dtype=torch.float32, device=device
    )
    if slots.numel() == 0:
        return out
    grid = (-(-slots.numel() // BLOCK_TOKENS), num_layers)
    _logits_kernel()[grid](
        _table(k_buffers),
        slots.to(device),
        to_device(queries.float().contiguous(), device),
        out,
        slots.numel(),
        num_q_heads,
        num_kv_heads,
        window,
        head_dim**-0.5,
        HEAD_DIM=head_dim,
        DTYPE=_element_type(tl, k_buffers[0].dtype),
        BLOCK=BLOCK_TOKENS,
    )
    return out
