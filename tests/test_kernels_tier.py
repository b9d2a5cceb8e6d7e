"""The quantized tier's format and kernels (``sglang_evict_kernels.tier_format``,
``tier_quant``, ``tier_attention``): sizes against the documented formula, packing,
the reference quantizer's promises, the kernels bit for bit against it, and the
log-sum-exp merge against one softmax over every token."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_evict_kernels.tier_attention import (
    attention_with_lse_reference,
    merge_attention_states,
    tier_attention_reference,
    tier_attention_torch,
)
from sglang_evict_kernels.tier_format import (
    SUPPORTED_BITS,
    TierFormat,
    TierStore,
    dequantize_groups_reference,
    outlier_tokens_reference,
    pack_codes,
    quantize_groups_reference,
    unpack_codes,
)


def kv(groups, fmt, kv_heads=2, seed=0, dtype=torch.float32):
    """Keys with a few large channels (as real keys have) and values, ``[N, G, H, D]``."""
    gen = torch.Generator().manual_seed(seed)
    shape = (groups, fmt.group_tokens, kv_heads, fmt.head_dim)
    k = torch.randn(shape, generator=gen)
    k[..., :4] *= 8.0  # outlier channels
    v = torch.randn(shape, generator=gen)
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_packing_round_trips_and_takes_bits_over_eight_bytes_per_code(bits):
    codes = torch.randint(0, 2**bits, (3, 5, 128), generator=torch.Generator().manual_seed(bits))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 128 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_every_32_bit_word_of_a_row_holds_whole_codes(bits, head_dim):
    """The layout a GPU decodes in a shift and a mask a code: change one code and only
    one word of its row changes (no code crosses a word), and a row is whole words."""
    gen = torch.Generator().manual_seed(bits * head_dim)
    codes = torch.randint(0, 2**bits, (1, head_dim), generator=gen)
    packed = pack_codes(codes, bits)
    assert packed.shape[-1] % 4 == 0
    words = packed.view(torch.int32)
    for channel in range(head_dim):
        other = codes.clone()
        other[0, channel] = (other[0, channel] + 1) % 2**bits
        changed = (pack_codes(other, bits).view(torch.int32) != words).sum().item()
        # 3 bits: a code's low bits and high bit are in two planes, one word each
        assert changed == (1 if bits != 3 else 1 + (codes[0, channel] % 4 == 3)), channel


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("outliers", [0, 3])
@pytest.mark.parametrize("full_dtype", [torch.float32, torch.bfloat16])
def test_the_stores_tensors_hold_the_documented_bytes(bits, outliers, full_dtype):
    fmt = TierFormat(bits=bits, group_tokens=32, head_dim=64, outlier_tokens=outliers)
    slots, heads = 5, 3
    store = TierStore.empty(fmt, slots, heads, full_dtype)
    per_token_head = fmt.bytes_per_token_head(full_dtype)
    assert store.nbytes() == pytest.approx(per_token_head * slots * fmt.group_tokens * heads)
    assert store.k_codes.numel() * store.k_codes.element_size() == (
        slots * fmt.group_tokens * heads * 64 * bits / 8
    )
    # 3 bits at G = 32 with bfloat16 full precision: 0.19 of the full bytes (+ outliers).
    ratio = fmt.bytes_per_token_head(full_dtype, outliers=0) / fmt.full_bytes_per_token_head(
        full_dtype
    )
    if bits == 3 and full_dtype == torch.bfloat16:
        assert ratio == pytest.approx((3 / 8 + 2 / 32 + 2 / 32) / 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(bits=5), "tier bits 5 not supported"),
        (dict(head_dim=80), "head dim 80 not supported"),
        (dict(group_tokens=24), "power of two"),
        (dict(value_group_channels=48), "value group of 48"),
        (dict(outlier_tokens=16, group_tokens=32), "16 outlier tokens"),
        (dict(scale_dtype=torch.float32), "scale dtype"),
    ],
)
def test_a_format_the_kernels_cannot_hold_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TierFormat(**kwargs)


def test_outlier_tokens_are_the_smallest_key_norms_ties_to_the_earlier_token():
    keys = torch.ones(1, 8, 1, 64)
    keys[0, 5] = 0.1
    keys[0, 2] = 0.5
    keys[0, 6] = 0.5  # ties with token 2: the earlier is taken
    assert outlier_tokens_reference(keys, 2).tolist() == [[[2, 5]]]


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("outliers", [0, 3])
def test_reference_error_is_within_half_a_step_and_outliers_come_back_exact(bits, outliers):
    fmt = TierFormat(bits=bits, group_tokens=32, head_dim=64, outlier_tokens=outliers)
    k, v = kv(3, fmt)
    store = quantize_groups_reference(k, v, fmt)
    k2, v2 = dequantize_groups_reference(store, fmt)
    index = store.out_index.long()  # [N, H, n_out]
    is_out = torch.zeros(3, 2, fmt.group_tokens, dtype=torch.bool)
    is_out.scatter_(2, index, True)
    is_out = is_out.transpose(1, 2).unsqueeze(-1).expand_as(k)
    assert torch.equal(k2[is_out], k[is_out]) and torch.equal(v2[is_out], v[is_out])
    k_step = store.k_scale.float().unsqueeze(1).expand_as(k)
    c = fmt.value_group_channels
    v_step = store.v_scale.float().repeat_interleave(c, dim=-1)
    # Half a step, plus what rounding the range's ends to float16 (11 bits) can add
    # at the clamped ends.
    tolerance_k = 0.5 * k_step + 2 * k.abs().amax() * 2**-10
    tolerance_v = 0.5 * v_step + 2 * v.abs().amax() * 2**-10
    inside = ~is_out
    assert ((k2 - k).abs() <= tolerance_k)[inside].all()
    assert ((v2 - v).abs() <= tolerance_v).all()


def test_more_bits_quantize_closer():
    errors = []
    for bits in SUPPORTED_BITS:
        fmt = TierFormat(bits=bits, group_tokens=32, head_dim=64)
        k, v = kv(2, fmt)
        k2, v2 = dequantize_groups_reference(quantize_groups_reference(k, v, fmt), fmt)
        errors.append(((k2 - k).abs().mean() + (v2 - v).abs().mean()).item())
    assert errors == sorted(errors, reverse=True)


def test_an_outlier_token_is_left_out_of_its_groups_key_ranges():
    """OTT's case: in channels where every key is large, one token's key is near zero
    (the smallest L1 norm). Left in, it stretches those channels' ranges and every
    other token pays for it; kept aside in full precision, the ranges are the others'."""
    fmt = TierFormat(bits=2, group_tokens=32, head_dim=64)
    k, v = kv(1, fmt, kv_heads=1)
    k[..., :4] = 8.0 + k[..., :4] / 8  # outlier channels: all keys near +8
    k[0, 7] = 1e-3  # one token with a near-zero key
    one = TierFormat(**{**vars(fmt), "outlier_tokens": 1})
    plain, traced = quantize_groups_reference(k, v, fmt), quantize_groups_reference(k, v, one)
    assert traced.out_index.flatten().tolist() == [7]
    others = torch.ones(fmt.group_tokens, dtype=torch.bool)
    others[7] = False
    assert (traced.k_zero[0, 0, :4].float() > 4).all()  # the range starts near +8, not 0
    assert (traced.k_scale[0, 0, :4] < 0.6 * plain.k_scale[0, 0, :4]).all()
    errors = []
    for store, f in ((plain, fmt), (traced, one)):
        k2, _ = dequantize_groups_reference(store, f)
        errors.append((k2 - k)[0, others, 0, :4].abs().mean().item())
    assert errors[1] < 0.6 * errors[0]
    k2, _ = dequantize_groups_reference(traced, one)
    assert torch.equal(k2[0, 7], k[0, 7])  # the outlier itself comes back exact


def request_tables(num_groups_per_request, slots_total, seed=0):
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(slots_total, generator=gen)
    width = max(max(num_groups_per_request), 1)
    table = torch.zeros(len(num_groups_per_request), width, dtype=torch.int32)
    start = 0
    for r, n in enumerate(num_groups_per_request):
        table[r, :n] = order[start : start + n].to(torch.int32)
        start += n
    return table, torch.tensor(num_groups_per_request, dtype=torch.int32)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_merged_partial_attentions_equal_one_softmax_over_every_token(bits, page_size):
    """A request's full-precision tokens (in pages of ``page_size``) and its tier's
    dequantized tokens: the merge of the two partial attentions equals attention over
    their concatenation, in one softmax."""
    fmt = TierFormat(bits=bits, group_tokens=32, head_dim=64, outlier_tokens=2)
    kv_heads, q_heads = 2, 6
    k, v = kv(5, fmt, kv_heads=kv_heads, seed=bits)
    store = quantize_groups_reference(k, v, fmt)
    table, counts = request_tables([2, 0, 3], 5)
    gen = torch.Generator().manual_seed(page_size)
    q = torch.randn(3, q_heads, 64, generator=gen)
    o_tier, lse_tier = tier_attention_reference(q, store, table, counts, fmt)
    sm_scale = 1 / math.sqrt(64)
    for r, full_tokens in enumerate([page_size * 2, page_size, 0]):
        fk = torch.randn(full_tokens, kv_heads, 64, generator=gen)
        fv = torch.randn(full_tokens, kv_heads, 64, generator=gen)
        o_full, lse_full = attention_with_lse_reference(q[r], fk, fv, sm_scale)
        o, lse = merge_attention_states(o_full, lse_full, o_tier[r], lse_tier[r])
        dk, dv = dequantize_groups_reference(store.take(table[r, : counts[r]].long()), fmt)
        all_k = torch.cat([fk, dk.reshape(-1, kv_heads, 64)])
        all_v = torch.cat([fv, dv.reshape(-1, kv_heads, 64)])
        o_one, lse_one = attention_with_lse_reference(q[r], all_k, all_v, sm_scale)
        if all_k.shape[0] == 0:
            assert torch.equal(o, torch.zeros_like(o)) and torch.isinf(lse).all()
            continue
        torch.testing.assert_close(o, o_one, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, lse_one, rtol=1e-5, atol=1e-5)


# --- the Triton kernels, held to the references (the interpreter on CPU) ------------

from sglang_evict_kernels.tier_attention import (  # noqa: E402
    KERNELS,
    WORDS_PRECISIONS,
    WORDS_TOLERANCE,
    tier_attention_triton,
)
from sglang_evict_kernels.tier_quant import (  # noqa: E402
    quantize_into_reference,
    quantize_into_triton,
)
from tests.kernel_device import KERNEL_DEVICE, on_host, on_kernel_device  # noqa: E402


def store_on(store: TierStore, device) -> TierStore:
    return TierStore(**{name: t.to(device) for name, t in store.tensors().items()})


def buffers(tokens, kv_heads, head_dim, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    k[..., :4] *= 8.0
    return k.to(dtype), torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)


QUANT_CASES = [
    pytest.param(bits, outliers, 64, 32, torch.float32, id=f"{bits}bit-out{outliers}")
    for bits in SUPPORTED_BITS
    for outliers in (0, 3)
] + [
    pytest.param(3, 3, 128, 32, torch.bfloat16, id="3bit-d128-bf16"),
    pytest.param(3, 2, 256, 32, torch.bfloat16, id="3bit-d256-bf16"),
    pytest.param(2, 3, 64, 128, torch.float32, id="2bit-g128"),
]


@pytest.mark.parametrize(("bits", "outliers", "head_dim", "group", "dtype"), QUANT_CASES)
def test_the_quantize_kernel_writes_the_references_bytes_bit_for_bit(
    bits, outliers, head_dim, group, dtype
):
    scale_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
    fmt = TierFormat(
        bits=bits,
        group_tokens=group,
        head_dim=head_dim,
        outlier_tokens=outliers,
        scale_dtype=scale_dtype,
    )
    kv_heads, tokens = 2, 3 * group + 17
    k_buf, v_buf = buffers(tokens, kv_heads, head_dim, seed=bits + outliers, dtype=dtype)
    gen = torch.Generator().manual_seed(7)
    token_slots = torch.randperm(tokens, generator=gen)[: 3 * group].reshape(3, group)
    group_slots = torch.tensor([4, 0, 2])
    expected = TierStore.empty(fmt, 5, kv_heads, dtype)
    got = TierStore.empty(fmt, 5, kv_heads, dtype)
    quantize_into_reference(expected, group_slots, k_buf, v_buf, token_slots, fmt)
    got = store_on(got, KERNEL_DEVICE)
    quantize_into_triton(got, *on_kernel_device([group_slots, k_buf, v_buf, token_slots]), fmt)
    got = store_on(got, "cpu")
    for name, tensor in expected.tensors().items():
        assert torch.equal(getattr(got, name), tensor), f"{name} differs from the reference"
    ek, ev = dequantize_groups_reference(expected, fmt)
    gk, gv = dequantize_groups_reference(got, fmt)
    assert torch.equal(gk, ek) and torch.equal(gv, ev)  # what attention reads, bit for bit


ATTENTION_CASES = [
    pytest.param(bits, outliers, 64, id=f"{bits}bit-out{outliers}")
    for bits in SUPPORTED_BITS
    for outliers in (0, 2)
] + [pytest.param(3, 2, 128, id="3bit-d128"), pytest.param(3, 2, 256, id="3bit-d256")]


@pytest.mark.parametrize(("bits", "outliers", "head_dim"), ATTENTION_CASES)
def test_the_attention_kernel_returns_the_references_output_and_lse(bits, outliers, head_dim):
    fmt = TierFormat(bits=bits, group_tokens=32, head_dim=head_dim, outlier_tokens=outliers)
    kv_heads, q_heads = 2, 6  # GQA: three query heads per KV head
    k, v = kv(5, fmt, kv_heads=kv_heads, seed=bits)
    store = quantize_groups_reference(k, v, fmt)
    table, counts = request_tables([2, 0, 3], 5, seed=bits)
    q = torch.randn(3, q_heads, head_dim, generator=torch.Generator().manual_seed(1))
    o_ref, lse_ref = tier_attention_reference(q, store, table, counts, fmt)
    on_device = (*on_kernel_device([q]), store_on(store, KERNEL_DEVICE))
    table, counts = on_kernel_device([table, counts])
    o_torch, lse_torch = tier_attention_torch(q, store, table, counts, fmt)  # batched torch
    torch.testing.assert_close(o_torch, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_torch, lse_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(o_torch[1], torch.zeros_like(o_torch[1]))
    # every body and precision; the splits of a request's groups, merged by the second
    # launch. Float32 products hold the reference to 1e-5; the words body's half-precision
    # products (its default) to the tolerance tier_attention states for them.
    bodies = [("grouped", None, 1e-5)] + [
        ("words", precision, WORDS_TOLERANCE[precision]) for precision in WORDS_PRECISIONS
    ]
    assert {kernel for kernel, _, _ in bodies} == set(KERNELS)
    for kernel, precision, tol in bodies:
        for splits in (1, 2, 4, None):
            name = f"{kernel} {precision}, {splits} splits"
            o, lse = on_host(
                tier_attention_triton(
                    *on_device,
                    table,
                    counts,
                    fmt,
                    splits=splits,
                    kernel=kernel,
                    precision=precision,
                )
            )
            torch.testing.assert_close(o, o_ref, rtol=tol, atol=tol, msg=f"{name}: o differs")
            assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref)), name  # the empty request
            torch.testing.assert_close(lse, lse_ref, rtol=tol, atol=tol, msg=f"{name}: lse")
            assert torch.equal(o[1], torch.zeros_like(o[1])), name


def test_the_words_kernel_refuses_what_it_cannot_run_by_name():
    fmt = TierFormat(bits=3, group_tokens=8, head_dim=64)
    k, v = kv(2, fmt)
    store = quantize_groups_reference(k, v, fmt)
    table, counts = request_tables([1, 1], 2)
    q = torch.zeros(2, 2, 64)
    with pytest.raises(ValueError, match=r"at least 16 tokens.*kernel='grouped'"):
        tier_attention_triton(q, store, table, counts, fmt, kernel="words")
    with pytest.raises(ValueError, match="precision 'fp8'"):
        tier_attention_triton(q, store, table, counts, fmt, kernel="words", precision="fp8")
    with pytest.raises(ValueError, match="grouped tier attention kernel takes no precision"):
        tier_attention_triton(q, store, table, counts, fmt, precision="fp16")
    with pytest.raises(ValueError, match="kernel 'fast'"):
        tier_attention_triton(q, store, table, counts, fmt, kernel="fast")
    # value groups narrower than a word's channels: the words body's pair order spans 16
    fmt = TierFormat(bits=2, group_tokens=16, head_dim=64, value_group_channels=8)
    k, v = kv(2, fmt)
    store = quantize_groups_reference(k, v, fmt)
    with pytest.raises(ValueError, match=r"16 channels a word.*8 channels.*kernel='grouped'"):
        tier_attention_triton(q, store, table, counts, fmt, kernel="words")


def test_codes_that_do_not_start_on_a_word_are_refused():
    """The kernels read a row's codes as 32-bit words: a store whose codes start off a
    word (a view at an odd byte of a larger buffer) is refused, not misread."""
    fmt = TierFormat(bits=3, group_tokens=32, head_dim=64)
    k, v = kv(1, fmt)
    store = quantize_groups_reference(k, v, fmt)
    raw = torch.zeros(store.k_codes.numel() + 1, dtype=torch.uint8)
    shifted = raw[1:].view(store.k_codes.shape)
    shifted.copy_(store.k_codes)
    store.k_codes = shifted
    table, counts = request_tables([1], 1)
    with pytest.raises(ValueError, match=r"4-byte word.*k_codes"):
        tier_attention_triton(torch.zeros(1, 2, 64), store, table, counts, fmt)


def test_a_store_the_kernels_cannot_index_is_refused():
    fmt = TierFormat(bits=4, group_tokens=32, head_dim=64, outlier_tokens=2)
    k, v = kv(2, fmt)
    store = quantize_groups_reference(k, v, fmt)
    store.k_scale = store.k_scale.transpose(0, 1).contiguous().transpose(0, 1)
    table, counts = request_tables([1, 1], 2)
    with pytest.raises(ValueError, match="k_scale"):
        tier_attention_triton(torch.zeros(2, 2, 64), store, table, counts, fmt)
    with pytest.raises(ValueError, match="token_slots must be"):
        quantize_into_reference(
            store, torch.tensor([0]), *buffers(40, 2, 64, 0), torch.zeros(1, 16), fmt
        )
