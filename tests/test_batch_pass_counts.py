"""The whole-batch counts (``BatchCounts``, numpy) equal ``pass_counts`` of each request,
and the packed host columns and strategies built from them match the scalar forms."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_evict.passes.batch.counts import (
    PAGE_COUNTS,
    BatchCounts,
    batch_pass_counts,
    batch_strategy,
    page_counts,
    pass_counts,
)
from sglang_evict.passes.batch.inputs import COLUMNS, host_columns
from sglang_evict.passes.batch.shapes import pass_shape

request = st.fixed_dictionaries(
    {
        "kv_len": st.integers(0, 5000),
        "position_offset": st.integers(0, 3000),
        "num_shared": st.integers(0, 600),
        "prompt_len": st.integers(0, 900),
        "budget": st.integers(0, 3000),
    }
)
config = st.fixed_dictionaries(
    {
        "page_size": st.sampled_from([1, 4, 16, 64]),
        "sink_tokens": st.integers(0, 8),
        "protected_tokens": st.integers(0, 40),
        "window_tokens": st.integers(0, 300),
        "evict_prompt": st.booleans(),
    }
)


def batch_of(requests: list[dict], server: dict) -> BatchCounts:
    columns = {name: np.array([r[name] for r in requests], dtype=np.int64) for name in requests[0]}
    return batch_pass_counts(**columns, **server)


@settings(max_examples=200, deadline=None)
@given(st.lists(request, min_size=1, max_size=24), config)
def test_batch_counts_equal_each_requests_counts(requests, server):
    batch = batch_of(requests, server)
    assert len(batch) == len(requests)
    for i, r in enumerate(requests):
        one = pass_counts(**r, **server)
        assert batch.request(i) == one
        assert int(batch.tokens_evicted[i]) == one.tokens_evicted
        assert int(batch.pages_freed[i]) == one.pages_freed
        for strategy in ("hole_fill", "repack"):
            assert int(batch.staging_pages(strategy)[i]) == one.staging_pages(strategy)
        scalar = page_counts(
            kv_len=one.kv_len,
            survivors=one.survivors,
            frozen_len=one.frozen_len,
            page_size=one.page_size,
        )
        assert tuple(int(a[i]) for a in batch.page_counts()) == scalar
    chosen = [i for i in range(len(requests)) if i % 2 == 0]
    assert [batch.take(chosen).request(j) for j in range(len(chosen))] == [
        batch.request(i) for i in chosen
    ]


@settings(max_examples=100, deadline=None)
@given(st.lists(request, min_size=1, max_size=12), config, st.data())
def test_packed_columns_hold_each_requests_ints_and_no_op_padding(requests, server, data):
    for r in requests:  # a pass covers requests with something to evict
        r["kv_len"] = max(r["kv_len"], r["budget"] + 1)
    batch = batch_of(requests, server)
    n = len(requests)
    rows = np.array(data.draw(st.permutations(range(64)))[:n], dtype=np.int64)
    compacted = np.array([data.draw(st.integers(0, r["kv_len"])) for r in requests])
    free = data.draw(st.integers(0, 400))
    strategy, staging = batch_strategy("repack", batch, lambda: free)
    assert strategy in ("repack", "hole_fill")
    assert staging.sum() <= free or strategy == "hole_fill"
    if strategy == "hole_fill":
        assert not staging.any()
    shape = pass_shape(
        batch, staging, page_size=server["page_size"], row_capacity=10**5, static=True
    )
    packed = host_columns(
        row_of_request=rows,
        compacted_lens=compacted,
        counts=batch,
        staging_counts=staging,
        shape=shape,
    ).reshape(len(COLUMNS), shape.requests)
    column = dict(zip(COLUMNS, packed, strict=True))
    base = 0
    for i in range(n):
        c = batch.request(i)
        assert column["row"][i] == rows[i] and column["alias"][i] == i
        assert column["kv_len"][i] == c.kv_len and column["survivors"][i] == c.survivors
        assert column["offset"][i] == c.next_position - c.kv_len
        assert column["offset_after"][i] == c.next_position - c.survivors
        assert column["evicted"][i] == c.tokens_evicted
        assert column["compacted_len"][i] == compacted[i]
        assert column["staging"][i] == staging[i] and column["staging_base"][i] == base
        base += int(staging[i])
        scalar = page_counts(
            kv_len=c.kv_len, survivors=c.survivors, frozen_len=c.frozen_len, page_size=c.page_size
        )
        assert tuple(int(column[name][i]) for name in PAGE_COUNTS) == scalar
    for i in range(n, shape.requests):  # padding: request 0's row and offset, nothing else
        for name in COLUMNS:
            expected = {"row": rows[0], "offset_after": column["offset_after"][0]}.get(name, 0)
            assert column[name][i] == expected, name


def test_bad_counts_are_refused_naming_the_values():
    ones = np.ones(2, dtype=np.int64)
    with pytest.raises(ValueError, match="kv_len >= 0"):
        batch_pass_counts(
            kv_len=np.array([5, -1]),
            position_offset=ones,
            num_shared=ones,
            prompt_len=ones,
            budget=ones,
            page_size=16,
            sink_tokens=0,
            protected_tokens=0,
            window_tokens=0,
            evict_prompt=False,
        )


due_case = st.fixed_dictionaries(
    {
        "kv_len": st.integers(0, 3000),
        "position_offset": st.integers(0, 2000),
        "num_shared": st.integers(0, 600),
        "prompt_len": st.integers(0, 900),
        "budget": st.integers(89, 1500),  # above sinks + protected + window (8 + 40 + 40)
        "cadence": st.integers(1, 300),
        "enabled": st.booleans(),
    }
)


@settings(max_examples=300, deadline=None)
@given(due_case, config)
def test_the_due_check_is_a_pass_that_would_evict_a_cadence(case, server):
    """``EvictionManager.is_due`` (the decode step's check, no counts object) is true
    exactly when the request's policy is on and a pass now would evict at least a
    cadence of tokens: ``counts(...).tokens_evicted >= cadence`` (``pass_counts``)."""
    import dataclasses

    import torch

    from sglang_evict.config import EvictionConfig
    from sglang_evict.passes.manager import EvictionManager
    from sglang_evict.passes.state import RequestState
    from sglang_evict.passes.tensor_pool import TensorPool

    page_size = server["page_size"]
    window = min(server["window_tokens"], 40)  # sinks + protected + window < budget
    buffer = torch.zeros(2 * page_size, 1, 1)
    manager = EvictionManager(
        config=EvictionConfig(
            kv_budget_tokens=case["budget"],
            cadence_tokens=case["cadence"],
            page_size=page_size,
            sink_tokens=server["sink_tokens"],
            protected_tokens=server["protected_tokens"],
            window_tokens=window,
            evict_prompt=server["evict_prompt"],
            scorer="knorm",
            lease_store="none",
        ),
        pool=TensorPool(
            k_buffers=[buffer], v_buffers=[buffer], page_size=page_size, rows=1, capacity=1
        ),
        compactor=None,
        num_request_rows=1,
        row_capacity=1,
        device="cpu",
    )
    if case["position_offset"]:  # an earlier pass left this request an offset
        manager.states["r"] = RequestState(0, 0, case["position_offset"], 0, 0)
    policy = dataclasses.replace(manager.default_policy, enabled=case["enabled"])
    # pass_counts under the manager's config and the request's offset and budget
    counts = manager.counts("r", case["kv_len"], case["num_shared"], case["prompt_len"], policy)
    assert (counts.next_position, counts.budget) == (
        case["kv_len"] + case["position_offset"],
        case["budget"],
    )
    expected = case["enabled"] and counts.tokens_evicted >= case["cadence"]
    due = manager.is_due("r", case["kv_len"], case["num_shared"], case["prompt_len"], policy)
    assert due == expected
