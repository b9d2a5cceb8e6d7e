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
def store_stream(codes, base, c, G: tl.constexpr, D: tl.constexpr, B: tl.constexpr):
    """Codes ``c`` ``[G, D]`` (int32, below ``2**B``) as one little-endian bit stream of
    ``B`` bits a code from byte offsets ``base`` ``[G]``: eight codes a chunk of ``B``
    bytes (tier_format's layout)."""
    if B == 8:
        tl.store(codes + base[:, None] + tl.arange(0, D)[None, :], c.to(tl.uint8))
    else:
        shifts = tl.arange(0, 8) * B
        w = tl.sum(tl.reshape(c, (G, D // 8, 8)) << shifts[None, None, :], axis=2)
        j = tl.arange(0, 4)  # bytes of a chunk (B <= 4 of them)
        chunk = tl.arange(0, D // 8)
        offs = base[:, None, None] + chunk[None, :, None] * B + j[None, None, :]
        keep = (j < B)[None, None, :] & (base >= 0)[:, None, None]
        tl.store(
            codes + offs, ((w[:, :, None] >> (j * 8)[None, None, :]) & 255).to(tl.uint8), mask=keep
        )


@triton.jit
def store_row_codes(codes, base, c, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """A row of codes per token at byte offsets ``base``: one stream, or at 3 bits the
    low two bits' plane and then the high bit's (tier_format's layout)."""
    if BITS == 3:
        store_stream(codes, base, c & 3, G, D, 2)
        store_stream(codes, base + D // 4, c >> 2, G, D, 1)
    else:
        store_stream(codes, base, c, G, D, BITS)


@triton.jit
def shifted_codes(words, row_words, G: tl.constexpr, D: tl.constexpr, B: tl.constexpr):
    """int32 ``[G, D]``: each code of a ``B``-bit stream shifted down to bit 0 of its
    word, the word's later codes left above it (masked by the caller)."""
    CPW: tl.constexpr = 32 // B
    w = tl.load(words + row_words[:, None] + tl.arange(0, D // CPW)[None, :])  # [G, D / CPW]
    return tl.reshape(w[:, :, None] >> (tl.arange(0, CPW) * B)[None, None, :], (G, D))


@triton.jit
def pair_channels(d, BITS: tl.constexpr):
    """The channel each position of ``load_row_halves``'s tile holds: within a word of
    ``CPW`` codes, positions ``2k`` and ``2k + 1`` hold codes ``k`` and ``k + CPW / 2``
    (the low and high half of one 32-bit pair); ``CPW``: 32 / bits, at 3 bits the 2-bit
    plane's 16."""
    CPW: tl.constexpr = 16 if BITS == 3 else 32 // BITS
    return (d // CPW) * CPW + (d % 2) * (CPW // 2) + (d % CPW) // 2


@triton.jit
def pair_order(x, R: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """``x`` ``[R, D]`` in natural channel order, rearranged into ``pair_channels``
    order (within each word's ``CPW`` channels: halves interleaved)."""
    CPW: tl.constexpr = 16 if BITS == 3 else 32 // BITS
    x = tl.reshape(x, (R, D // CPW, 2, CPW // 2))
    return tl.reshape(tl.permute(x, (0, 1, 3, 2)), (R, D))


@triton.jit
def load_row_halves(words, row_words, magic, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """float16 codes ``[G, D]`` (exact: below 256) of rows starting at the 32-bit words
    ``row_words``, with channels in ``pair_channels`` order, decoded two at a time by the
    mantissa trick int4 kernels use: a word shifted by ``k`` codes and masked with
    ``mask | mask << 16`` holds codes ``k`` and ``k + CPW / 2`` in its two halves; ORed
    with ``0x64006400`` the halves are 1024 + code as half-precision values, and one
    paired subtraction leaves the codes. At 3 bits the high bits of a 2-bit word's 16
    codes (16 bits of the 1-bit plane's word) are first spread to the halves' bit 2,
    once a word, so that a pair takes two shifts and two logical operations."""
    CPW: tl.constexpr = 16 if BITS == 3 else 32 // BITS
    HALF: tl.constexpr = CPW // 2
    NW: tl.constexpr = D // CPW
    j = tl.arange(0, NW)
    k = tl.arange(0, HALF)
    if BITS == 3:
        low = tl.load(words + row_words[:, None] + j[None, :])  # [G, NW]: 16 codes a word
        high = tl.load(words + row_words[:, None] + D // 16 + (j // 2)[None, :])
        high = (high >> ((j % 2) * 16)[None, :]) & 0xFFFF  # this word's 16 high bits
        spread = ((high & 0xFF) << 2) | ((high & 0xFF00) << 10)  # bits k + 2, k + 18
        top = ((spread[:, :, None] >> k[None, None, :]) & 0x00040004) | magic
        x = ((low[:, :, None] >> (2 * k)[None, None, :]) & 0x00030003) | top
    else:
        w = tl.load(words + row_words[:, None] + j[None, :])  # [G, NW]
        x = (w[:, :, None] >> (BITS * k)[None, None, :]) & (((1 << BITS) - 1) * 0x10001)
        x = x | magic
    lo = x.to(tl.int16).to(tl.float16, bitcast=True)
    hi = (x >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (G, D)) - 1024.0


@triton.jit
def load_stream(words, row_words, G: tl.constexpr, D: tl.constexpr, B: tl.constexpr):
    """int32 codes ``[G, D]`` of a ``B``-bit stream whose rows start at the 32-bit words
    ``row_words`` ``[G]``: each word loaded once and holding ``32 / B`` whole codes."""
    return shifted_codes(words, row_words, G, D, B) & ((1 << B) - 1)


@triton.jit
def load_row_codes(words, row_words, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """int32 codes ``[G, D]`` of rows starting at the 32-bit words ``row_words``: one
    stream, or at 3 bits ``low | high << 2`` from the two planes."""
    if BITS == 3:
        low = load_stream(words, row_words, G, D, 2)
        return low | (load_stream(words, row_words + D // 16, G, D, 1) << 2)
    else:
        return load_stream(words, row_words, G, D, BITS)


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

    # Pack the rows (tier_format's layout), both tensors.
    code_base = ((slot * G + g) * H + h) * P  # [G]
    store_row_codes(k_codes, code_base, kc, G, D, BITS)
    store_row_codes(v_codes, code_base, vc, G, D, BITS)


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
        rows = ((slot * G + g) * H + h) * (P // 4)  # rows' first 32-bit words
        ks = tl.load(k_scale + (slot * H + h) * D + d).to(tl.float32)
        kz = tl.load(k_zero + (slot * H + h) * D + d).to(tl.float32)
        kc = load_row_codes(k_codes.to(tl.pointer_type(tl.int32)), rows, G, D, BITS)
        vc = load_row_codes(v_codes.to(tl.pointer_type(tl.int32)), rows, G, D, BITS)
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
def attention_words_kernel(
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
    PRECISION: tl.constexpr,  # the products: "fp16" (tensor cores' half) or tl.dot's "tf32"
    NP: tl.constexpr,  # outlier rows a group, padded to a power of two >= 16 (tl.dot)
):
    """``attention_kernel``'s result in fewer instructions a code: a row's 32-bit words
    each loaded once (whole codes in each: tier_format's layout) and decoded two codes
    an operation (``load_row_halves``: the tiles' channels in ``pair_channels`` order,
    so the query, the keys' scales and the output are read and written in that order,
    and the outliers' values rearranged into it), the keys' per-channel scale and zero
    folded into the query once a group,

        q . (code * scale + zero) = (q * scale) . code + q . zero,

    so key codes go to the product as they are; both products ``tl.dot`` (tensor cores,
    the query heads padded to ``QB``); a group's outlier tokens a tile of their own
    (``NP`` rows of full-precision keys and values, their own two products), their code
    slots' scores set to -inf, instead of a select over every element."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    QPK: tl.constexpr = HQ // H
    P: tl.constexpr = D * BITS // 8
    NB: tl.constexpr = D // C
    g = tl.arange(0, G)
    # the channel at each position of a decoded tile (load_row_halves): every per-channel
    # operand is read in that order, and the output written back through it
    natural = tl.arange(0, D)
    d = pair_channels(natural, BITS)
    qh = tl.arange(0, QB)
    q_ok = qh < QPK
    heads = h * QPK + qh
    query = load_queries(q, b, heads, q_ok, d, HQ, D) * sm_scale  # [QB, D]
    # the outlier tokens' keys are read in their stored (natural) channel order
    query_natural = load_queries(q, b, heads, q_ok, natural, HQ, D) * sm_scale
    if PRECISION == "fp16":
        query_natural = query_natural.to(tl.float16)
    k_words = k_codes.to(tl.pointer_type(tl.int32))
    v_words = v_codes.to(tl.pointer_type(tl.int32))
    row_words = g * (H * (P // 4))  # [G]: a token's row, in words from its group's first
    blocks = g[:, None] * (H * NB) + tl.arange(0, NB)[None, :]  # [G, NB]
    oj = tl.arange(0, NP)
    o_ok = oj < N_OUT
    m = tl.full([QB], float("-inf"), tl.float32)
    total = tl.zeros([QB], dtype=tl.float32)
    acc = tl.zeros([QB, D], dtype=tl.float32)
    start, stop = split_range(num_groups, b, s, S)
    # 0x64006400 (1024.0 in both halves) as a value the compiler cannot fold into an
    # immediate (W >= 0 always): in a register, a pair's mask and this OR fuse into one
    # three-input logical operation
    magic = tl.where(W >= 0, 0x64006400, 0)
    for i in range(start, stop):
        slot = tl.load(group_table + b * W + i).to(tl.int64)
        first = (slot * G * H + h) * (P // 4)
        # keys: the scale folded into the query, the codes as they are
        ks = tl.load(k_scale + (slot * H + h) * D + d).to(tl.float32)
        kz = tl.load(k_zero + (slot * H + h) * D + d).to(tl.float32)
        bias = tl.sum(query * kz[None, :], axis=1)  # [QB]
        kc = load_row_halves(k_words + first, row_words, magic, G, D, BITS)  # [G, D] float16
        if PRECISION == "fp16":
            qk = (query * ks[None, :]).to(tl.float16)
            scores = tl.dot(qk, tl.trans(kc)) + bias[:, None]  # [QB, G]
        else:
            qk = query * ks[None, :]
            scores = tl.dot(qk, tl.trans(kc.to(tl.float32)), input_precision=PRECISION)
            scores = scores + bias[:, None]
        if N_OUT > 0:
            o_row = (slot * H + h) * N_OUT + oj  # [NP]
            at = tl.load(out_index + o_row, mask=o_ok, other=-1).to(tl.int32)
            is_out = tl.max((g[:, None] == at[None, :]).to(tl.int32), axis=1) > 0  # [G]
            scores = tl.where(is_out[None, :], float("-inf"), scores)
            ok = tl.load(
                out_k + o_row[:, None] * D + natural[None, :], mask=o_ok[:, None], other=0.0
            )
            if PRECISION == "fp16":
                o_scores = tl.dot(query_natural, tl.trans(ok.to(tl.float16)))  # [QB, NP]
            else:
                o_scores = tl.dot(
                    query_natural, tl.trans(ok.to(tl.float32)), input_precision=PRECISION
                )
            o_scores = tl.where(o_ok[None, :], o_scores, float("-inf"))
            m_new = tl.maximum(m, tl.maximum(tl.max(scores, axis=1), tl.max(o_scores, axis=1)))
        else:
            m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        # values: dequantized per (token, block of C channels), in half precision where
        # the scales are stored in it
        vc = load_row_halves(v_words + first, row_words, magic, G, D, BITS)
        v_base = (slot * G * H + h) * NB
        vs = tl.load(v_scale + v_base + blocks)  # [G, NB]
        vz = tl.load(v_zero + v_base + blocks)
        if PRECISION == "fp16" and v_scale.dtype.element_ty == tl.float16:
            v = tl.reshape(vc, (G, NB, C)) * vs[:, :, None] + vz[:, :, None]
            step = tl.dot(p.to(tl.float16), tl.reshape(v, (G, D)))
        else:
            v = tl.reshape(vc.to(tl.float32), (G, NB, C)) * vs.to(tl.float32)[:, :, None]
            v = tl.reshape(v + vz.to(tl.float32)[:, :, None], (G, D))
            if PRECISION == "fp16":
                step = tl.dot(p.to(tl.float16), v.to(tl.float16))
            else:
                step = tl.dot(p, v, input_precision=PRECISION)
        if N_OUT > 0:
            ov = tl.load(
                out_v + o_row[:, None] * D + natural[None, :], mask=o_ok[:, None], other=0.0
            )
            ov = pair_order(ov, NP, D, BITS)  # into the accumulator's channel order
            po = tl.exp(o_scores - m_new[:, None])
            total = total + tl.sum(po, axis=1)
            if PRECISION == "fp16":
                step += tl.dot(po.to(tl.float16), ov.to(tl.float16))
            else:
                step += tl.dot(po, ov.to(tl.float32), input_precision=PRECISION)
        acc = acc * alpha[:, None] + step
        m = m_new
    store_split(o, lse, acc, total, m, start, stop, b, s, heads, q_ok, d, HQ, S, D)
