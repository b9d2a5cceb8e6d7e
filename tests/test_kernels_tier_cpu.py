"""The tier's compiled CPU attention kernel (``sglang_evict_kernels.tier_cpu``) held to
``tier_attention_reference``: every format the kernels hold, long tiers whose scores
span a wide range (the online softmax's rescaling), thread counts, bad input, and what
happens where it cannot be built."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sglang_evict_kernels.tier_attention import tier_attention_reference
from sglang_evict_kernels.tier_cpu import cpu_kernel_status, tier_attention_cpu
from sglang_evict_kernels.tier_format import TierFormat, quantize_groups_reference

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
        "fn, what = cpu_tier_attention(); "
        "print(json.dumps({'status': t.cpu_kernel_status(), 'fn': fn.__name__, 'what': what}))"
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


def test_without_a_compiler_the_engine_falls_back_and_names_what_is_missing(tmp_path):
    got = status_in_a_fresh_process(
        {"CXX": str(tmp_path / "no-such-c++"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    )
    loaded, why = got["status"]
    assert not loaded and "C++ compiler" in why
    assert got["fn"] == "tier_attention_torch" and got["what"].startswith("tensor form")
