"""A pass's requests as columns of host ints, from the due requests to the results.

The host's share of a pass grows with its due requests, and a replayed pass
(``sglang_evict.passes.graphs``) leaves the host little else to do, so that share is
kept to array operations for the whole batch (``passes.batch.counts.BatchCounts``) and
one small object per request, built once: no counts object, no dataclass copy, no
per-request lookup repeated.

    pass_work        DueRequest list -> PassWork: policies resolved, one int64 array
                     per count (``BatchCounts``), rows and compacted lengths
    check_rows       refuse rows outside the pools (before anything changes)
    commit_states    each request's ``RequestState`` after its pass (updated in place)
    pass_results     one ``PassResult`` per request

The mechanism (``sglang_evict.passes.manager``) calls these; the state they read and update
is its ``states`` dict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sglang_evict.config import EvictionConfig
from sglang_evict.passes.batch.counts import BatchCounts, batch_pass_counts
from sglang_evict.passes.state import DueRequest, PassResult, RequestState
from sglang_evict.request_policy import RequestPolicy


@dataclass
class PassWork:
    """The requests one pass covers as columns: ``due[i]``, its resolved policy
    ``policies[i]``, its counts (row ``i`` of ``counts``), request-pool row
    ``rows[i]`` and ``compacted_lens[i]`` (``RequestState.compacted_len``, 0 before a
    first pass); and whether the pass captured a CUDA graph (a one-off cost that
    ``--kv-pass-group-steps auto`` leaves out of its measurement)."""

    due: list[DueRequest]
    policies: list[RequestPolicy]
    counts: BatchCounts
    rows: np.ndarray
    compacted_lens: np.ndarray
    captured: bool = False

    def take(self, index: list[int]) -> PassWork:
        """The requests at ``index``, in that order."""
        return PassWork(
            due=[self.due[i] for i in index],
            policies=[self.policies[i] for i in index],
            counts=self.counts.take(index),
            rows=self.rows[index],
            compacted_lens=self.compacted_lens[index],
        )


def pass_work(
    due: Sequence[DueRequest],
    states: dict[str, RequestState],
    default_policy: RequestPolicy,
    config: EvictionConfig,
) -> PassWork:
    """``due`` as columns, with each request's counts (``EvictionManager.counts`` of
    each, as arrays); a request without a policy takes ``default_policy``."""
    policies = [d.policy or default_policy for d in due]
    get = states.get
    values = []
    for d, p in zip(due, policies, strict=True):
        state = get(d.rid)  # d[1:5]: req_pool_idx, kv_len, num_shared, prompt_len
        if state is None:
            values.append((*d[1:5], p.kv_budget_tokens, 0, 0))
        else:
            values.append((*d[1:5], p.kv_budget_tokens, state.position_offset, state.compacted_len))
    columns = np.array(values, dtype=np.int64).reshape(len(due), 7).T
    rows, kv_len, num_shared, prompt_len, budget, offset, compacted = columns

    def count(budget):
        return batch_pass_counts(
            kv_len=kv_len,
            position_offset=offset,
            num_shared=num_shared,
            prompt_len=prompt_len,
            budget=budget,
            page_size=config.page_size,
            sink_tokens=config.sink_tokens,
            protected_tokens=config.protected_tokens,
            window_tokens=config.window_tokens,
            evict_prompt=config.evict_prompt,
        )

    counts = count(budget)
    if config.tier_bits is not None:
        # Under a tier the cold tokens leave in whole groups; the ``cold % G`` left
        # over wait in full precision (``sglang_evict.tier.policy``): the budget that
        # keeps exactly those too, so survivors = survivors + waiting.
        tiered = np.array([p.tier_tokens > 0 for p in policies], dtype=bool)
        waiting = (counts.kv_len - counts.survivors) % config.tier_group_tokens * tiered
        if waiting.any():
            counts = count(counts.survivors + waiting)
    return PassWork(list(due), policies, counts, rows, compacted)


def check_rows(work: PassWork, num_request_rows: int, row_capacity: int) -> None:
    """Refuse a pass naming a row outside the request pool or longer than a row."""
    rows, kv_len = work.rows, work.counts.kv_len
    if rows.min() < 0 or rows.max() >= num_request_rows:  # the error path finds which
        bad = rows[(rows < 0) | (rows >= num_request_rows)][0]
        raise ValueError(
            f"req_pool_idx {int(bad)} outside the request pool [0, {num_request_rows})"
        )
    if kv_len.max() > row_capacity:
        raise ValueError(f"kv_len {int(kv_len.max())} exceeds the row capacity {row_capacity}")


def commit_states(states: dict[str, RequestState], work: PassWork) -> None:
    """Each request's host state after its pass (created at its first)."""
    counts = work.counts
    get = states.get
    for (rid, row, _, num_shared, prompt_len, _), policy, kv_len, survivors, offset in zip(
        work.due,
        work.policies,
        counts.kv_len.tolist(),
        counts.survivors.tolist(),
        (counts.next_position - counts.survivors).tolist(),
        strict=True,
    ):
        state = get(rid)
        if state is None:
            states[rid] = RequestState(
                row,
                survivors,
                offset,
                num_shared,
                prompt_len,
                1,
                kv_len - survivors,
                policy,
                kv_len,
            )
            continue
        state.req_pool_idx = row
        state.compacted_len = survivors
        state.position_offset = offset
        state.num_shared = num_shared
        state.prompt_len = prompt_len
        state.num_passes += 1
        state.tokens_evicted += kv_len - survivors
        state.policy = policy
        if kv_len > state.peak_kv_tokens:
            state.peak_kv_tokens = kv_len


def pass_results(
    work: PassWork, scorers: list, strategy: str, copies, duration_s: float, bytes_per_slot: int
) -> list[PassResult]:
    """One ``PassResult`` per request of ``work`` (``copies``: the batch's slot copies
    per request, on the device)."""
    counts = work.counts
    over_budget = (counts.num_protected > counts.budget).tolist()
    return [
        PassResult(
            d.rid,
            kv_len,
            survivors,
            freed,
            strategy,
            over,
            duration_s,
            copies,
            i,
            bytes_per_slot,
            scorer.name,
            budget,
        )
        for i, (d, scorer, kv_len, survivors, freed, over, budget) in enumerate(
            zip(
                work.due,
                scorers,
                counts.kv_len.tolist(),
                counts.survivors.tolist(),
                counts.pages_freed.tolist(),
                over_budget,
                counts.budget.tolist(),
                strict=True,
            )
        )
    ]
