"""Decode attention over the quantized tier, as a partial attention with its
log-sum-exp, and the merge of two partial attentions.

A request's decode query attends to its full-precision tokens (SGLang's pages) and to
its tier (groups of ``TierStore``). Each side is a partial attention over its own keys:

    lse = log sum_j exp(s_j),   o = sum_j exp(s_j - lse) v_j,   s_j = sm_scale * q . k_j

(natural log; an empty side has ``lse = -inf`` and ``o = 0``), and the two merge
exactly into the softmax over all tokens (the online-softmax merge):

    m = max(lse_a, lse_b);  w_a = exp(lse_a - m);  w_b = exp(lse_b - m)
    o = (w_a o_a + w_b o_b) / (w_a + w_b);  lse = m + log(w_a + w_b)

``tier_attention_reference`` dequantizes (``tier_format.dequantize_groups_reference``)
and computes the softmax in float32; ``tier_attention_triton`` reads the packed bytes,
one program per (request, KV head, split of the request's groups): every query head of
the KV head at once, groups streamed with an online softmax, the splits merged by a
second launch (one split: no second launch). It has two bodies (``KERNELS``):
``grouped``, measured on an H200 (the default), and ``words``, the same program with
whole-code words, the key scale folded into the query, ``tl.dot`` products and the
outlier tokens as a tile of their own, written after that measurement and not yet run
on a GPU (``benches/bench_tier.py`` times both side by side).
Queries ``[B, Hq, D]`` share KV heads in groups of ``Hq / H`` (GQA); a request's groups
are the slots ``group_table[b, :num_groups[b]]``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sglang_evict_kernels.tier_format import TierFormat, TierStore, dequantize_groups_reference


def check_attention_inputs(
    q: Tensor, store: TierStore, group_table: Tensor, num_groups: Tensor, fmt: TierFormat
) -> None:
    if q.dim() != 3 or q.shape[-1] != fmt.head_dim:
        raise ValueError(
            f"queries must be [requests, q heads, {fmt.head_dim}]; got {tuple(q.shape)}"
        )
    kv_heads = store.k_codes.shape[2]
    if q.shape[1] % kv_heads:
        raise ValueError(f"{q.shape[1]} query heads do not share {kv_heads} KV heads evenly")
    if group_table.dim() != 2 or group_table.shape[0] != q.shape[0]:
        raise ValueError(
            f"group_table must be [requests, max groups] for {q.shape[0]} requests; "
            f"got {tuple(group_table.shape)}"
        )
    if num_groups.shape != (q.shape[0],):
        raise ValueError(f"num_groups must be [{q.shape[0]}]; got {tuple(num_groups.shape)}")


def tier_attention_reference(
    q: Tensor,
    store: TierStore,
    group_table: Tensor,
    num_groups: Tensor,
    fmt: TierFormat,
    sm_scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """float32 ``(o [B, Hq, D], lse [B, Hq])`` over each request's tier groups."""
    check_attention_inputs(q, store, group_table, num_groups, fmt)
    sm_scale = 1.0 / math.sqrt(fmt.head_dim) if sm_scale is None else sm_scale
    b, hq, d = q.shape
    kv_heads = store.k_codes.shape[2]
    per_kv = hq // kv_heads
    o = torch.zeros(b, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq), float("-inf"), dtype=torch.float32, device=q.device)
    for r in range(b):
        count = int(num_groups[r])
        if count == 0:
            continue
        slots = group_table[r, :count].long()
        k, v = dequantize_groups_reference(store.take(slots), fmt)  # [n, G, H, D]
        k = k.reshape(-1, kv_heads, d).repeat_interleave(per_kv, dim=1)  # [T, Hq, D]
        v = v.reshape(-1, kv_heads, d).repeat_interleave(per_kv, dim=1)
        scores = torch.einsum("hd,thd->ht", q[r].float(), k) * sm_scale  # [Hq, T]
        lse[r] = torch.logsumexp(scores, dim=-1)
        o[r] = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), v)
    return o, lse


def tier_attention_torch(
    q: Tensor,
    store: TierStore,
    group_table: Tensor,
    num_groups: Tensor,
    fmt: TierFormat,
    sm_scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """``tier_attention_reference``'s result for the whole batch at once, in tensor
    operations of static shape (no host read, no loop over requests): the form SGLang's
    decode step runs where no Triton kernel does (the CPU engine). Every slot of the
    table is dequantized; groups past a request's count are masked out."""
    check_attention_inputs(q, store, group_table, num_groups, fmt)
    sm_scale = 1.0 / math.sqrt(fmt.head_dim) if sm_scale is None else sm_scale
    b, hq, d = q.shape
    width = group_table.shape[1]
    kv_heads = store.k_codes.shape[2]
    g = fmt.group_tokens
    k, v = dequantize_groups_reference(store.take(group_table.reshape(-1).long()), fmt)
    k = k.reshape(b, width * g, kv_heads, d).permute(0, 2, 3, 1)  # [B, H, D, T]
    v = v.reshape(b, width * g, kv_heads, d).transpose(1, 2)  # [B, H, T, D]
    live = torch.arange(width, device=q.device)[None, :] < num_groups.to(q.device)[:, None]
    live = live.repeat_interleave(g, dim=1)  # [B, T]
    # GQA without copying keys per query head: [B, H, Hq / H, D] @ [B, H, D, T]
    scores = torch.matmul(q.float().reshape(b, kv_heads, hq // kv_heads, d), k) * sm_scale
    scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where a request has no group
    finite = torch.isfinite(lse)
    p = torch.exp(scores - torch.where(finite, lse, torch.zeros_like(lse))[..., None])
    o = torch.matmul(p, v).reshape(b, hq, d)
    lse = lse.reshape(b, hq)
    return torch.where(lse.isfinite()[..., None], o, torch.zeros_like(o)), lse


def attention_with_lse_reference(
    q: Tensor, k: Tensor, v: Tensor, sm_scale: float
) -> tuple[Tensor, Tensor]:
    """float32 ``(o [Hq, D], lse [Hq])`` of one query ``[Hq, D]`` over full-precision
    ``k``/``v`` ``[T, H, D]`` (GQA): the other side of a merge, in tests and the CPU
    path."""
    hq, d = q.shape
    if k.shape[0] == 0:
        return torch.zeros(hq, d, device=q.device), torch.full(
            (hq,), float("-inf"), device=q.device
        )
    per_kv = hq // k.shape[1]
    k = k.float().repeat_interleave(per_kv, dim=1)
    v = v.float().repeat_interleave(per_kv, dim=1)
    scores = torch.einsum("hd,thd->ht", q.float(), k) * sm_scale
    return torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), v), torch.logsumexp(
        scores, dim=-1
    )


def merge_attention_states(
    o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor
) -> tuple[Tensor, Tensor]:
    """The softmax over both sides' tokens from two partial attentions (module
    docstring); ``o`` ``[..., D]``, ``lse`` ``[...]``; a side with ``lse = -inf`` adds
    nothing, two empty sides give ``o = 0``, ``lse = -inf``."""
    m = torch.maximum(lse_a, lse_b)
    finite = torch.isfinite(m)
    m_safe = torch.where(finite, m, torch.zeros_like(m))
    w_a = torch.exp(lse_a - m_safe)
    w_b = torch.exp(lse_b - m_safe)
    total = w_a + w_b
    denom = torch.where(finite, total, torch.ones_like(total))
    o = (o_a.float() * w_a.unsqueeze(-1) + o_b.float() * w_b.unsqueeze(-1)) / denom.unsqueeze(-1)
    lse = torch.where(finite, m_safe + torch.log(denom), m)
    return o, lse


def full_precision_lse_reference(
    q: Tensor,
    k_buffer: Tensor,
    req_to_token: Tensor,
    rows: Tensor,
    lens: Tensor,
    sm_scale: float,
    width: int | None = None,
) -> Tensor:
    """float32 ``[B, Hq]``: the log-sum-exp of each query's scaled scores over its
    request's full-precision keys where they lie in the pool, ``k_buffer [tokens, H,
    D]`` at ``req_to_token[rows[b], :lens[b]]`` (``width``: at least ``lens.max()``,
    given where reading it would cost a device read)."""
    if width is None:
        width = int(lens.max()) if lens.numel() else 0
    slots = req_to_token[rows, :width]
    keys = k_buffer[slots.long()]  # [B, L, H, D]
    b, hq, d = q.shape
    h = k_buffer.shape[1]
    grouped = q.float().reshape(b, h, hq // h, d)  # GQA: no copy of keys per q head
    scores = torch.matmul(grouped, keys.float().permute(0, 2, 3, 1)) * sm_scale
    live = torch.arange(width, device=lens.device)[None, :] < lens[:, None]
    scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
    return torch.logsumexp(scores, dim=-1).reshape(b, hq)


def decode_merge_reference(
    q: Tensor,
    o_full: Tensor,
    k_buffer: Tensor,
    req_to_token: Tensor,
    rows: Tensor,
    lens: Tensor,
    store: TierStore,
    group_table: Tensor,
    num_groups: Tensor,
    fmt: TierFormat,
    sm_scale: float | None = None,
) -> Tensor:
    """A decode layer's output with the tier: ``o_full`` (``[B, Hq * D]``, the
    attention over each request's full-precision keys, ``full_precision_lse_
    reference``'s) merged with ``tier_attention_reference``'s, in ``o_full``'s dtype
    and shape; a request without a tier keeps ``o_full`` exactly."""
    sm_scale = 1.0 / math.sqrt(fmt.head_dim) if sm_scale is None else sm_scale
    b, hq, d = q.shape
    o_tier, lse_tier = tier_attention_reference(q, store, group_table, num_groups, fmt, sm_scale)
    lse_full = full_precision_lse_reference(q, k_buffer, req_to_token, rows, lens, sm_scale)
    merged, _ = merge_attention_states(o_full.reshape(b, hq, d).float(), lse_full, o_tier, lse_tier)
    return merged.to(o_full.dtype).reshape(o_full.shape)


# Warps per program: 2 read the packed bytes fastest of 2, 4 and 8 on an H200
# (benches/results/bench_tier_h200.txt, 2026-11-27; all far below the copy's rate).
NUM_WARPS = 2
# The attention kernel's bodies (tier_jit):
#   grouped  codes unpacked through [G, D / 32 * bits, 32 / bits] word tiles and
#            reshapes, products as three-dimensional broadcasts; 0.08-0.13 of a copy's
#            rate on an H200 (in the byte layout before whole-code words)
#   words    a row's words loaded once and decoded two codes at a time (channels in
#            pair order), the keys' scale and zero folded into the query, both
#            products tl.dot over the query heads padded to 16 (needs groups of 16
#            tokens or more, value groups of a word's channels), outlier tokens a tile
#            of their own; 0.59 / 0.58 / 0.43 / 0.26 warp-instructions per byte at
#            2 / 3 / 4 / 8 bits on the Llama-8B layer shape, 2 warps, 1 stage
#            (scripts/tier_kernel_sass.py; not yet run on a GPU)
KERNELS = ("grouped", "words")
# The words body's products: "fp16" (half-precision inputs, float32 sums: about 1e-3 of
# the output's scale, FlashAttention's own precision), or tl.dot's float32 input
# precisions, "tf32x3" (float32's accuracy, the reference's to 1e-5), "tf32", "ieee".
WORDS_PRECISIONS = ("fp16", "tf32x3", "tf32", "ieee")
WORDS_DEFAULT_PRECISION = "fp16"
# What each precision holds the reference to (absolute and relative, output and lse),
# tested under the interpreter (tests/test_kernels_tier.py); half-precision products
# came within 3.3e-3 there (2-8 bits at head dims 64 and 128, 3 bits at 256; the most
# at 8 bits, head dim 64).
WORDS_TOLERANCE = {"fp16": 5e-3, "tf32x3": 1e-5, "tf32": 5e-3, "ieee": 1e-5}
WORDS_MIN_GROUP_TOKENS = 16
# Software-pipelining stages of each body's group loop (Triton's num_stages; None: its
# default, 3, what the H200 ran `grouped` with). Compiled as a launch compiles it
# (16-byte aligned tensors), `words` with 3 stages stages its loads through shared
# memory with asynchronous copies, is held to 168 registers and spills 8-16 bytes at 2
# warps; with 1 it spills nothing (scripts/tier_kernel_sass.py, a static count for
# sm_90; a GPU decides whether the prefetch was worth more: bench_tier's "words st3").
NUM_STAGES = {"grouped": None, "words": 1}
# Rows of a group's outlier tile in the words body: tl.dot's least dimension.
WORDS_MIN_OUTLIER_ROWS = 16


def _splits_for(programs: int, max_groups: int, device: torch.device) -> int:
    """Splits of each request's groups so that (requests x KV heads x splits) programs
    about fill the GPU twice over; one on CPU (the interpreter runs programs in turn)."""
    if device.type != "cuda" or max_groups <= 1:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(max_groups, 16, -(-2 * sms // max(programs, 1))))


def tier_attention_triton(
    q: Tensor,
    store: TierStore,
    group_table: Tensor,
    num_groups: Tensor,
    fmt: TierFormat,
    sm_scale: float | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    kernel: str = "grouped",
    precision: str | None = None,
    stats: dict | None = None,
    num_stages: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``tier_attention_reference``'s result from the packed bytes: one program per
    (request, KV head, split) reads each group once for all the KV head's query heads;
    with more than one split a second launch merges the splits. ``splits`` defaults to
    ``_splits_for``'s choice; ``num_warps`` to ``NUM_WARPS``, ``num_stages`` to the
    body's ``NUM_STAGES``; ``kernel`` is one of
    ``KERNELS`` (``precision``: the words body's products, ``WORDS_PRECISIONS``). A ``stats``
    dict receives the compiled attention kernel's registers per thread, spilled
    registers and shared memory where Triton reports them (a GPU; not the
    interpreter)."""
    check_attention_inputs(q, store, group_table, num_groups, fmt)
    store.check_contiguous()
    if kernel not in KERNELS:
        raise ValueError(f"tier attention kernel {kernel!r}: one of {KERNELS}")
    if kernel == "words":
        precision = WORDS_DEFAULT_PRECISION if precision is None else precision
        if precision not in WORDS_PRECISIONS:
            raise ValueError(f"words kernel precision {precision!r}: one of {WORDS_PRECISIONS}")
        if fmt.group_tokens < WORDS_MIN_GROUP_TOKENS:
            raise ValueError(
                f"the words tier attention kernel needs groups of at least "
                f"{WORDS_MIN_GROUP_TOKENS} tokens (tl.dot); this tier's are "
                f"{fmt.group_tokens}: use kernel='grouped'"
            )
        span = 16 if fmt.bits == 3 else 32 // fmt.bits
        if fmt.value_group_channels % span:
            raise ValueError(
                f"the words tier attention kernel decodes {span} channels a word at "
                f"{fmt.bits} bits and needs value groups of a multiple of them; this "
                f"tier's are {fmt.value_group_channels} channels: use kernel='grouped'"
            )
    elif precision is not None:
        raise ValueError(f"the {kernel} tier attention kernel takes no precision")
    sm_scale = 1.0 / math.sqrt(fmt.head_dim) if sm_scale is None else sm_scale
    b, hq, d = q.shape
    h = store.k_codes.shape[2]
    o = torch.empty(b, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hq, dtype=torch.float32, device=q.device)
    if b == 0:
        return o, lse
    table = group_table.to(torch.int32).contiguous()
    s = splits if splits is not None else _splits_for(b * h, table.shape[1], q.device)
    if s < 1:
        raise ValueError(f"splits must be at least 1; got {s}")
    o_part = o if s == 1 else torch.empty(b, hq, s, d, dtype=torch.float32, device=q.device)
    lse_part = lse if s == 1 else torch.empty(b, hq, s, dtype=torch.float32, device=q.device)
    from sglang_evict_kernels import tier_jit

    stages = NUM_STAGES[kernel] if num_stages is None else num_stages
    if stages is not None and stages < 1:
        raise ValueError(f"num_stages must be at least 1; got {stages}")
    if kernel == "grouped":
        body, extra = tier_jit.attention_kernel, {}
    else:
        np_rows = max(WORDS_MIN_OUTLIER_ROWS, triton_pow2(store.outliers))
        body, extra = tier_jit.attention_words_kernel, {"PRECISION": precision, "NP": np_rows}
    compiled = body[(b, h, s)](
        q.contiguous(),
        table,
        num_groups.to(torch.int32).contiguous(),
        *store.kernel_args(),
        o_part,
        lse_part,
        float(sm_scale),
        table.shape[1],
        HQ=hq,
        H=h,
        D=d,
        G=fmt.group_tokens,
        C=fmt.value_group_channels,
        BITS=fmt.bits,
        N_OUT=store.outliers,
        QB=triton_pow2(hq // h) if kernel == "grouped" else max(16, triton_pow2(hq // h)),
        S=s,
        num_warps=NUM_WARPS if num_warps is None else num_warps,
        **extra,
        **({} if stages is None else {"num_stages": stages}),
    )
    if stats is not None:
        stats.update(kernel_resources(compiled))
    if s > 1:
        tier_jit.merge_splits_kernel[(b * hq,)](
            o_part, lse_part, o, lse, S=s, SB=triton_pow2(s), D=d
        )
    return o, lse


def kernel_resources(compiled) -> dict:
    """Registers per thread, spilled registers and shared memory bytes of a compiled
    Triton launch, those it reports (none under the interpreter)."""
    found = {}
    for name, value in (
        ("registers", getattr(compiled, "n_regs", None)),
        ("spills", getattr(compiled, "n_spills", None)),
        ("shared_bytes", getattr(getattr(compiled, "metadata", None), "shared", None)),
    ):
        if isinstance(value, int):
            found[name] = value
    return found


def triton_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (Triton's block shapes)."""
    return 1 << max(0, (n - 1).bit_length())
