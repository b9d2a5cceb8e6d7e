"""The tier's compiled CPU kernels (``sglang_evict_kernels.tier_cpu``): the attention
held to ``tier_attention_reference`` (every format the kernels hold, long tiers whose
scores span a wide range: the online softmax's rescaling), the decode merge held to
``decode_merge_reference`` (keys read where they lie in the pool), the quantize-and-pack held
to ``quantize_into_reference`` bit for bit (ties, empty and underflowing ranges, every
buffer dtype), thread counts, bad input, and what happens where they cannot be built."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sglang_evict_kernels import tier_quant
from sglang_evict_kernels.tier_attention import decode_merge_reference, tier_attention_reference
from sglang_evict_kernels.tier_cpu import (
    cpu_kernel_status,
    quantize_into_cpu,
    tier_attention_cpu,
    tier_decode_merge_cpu,
)
from sglang_evict_kernels.tier_format import TierFormat, TierStore, quantize_groups_reference

pytestmark = pytest.mark.skipif(
    not cpu_kernel_status()[0], reason=f"the tier's CPU kernel: {cpu_kernel_status()[1]}"
)


def case(
    fmt, groups_per_request, kv_heads=2, q_per_kv=3, seed=0, full_dtype=torch.float32, q_scale=1.0
):
    gen = torch.Generator().manual_seed(seed)
    slots = sum(groups_per_request) + 3
    shape = (slots, fmt.group_tokens, kv_heads, fmt.head_dim)
    k = torch.randn(shape, generator=gen)
    k[..., :4] *= 8.0  # outlier channels, as real keys have
    v = torch.randn(shape, generator=gen)
    store = quantize_groups_reference(k.to(full_dtype), v.to(full_dtype), fmt)
    order = torch.randperm(slots, generator=gen)
    width = max(max(groups_per_request), 1)
    table = torch.full((len(groups_per_request), width), slots - 1, dtype=torch.int32)
    start = 0
    for r, n in enumerate(groups_per_request):
        table[r, :n] = order[start : start + n].to(torch.int32)
        start += n
    counts = torch.tensor(groups_per_request, dtype=torch.int32)
    q = torch.randn(len(groups_per_request), kv_heads * q_per_kv, fmt.head_dim, generator=gen)
    return q * q_scale, store, table, counts


def assert_matches_reference(q, store, table, counts, fmt, sm_scale=None, tol=1e-5):
    o_ref, lse_ref = tier_attention_reference(q, store, table, counts, fmt, sm_scale=sm_scale)
    o, lse = tier_attention_cpu(q, store, table, counts, fmt, sm_scale=sm_scale)
    assert o.dtype == lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))  # requests without a tier
    torch.testing.assert_close(o, o_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, lse_ref, rtol=tol, atol=tol)
    empty = counts == 0
    assert torch.equal(o[empty], torch.zeros_like(o[empty]))
    return o, lse


FORMATS = [
    pytest.param(dict(bits=bits, outlier_tokens=out), id=f"{bits}bit-out{out}")
    for bits in (2, 3, 4, 8)
    for out in (0, 2)
] + [
    pytest.param(dict(bits=3, head_dim=128, outlier_tokens=3), id="3bit-d128"),
    pytest.param(dict(bits=3, head_dim=256, outlier_tokens=1), id="3bit-d256"),
    pytest.param(dict(bits=4, head_dim=256, group_tokens=16), id="4bit-d256-g16"),
    pytest.param(dict(bits=4, group_tokens=8, value_group_channels=8), id="4bit-g8-c8"),
    pytest.param(dict(bits=2, group_tokens=64, value_group_channels=64), id="2bit-g64-c64"),
    pytest.param(dict(bits=3, scale_dtype=torch.bfloat16, outlier_tokens=1), id="3bit-bf16"),
]


@pytest.mark.parametrize("kwargs", FORMATS)
def test_the_cpu_kernel_returns_the_references_output_and_lse(kwargs):
    fmt = TierFormat(**{"head_dim": 64, **kwargs})
    q, store, table, counts = case(fmt, [2, 0, 3, 1], seed=fmt.bits)
    assert_matches_reference(q, store, table, counts, fmt)
    assert_matches_reference(q, store, table, counts, fmt, sm_scale=0.05)


def test_outlier_rows_in_bfloat16_are_read_as_stored():
    fmt = TierFormat(bits=3, head_dim=64, outlier_tokens=2)
    q, store, table, counts = case(fmt, [3, 2], full_dtype=torch.bfloat16)
    assert store.out_k.dtype == torch.bfloat16
    assert_matches_reference(q, store, table, counts, fmt)


def test_a_long_tier_with_widely_spread_scores_keeps_the_softmax_exact():
    """40 groups a request and queries 30x larger: scores span hundreds, so the online
    softmax rescales many times and most weights underflow. Scores of ~300 carry float32
    rounding of ~3e-5 in either summation order (the kernel folds the key scale into
    the query), which the weights inherit: hence 1e-4."""
    fmt = TierFormat(bits=4, head_dim=64)
    q, store, table, counts = case(fmt, [40, 17, 1], q_scale=30.0, seed=3)
    _, lse = assert_matches_reference(q, store, table, counts, fmt, tol=1e-4)
    assert float(lse.max() - lse.min()) > 100  # the range the test is about


def test_counts_past_the_table_read_the_whole_table_as_the_reference_does():
    fmt = TierFormat(bits=3, head_dim=64)
    q, store, table, counts = case(fmt, [2, 3])
    assert_matches_reference(q, store, table, counts + 5, fmt)


def test_the_result_does_not_depend_on_the_thread_count():
    fmt = TierFormat(bits=3, head_dim=64, outlier_tokens=2)
    q, store, table, counts = case(fmt, [5, 4, 0, 6, 2, 3])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tier_attention_cpu(q, store, table, counts, fmt)
        torch.set_num_threads(max(2, threads))
        many = tier_attention_cpu(q, store, table, counts, fmt)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, many, strict=True))


def test_inputs_the_kernel_cannot_read_are_refused():
    fmt = TierFormat(bits=3, head_dim=64)
    q, store, table, counts = case(fmt, [2, 1])
    with pytest.raises(ValueError, match="queries must be"):
        tier_attention_cpu(q[:, :, :32], store, table, counts, fmt)
    with pytest.raises(ValueError, match="num_groups must be"):
        tier_attention_cpu(q, store, table, counts[:1], fmt)
    bad_table = table.clone()
    bad_table[0, 0] = store.num_slots  # past the store: refused, nothing read
    with pytest.raises(RuntimeError, match="names slot"):
        tier_attention_cpu(q, store, bad_table, counts, fmt)
    store.v_scale = store.v_scale.transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match="v_scale"):
        tier_attention_cpu(q, store, table, counts, fmt)


def status_in_a_fresh_process(env: dict) -> dict:
    code = (
        "import json, sglang_evict_kernels.tier_cpu as t; "
        "from sglang_evict.srt.tier import cpu_tier_attention; "
        "from sglang_evict_kernels import tier_quant; "
        "fn, what = cpu_tier_attention(); "
        "print(json.dumps({'status': t.cpu_kernel_status(), 'fn': fn.__name__, 'what': what, "
        "'quantize': tier_quant.quantize_function('cpu').__name__}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_switch_asks_for_the_tensor_form_and_says_so():
    got = status_in_a_fresh_process({"SGLANG_EVICT_TIER_CPU_KERNEL": "0"})
    assert got["status"] == [False, "turned off by SGLANG_EVICT_TIER_CPU_KERNEL=0"]
    assert got["fn"] == "tier_attention_torch"
    assert got["what"].startswith("tensor form: turned off")
    assert got["quantize"] == "quantize_into_reference"


def test_without_a_compiler_the_engine_falls_back_and_names_what_is_missing(tmp_path):
    got = status_in_a_fresh_process(
        {"CXX": str(tmp_path / "no-such-c++"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    )
    loaded, why = got["status"]
    assert not loaded and "C++ compiler" in why
    assert got["fn"] == "tier_attention_torch" and got["what"].startswith("tensor form")
    assert got["quantize"] == "quantize_into_reference"


# The quantize-and-pack kernel.


def kv_buffers(tokens, kv_heads, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    k[..., :4] *= 8.0  # outlier channels
    k[3] *= 0.01
    k[7] = k[3]  # the two smallest key norms, equal: ties go to the earlier token
    k[:, :, 5] = 0.25  # a channel with an empty range: scale 0, codes 0
    k[:, :, 6] = 1.0 + torch.arange(tokens).view(-1, 1) * 1e-9  # a range that underflows
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    v[:, :, :8] = -0.5  # a value block of one value (with value groups of 8)
    return k.to(dtype), v.to(dtype)


QUANTIZE_FORMATS = [
    pytest.param(dict(bits=bits, outlier_tokens=out), torch.bfloat16, id=f"{bits}bit-out{out}")
    for bits in (2, 3, 4, 8)
    for out in (0, 3)
] + [
    pytest.param(dict(bits=3, head_dim=128, outlier_tokens=2), torch.float16, id="3bit-d128-f16"),
    pytest.param(dict(bits=3, head_dim=256, outlier_tokens=2), torch.bfloat16, id="3bit-d256-bf16"),
    pytest.param(dict(bits=4, group_tokens=8, value_group_channels=8), torch.float32, id="g8-c8"),
    pytest.param(
        dict(bits=2, group_tokens=64, value_group_channels=64, outlier_tokens=5),
        torch.float32,
        id="2bit-g64-c64",
    ),
    pytest.param(
        dict(bits=3, scale_dtype=torch.bfloat16, outlier_tokens=1),
        torch.bfloat16,
        id="3bit-bf16-scales",
    ),
]


def filled_store(fmt, slots, kv_heads, dtype):
    """A store whose every byte is a sentinel, so that writes outside the slots show."""
    store = TierStore.empty(fmt, slots, kv_heads, dtype)
    for tensor in store.tensors().values():
        tensor.view(torch.uint8).fill_(0xA5)
    return store


@pytest.mark.parametrize(("kwargs", "dtype"), QUANTIZE_FORMATS)
def test_the_cpu_quantize_kernel_writes_the_references_bytes_bit_for_bit(kwargs, dtype):
    fmt = TierFormat(**{"head_dim": 64, **kwargs})
    g, kv_heads = fmt.group_tokens, 3
    k, v = kv_buffers(4 * g + 9, kv_heads, fmt.head_dim, dtype, seed=fmt.bits)
    gen = torch.Generator().manual_seed(fmt.bits + 1)
    token_slots = torch.randperm(k.shape[0], generator=gen)[: 3 * g].view(3, g)
    token_slots[0, :8] = torch.arange(8)  # tokens 3 and 7 tie, in one group
    group_slots = torch.tensor([5, 0, 3])
    expected = filled_store(fmt, 6, kv_heads, dtype)
    got = filled_store(fmt, 6, kv_heads, dtype)
    tier_quant.quantize_into_reference(expected, group_slots, k, v, token_slots, fmt)
    quantize_into_cpu(got, group_slots, k, v, token_slots, fmt)
    for name, tensor in expected.tensors().items():
        assert torch.equal(getattr(got, name), tensor), f"{name} differs from the reference"
    untouched = torch.tensor([1, 2, 4])
    assert torch.equal(got.k_codes[untouched].flatten().unique(), torch.tensor([0xA5]))
    if fmt.outlier_tokens:  # the test's tie was there to decide
        assert bool((got.out_index[5] == 3).any(dim=-1).all())
    if fmt.outlier_tokens == 1:
        assert not bool((got.out_index[5] == 7).any())


def test_the_cpu_quantize_result_does_not_depend_on_the_thread_count():
    fmt = TierFormat(bits=3, head_dim=64, outlier_tokens=2)
    k, v = kv_buffers(400, 3, 64, torch.bfloat16, seed=9)
    token_slots = torch.randperm(400, generator=torch.Generator().manual_seed(2))[:320].view(10, 32)
    group_slots = torch.arange(10)
    threads = torch.get_num_threads()
    stores = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            store = TierStore.empty(fmt, 10, 3, torch.bfloat16)
            quantize_into_cpu(store, group_slots, k, v, token_slots, fmt)
            stores.append(store)
    finally:
        torch.set_num_threads(threads)
    one, many = stores
    assert all(torch.equal(t, getattr(many, name)) for name, t in one.tensors().items())


def test_slots_outside_the_buffers_or_the_store_are_refused_and_nothing_is_written():
    fmt = TierFormat(bits=3, head_dim=64)
    k, v = kv_buffers(100, 2, 64, torch.bfloat16, seed=1)
    store = filled_store(fmt, 4, 2, torch.bfloat16)
    before = {name: t.clone() for name, t in store.tensors().items()}
    good = torch.arange(64).view(2, 32)
    with pytest.raises(RuntimeError, match="token slot 100 outside the buffers' 100 slots"):
        quantize_into_cpu(store, torch.tensor([0, 1]), k, v, good.clone().fill_(100), fmt)
    with pytest.raises(RuntimeError, match="group slot 4 outside the store's 4 slots"):
        quantize_into_cpu(store, torch.tensor([0, 4]), k, v, good, fmt)
    with pytest.raises(ValueError, match="token_slots must be"):
        quantize_into_cpu(store, torch.tensor([0]), k, v, good, fmt)
    assert all(torch.equal(t, before[name]) for name, t in store.tensors().items())


def test_quantize_into_runs_the_compiled_kernel_on_cpu_where_it_builds():
    assert tier_quant.quantize_function("cpu") is quantize_into_cpu
    assert tier_quant.quantize_function("cpu", use_triton=True) is tier_quant.quantize_into_triton


# The decode merge: SGLang's output over the pool merged with the tier's attention.


def decode_case(fmt, counts, lens, kv_heads=2, q_per_kv=3, dtype=torch.bfloat16, seed=0):
    q, store, table, num_groups = case(
        fmt, counts, kv_heads=kv_heads, q_per_kv=q_per_kv, seed=seed, full_dtype=dtype
    )
    gen = torch.Generator().manual_seed(seed + 100)
    pool_tokens, pool_rows, width = 700, 12, 320
    k_buffer = torch.randn(pool_tokens, kv_heads, fmt.head_dim, generator=gen).to(dtype)
    req_to_token = torch.randint(0, pool_tokens, (pool_rows, width), generator=gen).int()
    rows = torch.randperm(pool_rows, generator=gen)[: len(counts)]
    o_full = torch.randn(len(counts), q.shape[1] * fmt.head_dim, generator=gen).to(dtype)
    return q, o_full, k_buffer, req_to_token, rows, torch.tensor(lens), store, table, num_groups


def assert_merge_matches_reference(args, fmt, sm_scale):
    expected = decode_merge_reference(*args, fmt, sm_scale=sm_scale)
    got = tier_decode_merge_cpu(*args, fmt, sm_scale=sm_scale)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        # The scores' sums over D channels, in another order: rounding grows with D.
        tol = 1e-5 * max(1.0, fmt.head_dim / 64)
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    else:  # the two round float32 results that differ in their last bits: one step apart
        step = expected.float().abs().clamp(min=2.0**-8) * 2.0**-7
        assert bool(((got.float() - expected.float()).abs() <= step).all())
    o_full, num_groups = args[1], args[8]
    without = num_groups == 0
    assert torch.equal(got[without], o_full[without])  # no tier: SGLang's output as it is
    return got


MERGE_CASES = [
    pytest.param(dict(bits=3, outlier_tokens=2), torch.bfloat16, 3, id="3bit-bf16-gqa3"),
    pytest.param(dict(bits=2), torch.float32, 1, id="2bit-f32-mha"),
    pytest.param(dict(bits=4, head_dim=128, outlier_tokens=3), torch.bfloat16, 4, id="4bit-d128"),
    pytest.param(
        dict(bits=3, head_dim=256, outlier_tokens=2), torch.float32, 4, id="3bit-d256-mqa"
    ),
    pytest.param(dict(bits=8, scale_dtype=torch.bfloat16), torch.float16, 2, id="8bit-f16"),
]


@pytest.mark.parametrize(("kwargs", "dtype", "q_per_kv"), MERGE_CASES)
def test_the_decode_merge_returns_the_references_output(kwargs, dtype, q_per_kv):
    fmt = TierFormat(**{"head_dim": 64, **kwargs})
    args = decode_case(fmt, [2, 0, 3, 1, 0], [40, 9, 300, 1, 77], q_per_kv=q_per_kv, dtype=dtype)
    assert_merge_matches_reference(args, fmt, sm_scale=None)
    assert_merge_matches_reference(args, fmt, sm_scale=0.3)  # sharper scores


def test_a_request_of_no_full_precision_keys_reads_its_tier_alone():
    fmt = TierFormat(bits=3, head_dim=64)
    args = decode_case(fmt, [2, 1], [0, 5], dtype=torch.float32)
    got = assert_merge_matches_reference(args, fmt, sm_scale=None)
    q, store, table, num_groups = args[0], args[6], args[7], args[8]
    o_tier, _ = tier_attention_reference(q, store, table, num_groups, fmt)
    torch.testing.assert_close(got[0], o_tier[0].reshape(-1), rtol=1e-5, atol=1e-5)


def test_a_pool_slot_outside_the_key_buffer_is_refused_by_name():
    fmt = TierFormat(bits=3, head_dim=64)
    args = list(decode_case(fmt, [1, 2], [10, 20]))
    args[3][args[4][1], 7] = args[2].shape[0]  # request 1's token 7: past the pool
    with pytest.raises(RuntimeError, match="request 1 token 7 names slot 700 of a pool of 700"):
        tier_decode_merge_cpu(*args, fmt)
    args[5] = torch.tensor([10, 400])  # more tokens than req_to_token's width
    with pytest.raises(RuntimeError, match="outside req_to_token"):
        tier_decode_merge_cpu(*args, fmt)
