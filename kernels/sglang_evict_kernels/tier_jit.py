"""The tier's device code (``@triton.jit``): the quantize-and-pack kernel
(``tier_quant``'s launcher), the decode attention kernel and the merge of its splits
(``tier_attention``'s).
Imported only when a launcher first runs: importing it imports Triton."""

import triton
import triton.language as tl


@triton.jit
def to_scale_dtype(x, dtype: tl.constexpr):
    """float32 to the scale dtype, rounding to nearest even as torch does (Triton's
    interpreter truncates to bfloat16: the rounding is done on the bits first)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def quantize_kernel(
    k_buf,
    v_buf,
    token_slots,  # [N, G] int64
    group_slots,  # [N] int64
    k_codes,
    k_scale,
    k_zero,
    v_codes,
    v_scale,
    v_zero,
    out_index,
    out_k,
    out_v,
    H: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    C: tl.constexpr,
    BITS: tl.constexpr,
    N_OUT: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    LEVELS: tl.constexpr = (1 << BITS) - 1
    P: tl.constexpr = D * BITS // 8
    g = tl.arange(0, G)
    d = tl.arange(0, D)
    rows = tl.load(token_slots + n * G + g)  # [G] token slots in the buffers
    offs = (rows[:, None] * H + h) * D + d[None, :]
    k = tl.load(k_buf + offs).to(tl.float32)  # [G, D]
    v = tl.load(v_buf + offs).to(tl.float32)
    slot = tl.load(group_slots + n)

    # Outlier tokens: the N_OUT smallest key L1 norms, ties to the earlier token.
    is_out = g < 0
    if N_OUT > 0:
        norms = tl.sum(tl.abs(k.to(tl.float64)), axis=1)  # [G]
        for _ in tl.static_range(N_OUT):
            pick = tl.argmin(norms, axis=0, tie_break_left=True)
            is_out = is_out | (g == pick)
            norms = tl.where(g == pick, float("inf"), norms)
        rank = tl.cumsum(is_out.to(tl.int32), axis=0) - 1  # ascending token order
        o_base = (slot * H + h) * N_OUT
        tl.store(out_index + o_base + rank, g.to(tl.int16), mask=is_out)
        o_offs = (o_base + rank)[:, None] * D + d[None, :]
        tl.store(out_k + o_offs, tl.load(k_buf + offs), mask=is_out[:, None])
        tl.store(out_v + o_offs, tl.load(v_buf + offs), mask=is_out[:, None])

    # Keys: per channel over the group's other tokens.
    lo = tl.min(tl.where(is_out[:, None], float("inf"), k), axis=0)  # [D]
    hi = tl.max(tl.where(is_out[:, None], float("-inf"), k), axis=0)
    s = to_scale_dtype(tl.div_rn(hi - lo, LEVELS * 1.0), k_scale.dtype.element_ty)
    z = to_scale_dtype(lo, k_zero.dtype.element_ty)
    tl.store(k_scale + (slot * H + h) * D + d, s)
    tl.store(k_zero + (slot * H + h) * D + d, z)
    s32 = s.to(tl.float32)
    z32 = z.to(tl.float32)
    safe = tl.where(s32 > 0, s32, 1.0)
    kc = tl.floor(tl.div_rn(k - z32[None, :], safe[None, :]) + 0.5)
    kc = tl.minimum(tl.maximum(kc, 0.0), LEVELS * 1.0)
    kc = tl.where(s32[None, :] > 0, kc, 0.0).to(tl.int32)

    # Values: per token over blocks of C channels.
    vb = tl.reshape(v, (G, D // C, C))
    vlo = tl.min(vb, axis=2)  # [G, D // C]
    vhi = tl.max(vb, axis=2)
    vs = to_scale_dtype(tl.div_rn(vhi - vlo, LEVELS * 1.0), v_scale.dtype.element_ty)
    vz = to_scale_dtype(vlo, v_zero.dtype.element_ty)
    blocks = tl.arange(0, D // C)
    vs_offs = ((slot * G + g[:, None]) * H + h) * (D // C) + blocks[None, :]
    tl.store(v_scale + vs_offs, vs)
    tl.store(v_zero + vs_offs, vz)
    vs32 = vs.to(tl.float32)
    vz32 = vz.to(tl.float32)
    vsafe = tl.where(vs32 > 0, vs32, 1.0)
    vc = tl.floor(tl.div_rn(vb - vz32[:, :, None], vsafe[:, :, None]) + 0.5)
    vc = tl.minimum(tl.maximum(vc, 0.0), LEVELS * 1.0)
    vc = tl.where(vs32[:, :, None] > 0, vc, 0.0).to(tl.int32)
    vc = tl.reshape(vc, (G, D))

    # Pack eight codes into BITS bytes (little-endian), both tensors.
    code_base = ((slot * G + g) * H + h) * P  # [G]
    if BITS == 8:
        tl.store(k_codes + code_base[:, None] + d[None, :], kc.to(tl.uint8))
        tl.store(v_codes + code_base[:, None] + d[None, :], vc.to(tl.uint8))
    else:
        shifts = tl.arange(0, 8) * BITS
        kw = tl.sum(tl.reshape(kc, (G, D // 8, 8)) << shifts[None, None, :], axis=2)
        vw = tl.sum(tl.reshape(vc, (G, D // 8, 8)) << shifts[None, None, :], axis=2)
        j = tl.arange(0, 4)  # bytes of a chunk (BITS <= 4 of them)
        chunk = tl.arange(0, D // 8)
        b_offs = code_base[:, None, None] + chunk[None, :, None] * BITS + j[None, None, :]
        keep = (j < BITS)[None, None, :] & (g >= 0)[:, None, None]
        tl.store(
            k_codes + b_offs,
            ((kw[:, :, None] >> (j * 8)[None, None, :]) & 255).to(tl.uint8),
            mask=keep,
        )
        tl.store(
            v_codes + b_offs,
            ((vw[:, :, None] >> (j * 8)[None, None, :]) & 255).to(tl.uint8),
            mask=keep,
        )


@triton.jit
def load_queries(q, b, heads, q_ok, d, HQ: tl.constexpr, D: tl.constexpr):
    """float32 ``[QB, D]``: request ``b``'s query heads ``heads`` (rows past ``q_ok``: 0)."""
    return tl.load(
        q + (b * HQ + heads)[:, None] * D + d[None, :], mask=q_ok[:, None], other=0.0
    ).to(tl.float32)


@triton.jit
def split_range(num_groups, b, s, S: tl.constexpr):
    """``[start, stop)``: split ``s`` of ``S``'s share of request ``b``'s groups."""
    count = tl.load(num_groups + b)
    per = tl.cdiv(count, S)
    start = s * per
    return start, tl.minimum(start + per, count)


@triton.jit
def with_outlier_rows(
    k,
    v,
    g,
    d,
    slot,
    h,
    out_index,
    out_k,
    out_v,
    H: tl.constexpr,
    D: tl.constexpr,
    N_OUT: tl.constexpr,
):
    """A group's dequantized ``[G, D]`` keys and values with its outlier tokens' rows
    (full precision) in their place."""
    for j in tl.static_range(N_OUT):
        o_row = (slot * H + h) * N_OUT + j
        at = tl.load(out_index + o_row).to(tl.int32)
        here = (g == at)[:, None]
        k = tl.where(here, tl.load(out_k + o_row * D + d).to(tl.float32)[None, :], k)
        v = tl.where(here, tl.load(out_v + o_row * D + d).to(tl.float32)[None, :], v)
    return k, v


@triton.jit
def store_split(
    o,
    lse,
    acc,
    total,
    m,
    start,
    stop,
    b,
    s,
    heads,
    q_ok,
    d,
    HQ: tl.constexpr,
    S: tl.constexpr,
    D: tl.constexpr,
):
    """A split's partial attention and its log-sum-exp (an empty split: 0 and -inf)."""
    empty = stop <= start
    safe = tl.where(empty, 1.0, total)
    out = (b * HQ + heads) * S + s
    tl.store(
        o + out[:, None] * D + d[None, :],
        tl.where(empty, 0.0, acc / safe[:, None]),
        mask=q_ok[:, None],
    )
    tl.store(lse + out, tl.where(empty, float("-inf"), m + tl.log(safe)), mask=q_ok)


@triton.jit
def attention_kernel(
    q,  # [B, Hq, D]
    group_table,  # [B, W] int32
    num_groups,  # [B] int32
    k_codes,
    k_scale,
    k_zero,
    v_codes,
    v_scale,
    v_zero,
    out_index,
    out_k,
    out_v,
    o,  # [B, Hq, S, D] float32: each split's partial attention
    lse,  # [B, Hq, S] float32
    sm_scale,
    W,
    HQ: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    C: tl.constexpr,
    BITS: tl.constexpr,
    N_OUT: tl.constexpr,
    QB: tl.constexpr,  # query heads per KV head, padded to a power of two
    S: tl.constexpr,  # splits of a request's groups
):
    """One program per (request, KV head, split): every query head of the KV head over
    the split's share of the request's groups, each group's packed bytes read and
    dequantized once (not once per query head)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    QPK: tl.constexpr = HQ // H
    P: tl.constexpr = D * BITS // 8
    g = tl.arange(0, G)
    d = tl.arange(0, D)
    qh = tl.arange(0, QB)
    q_ok = qh < QPK
    heads = h * QPK + qh
    query = load_queries(q, b, heads, q_ok, d, HQ, D)  # [QB, D]
    m = tl.full([QB], float("-inf"), tl.float32)
    total = tl.zeros([QB], dtype=tl.float32)
    acc = tl.zeros([QB, D], dtype=tl.float32)
    start, stop = split_range(num_groups, b, s, S)
    for i in range(start, stop):
        slot = tl.load(group_table + b * W + i).to(tl.int64)
        rows = ((slot * G + g) * H + h) * P
        ks = tl.load(k_scale + (slot * H + h) * D + d).to(tl.float32)
        kz = tl.load(k_zero + (slot * H + h) * D + d).to(tl.float32)
        if BITS == 8:
            kc = tl.load(k_codes + rows[:, None] + d[None, :]).to(tl.int32)
            vc = tl.load(v_codes + rows[:, None] + d[None, :]).to(tl.int32)
        else:
            byte = tl.arange(0, 4)
            chunk = tl.arange(0, D // 8)
            offs = rows[:, None, None] + chunk[None, :, None] * BITS + byte[None, None, :]
            keep = (byte < BITS)[None, None, :] & (rows >= 0)[:, None, None]
            lift = (byte * 8)[None, None, :]
            shifts = (tl.arange(0, 8) * BITS)[None, None, :]
            kw = tl.sum(tl.load(k_codes + offs, mask=keep, other=0).to(tl.int32) << lift, axis=2)
            vw = tl.sum(tl.load(v_codes + offs, mask=keep, other=0).to(tl.int32) << lift, axis=2)
            kc = tl.reshape((kw[:, :, None] >> shifts) & ((1 << BITS) - 1), (G, D))
            vc = tl.reshape((vw[:, :, None] >> shifts) & ((1 << BITS) - 1), (G, D))
        k = kc.to(tl.float32) * ks[None, :] + kz[None, :]
        blocks = ((slot * G + g[:, None]) * H + h) * (D // C) + tl.arange(0, D // C)[None, :]
        vs = tl.load(v_scale + blocks).to(tl.float32)
        vz = tl.load(v_zero + blocks).to(tl.float32)
        vcodes = tl.reshape(vc.to(tl.float32), (G, D // C, C))
        v = tl.reshape(vcodes * vs[:, :, None] + vz[:, :, None], (G, D))
        k, v = with_outlier_rows(k, v, g, d, slot, h, out_index, out_k, out_v, H, D, N_OUT)
        scores = tl.sum(query[:, None, :] * k[None, :, :], axis=2) * sm_scale  # [QB, G]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    store_split(o, lse, acc, total, m, start, stop, b, s, heads, q_ok, d, HQ, S, D)


@triton.jit
def merge_splits_kernel(
    o_part,  # [B * Hq, S, D] float32
    lse_part,  # [B * Hq, S]
    o,  # [B * Hq, D]
    lse,  # [B * Hq]
    S: tl.constexpr,
    SB: tl.constexpr,  # S padded to a power of two
    D: tl.constexpr,
):
    """The splits' partial attentions of one (request, query head) merged into one
    (the online-softmax merge; empty splits carry lse = -inf)."""
    r = tl.program_id(0)
    s = tl.arange(0, SB)
    d = tl.arange(0, D)
    ls = tl.load(lse_part + r * S + s, mask=s < S, other=float("-inf"))
    m = tl.max(ls, axis=0)
    empty = m == float("-inf")
    m_safe = tl.where(empty, 0.0, m)
    w = tl.exp(ls - m_safe)
    parts = tl.load(
        o_part + (r * S + s)[:, None] * D + d[None, :], mask=(s < S)[:, None], other=0.0
    )
    total = tl.sum(w, axis=0)
    safe = tl.where(empty, 1.0, total)
    tl.store(o + r * D + d, tl.where(empty, 0.0, tl.sum(w[:, None] * parts, axis=0) / safe))
    tl.store(lse + r, tl.where(empty, float("-inf"), m_safe + tl.log(safe)))


@triton.jit
def attention_lean_kernel(
    q,  # [B, Hq, D]
    group_table,  # [B, W] int32
    num_groups,  # [B] int32
    k_codes,
    k_scale,
    k_zero,
    v_codes,
    v_scale,
    v_zero,
    out_index,
    out_k,
    out_v,
    o,  # [B, Hq, S, D] float32: each split's partial attention
    lse,  # [B, Hq, S] float32
    sm_scale,
    W,
    HQ: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    C: tl.constexpr,
    BITS: tl.constexpr,
    N_OUT: tl.constexpr,
    QB: tl.constexpr,  # query heads per KV head, padded to a power of two >= 16 (tl.dot)
    S: tl.constexpr,  # splits of a request's groups
    PRECISION: tl.constexpr,  # tl.dot's input_precision: "ieee", "tf32x3" or "tf32"
):
    """``attention_kernel``'s result with every tile two-dimensional ([G, D]): a
    channel's code is read straight from its byte(s) of the row (a row is one
    little-endian bit stream, code ``c`` at bit ``c * BITS``), a value's scale by its
    (token, block) index, and both products are ``tl.dot`` (tensor cores; the query
    heads padded to ``QB``). No reshape, no three-dimensional broadcast."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    QPK: tl.constexpr = HQ // H
    P: tl.constexpr = D * BITS // 8
    LEVELS: tl.constexpr = (1 << BITS) - 1
    g = tl.arange(0, G)
    d = tl.arange(0, D)
    qh = tl.arange(0, QB)
    q_ok = qh < QPK
    heads = h * QPK + qh
    query = load_queries(q, b, heads, q_ok, d, HQ, D) * sm_scale  # [QB, D]
    # Offsets within a group, the same for every group (int32, computed once): a
    # channel's code starts in byte (c * BITS) // 8 of its token's row.
    shift = (d * BITS) % 8
    code_at = (g * (H * P))[:, None] + ((d * BITS) // 8)[None, :]  # [G, D]
    spills = ((shift + BITS) > 8)[None, :] & (g >= 0)[:, None]  # into the next byte
    block_at = (g * (H * (D // C)))[:, None] + (d // C)[None, :]  # [G, D]
    m = tl.full([QB], float("-inf"), tl.float32)
    total = tl.zeros([QB], dtype=tl.float32)
    acc = tl.zeros([QB, D], dtype=tl.float32)
    start, stop = split_range(num_groups, b, s, S)
    for i in range(start, stop):
        slot = tl.load(group_table + b * W + i).to(tl.int64)
        k_at = k_codes + (slot * G * H + h) * P + code_at
        v_at = v_codes + (slot * G * H + h) * P + code_at
        kc = tl.load(k_at).to(tl.int32)
        vc = tl.load(v_at).to(tl.int32)
        if 8 % BITS != 0:  # 3 bits: some codes straddle two bytes
            kc = kc | (tl.load(k_at + 1, mask=spills, other=0).to(tl.int32) << 8)
            vc = vc | (tl.load(v_at + 1, mask=spills, other=0).to(tl.int32) << 8)
        kc = (kc >> shift[None, :]) & LEVELS
        vc = (vc >> shift[None, :]) & LEVELS
        ks = tl.load(k_scale + (slot * H + h) * D + d).to(tl.float32)
        kz = tl.load(k_zero + (slot * H + h) * D + d).to(tl.float32)
        k = kc.to(tl.float32) * ks[None, :] + kz[None, :]  # [G, D]
        v_base = (slot * G * H + h) * (D // C)
        vs = tl.load(v_scale + v_base + block_at).to(tl.float32)
        vz = tl.load(v_zero + v_base + block_at).to(tl.float32)
        v = vc.to(tl.float32) * vs + vz  # [G, D]
        k, v = with_outlier_rows(k, v, g, d, slot, h, out_index, out_k, out_v, H, D, N_OUT)
        scores = tl.dot(query, tl.trans(k), input_precision=PRECISION)  # [QB, G]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new
    store_split(o, lse, acc, total, m, start, stop, b, s, heads, q_ok, d, HQ, S, D)
