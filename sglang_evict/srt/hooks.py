"""The ``HookRegistry`` callbacks: one batched pass before SGLang allocates a decode
step's slots, and each request's position offset added to the decode positions.

Order of a decode step (``ScheduleBatch.prepare_for_decode``, on the scheduler's
current stream: ``schedule_stream`` under the overlap loop) and why the pass can never
read KV the overlapped forward is still writing, nor overwrite KV it is still reading::

    host (scheduler)                             device
    forward N launched on forward_stream  ---->  forward N: writes the KV of the token
                                                 at row index kv_len-1 of each request,
                                                 reads every row
    prepare_for_decode of step N+1
      BEFORE hook: compact_decode_batch
        due requests, counts (host ints)
        schedule_stream.wait_stream(        ---> schedule_stream: waits for forward N
            forward_stream)                      (the host does not wait)
        run_batch_pass                      ---> scores, plans, moves, commits rows,
                                                 positions, frees pages: after forward N
        shrink kv_committed_len, seq_lens*
      alloc_for_decode (seq_lens = survivors) -> new slot at row index `survivors`, from
                                                 a free list holding the freed pages
      seq_lens + 1
    forward N+1 launched: forward_stream.wait_stream(schedule_stream)
      ForwardBatch.init_new AFTER hook: positions = seq_lens - 1 + offset[row]
      (extend batches: the query ring's rows of new requests reset, ``capture``)

Every byte the pass reads or writes is ordered after forward N by the device-side wait,
and every later forward after the pass by SGLang's own ``wait_stream`` at launch: so
the newest token's KV is written before it is scored or moved, and no slot forward N
reads (evicted slots are move destinations) is overwritten under it. Freed pages reach
the allocator's free list on the same stream, so any later allocation's writes come
after the moves that emptied them. A request is compacted only from its second decode
step on: under the overlap scheduler its prompt enters the radix tree
(``cache_unfinished_req``) after the first decode batch is launched. Batch length
tensors are replaced, never edited in place: the in-flight forward still reads the old
ones. ``tests/test_batch_pass_hooks.py`` pins this order on CPU.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from sglang_evict.passes.failures import classify
from sglang_evict.passes.manager import DueRequest, EvictionManager, PassResult
from sglang_evict.srt.active import Active
from sglang_evict.srt.backend import EvictingRadixCache
from sglang_evict.srt.capture import on_forward_batch
from sglang_evict.srt.introspection import (
    kept_record,
    log_kept_enabled,
    log_pass,
    log_passes_enabled,
)
from sglang_evict.srt.request_policy import policy_of
from sglang_evict.srt.versioned import kv_lengths, set_kv_len
from sglang_evict_kernels import to_device

logger = logging.getLogger(__name__)

HOOK_PREPARE_FOR_DECODE = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode"
HOOK_FORWARD_BATCH_INIT = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"


def due_requests(manager: EvictionManager, reqs) -> list[tuple[int, DueRequest]]:
    """``(batch index, DueRequest)`` of the requests whose pass is due (O(1) each, no
    object per request that is not due: this runs for every running request at every
    pass step), each under its own policy (``sglang_evict.srt.request_policy``)."""
    due = []
    is_due, default = manager.is_due, manager.default_policy
    for i, req in enumerate(reqs):
        if not passable(req):
            continue
        policy = policy_of(req)
        row, kv_len, num_shared, allocated = kv_lengths(req)
        resolved = policy or default
        # is_due's own first test, here: a request between two passes costs no call.
        if kv_len < resolved.kv_budget_tokens + resolved.cadence_tokens:
            continue
        prompt_len = len(req.origin_input_ids)
        if not is_due(req.rid, kv_len, num_shared, prompt_len, policy):
            continue
        if allocated == kv_len or supported_allocation(req):
            due.append((i, DueRequest(req.rid, row, kv_len, num_shared, prompt_len, policy)))
    return due


def passable(req) -> bool:
    """Whether a pass may compact ``req`` at all now: from its second decode step on
    (under the overlap scheduler its prompt enters the radix tree after the first)."""
    return req.decode_batch_idx >= 1


def supported_allocation(req) -> bool:
    """False (and logged) for a request holding more slots than committed tokens."""
    _, committed, _, allocated = kv_lengths(req)
    if allocated == committed:
        return True
    logger.error(
        "sglang-evict: request %s has %d KV slots allocated for %d committed; "
        "over-allocation (speculative decoding) is not supported: no pass",
        req.rid,
        allocated,
        committed,
    )
    return False


def due_request(req, policy) -> DueRequest:
    row, kv_len, num_shared, _ = kv_lengths(req)
    return DueRequest(req.rid, row, kv_len, num_shared, len(req.origin_input_ids), policy)


def compact_decode_batch(manager: EvictionManager, batch) -> list[PassResult]:
    """Run the decode step's pass for every due request of ``batch`` and shrink the
    requests' and the batch's KV lengths to the survivors (the ``prepare_for_decode``
    hook's work, before SGLang allocates the decode slots; see the module docstring).

    A pass that fails before anything moved is logged and skipped: the requests keep
    their full KV. Afterwards ``kv_committed_len`` and ``kv.kv_allocated_len`` of each
    compacted request equal its survivors; token lists are untouched. With
    ``pass_group_steps`` > 1 only every that many-th step runs passes (the others cost
    one counter increment).
    """
    if not manager.open_pass_step():
        return []
    return run_passes(manager, batch, due_requests(manager, batch.reqs))


def run_passes(
    manager: EvictionManager, batch, due: list[tuple[int, DueRequest]], *, pressure: bool = False
) -> list[PassResult]:
    """One batched pass over ``due`` (``(batch index, DueRequest)``), then each
    request's and the batch's KV lengths shrunk to the survivors. ``pressure``: passes
    run early because the step cannot allocate (counted apart in the metrics)."""
    if not due:
        return []
    reqs = batch.reqs
    manager.order_after_forward()
    log_lines = log_passes_enabled()
    free_slots_before = manager.pool.allocator.available_size() if log_lines else 0
    try:
        results = manager.run_batch_pass([d for _, d in due])
    except (ValueError, RuntimeError) as error:
        # The manager logged the cause once (with its fix) and backed the requests off.
        logger.debug("sglang-evict: pass for %d request(s) skipped: %s", len(due), error)
        cause, _ = classify(error)
        Active.totals.pass_failures += len(due)
        Active.totals.pass_failure_causes[cause] = (
            Active.totals.pass_failure_causes.get(cause, 0) + 1
        )
        if Active.metrics is not None:
            Active.metrics.record_failure(manager.config.compaction, cause)
            Active.metrics.record_manager(manager)
        return []
    by_rid = {r.rid: r for r in results}
    shrink = np.zeros(len(reqs), dtype=np.int64)
    for i, request in due:
        result = by_rid.get(request.rid)
        if result is None:
            continue
        shrink[i] = result.tokens_evicted
        set_kv_len(reqs[i], result.tokens_after)
    copies = {}  # one copy of the shrink per device and dtype
    for name in ("seq_lens", "seq_lens_cpu", "orig_seq_lens"):
        lengths = getattr(batch, name)
        if lengths is not None:  # a new tensor of the same device and dtype
            key = (lengths.device, lengths.dtype)
            if key not in copies:
                copies[key] = _on(shrink, lengths)
            setattr(batch, name, lengths - copies[key])
    batch.seq_lens_sum = None
    Active.totals.add(results, pressure=pressure)
    if log_lines and results:  # allocator counts are host lengths: no device read
        logged = [
            {
                "rid": r.rid,
                "tokens_before": r.tokens_before,
                "tokens_after": r.tokens_after,
                "pages_freed": r.pages_freed,
                "tokens_demoted": r.tokens_demoted,
            }
            for r in results
        ]
        if log_kept_enabled():
            for entry, r in zip(logged, results, strict=True):
                entry.update(kept_record(manager, r.rid, r.tokens_after))
        free_slots_after = manager.pool.allocator.available_size()
        log_pass(
            logged,
            free_slots_before,
            free_slots_after,
            duration_ms=results[0].duration_s * 1e3,
            decode_step=manager.decode_steps,
            pressure=pressure,
        )
    if Active.metrics is not None:
        duration_s = results[0].duration_s if results else 0.0
        Active.metrics.record_batch(results, duration_s, pressure=pressure)
        Active.metrics.record_manager(manager)
    return results


_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32}


def _on(values: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """``values`` as a tensor of ``like``'s device and dtype, copied without a host wait
    (cast on the host: one copy, no device cast)."""
    dtype = _NUMPY_DTYPES.get(like.dtype)
    if dtype is None:
        host = torch.from_numpy(values).to(like.dtype)
    else:
        host = torch.from_numpy(values.astype(dtype))
    return host if like.device.type == "cpu" else to_device(host, like.device)


def _before_prepare_for_decode(batch, *args, **kwargs):
    cache = batch.tree_cache
    if isinstance(cache, EvictingRadixCache) and batch.spec_algorithm.is_none():
        compact_decode_batch(cache.evictor, batch)
    return None  # arguments unchanged


def _after_forward_batch_init_new(forward_batch, *args, **kwargs):
    manager = Active.manager
    # SGLang's decode positions are seq_lens - 1; a request compacted by a pass adds its
    # offset. While no request has been compacted every offset is 0: nothing to add.
    if manager is not None and manager.states and forward_batch.forward_mode.is_decode():
        forward_batch.positions = manager.shift_positions(
            forward_batch.positions, forward_batch.req_pool_indices
        )
    if manager is not None and manager.query_ring is not None:
        # init_new(cls, batch, model_runner, ...): the extend batch's new rows are reset.
        batch = args[1] if len(args) > 1 else kwargs.get("batch")
        model_runner = args[2] if len(args) > 2 else kwargs.get("model_runner")
        on_forward_batch(forward_batch, batch, model_runner, manager)
    return forward_batch
