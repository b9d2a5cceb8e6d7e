"""The ``HookRegistry`` callbacks: due passes before SGLang allocates a decode step's
slots, and each request's position offset added to the decode positions."""

from __future__ import annotations

import logging

import torch

from sglang_evict.evictor import EvictionManager, PassResult
from sglang_evict.srt.backend import EvictingRadixCache, _Active
from sglang_evict.srt.introspection import log_pass, log_passes_enabled

logger = logging.getLogger(__name__)

HOOK_PREPARE_FOR_DECODE = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode"
HOOK_FORWARD_BATCH_INIT = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"


def run_pass_for_req(manager: EvictionManager, req) -> PassResult | None:
    """Run a pass for one running request if its KV reached the trigger, and shrink the
    request's KV bookkeeping to the survivors (what the decode hook does per request).

    ``req.kv_committed_len`` is the request's KV length (all of it written: the caller
    has waited for any in-flight forward). Afterwards ``kv_committed_len`` and
    ``kv.kv_allocated_len`` equal the survivor count; the token lists are untouched.
    """
    kv_len = req.kv_committed_len
    if not manager.needs_pass(kv_len):
        return None
    if req.kv.kv_allocated_len != kv_len:
        raise RuntimeError(
            f"request {req.rid}: {req.kv.kv_allocated_len} KV slots allocated for {kv_len} "
            f"committed; over-allocation (speculative decoding) is not supported"
        )
    result = manager.run_pass(
        req.rid,
        req.req_pool_idx,
        kv_len,
        num_shared=req.cache_protected_len,
        prompt_len=len(req.origin_input_ids),
    )
    if result is not None:
        req.kv_committed_len = result.tokens_after
        req.kv.kv_allocated_len = result.tokens_after
    return result


def _wait_for_inflight_forward(device) -> None:
    """Scoring reads, and compaction moves, KV that the previous (overlapped) forward
    may still be writing: wait for the device first. A full synchronize, paid once per
    pass (every cadence tokens per request), not per decode step."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def compact_decode_batch(manager: EvictionManager, batch) -> list[PassResult]:
    """Run due passes for a decode batch and shrink its KV lengths (the work of the
    ``prepare_for_decode`` hook, before SGLang allocates the decode slots).

    A request is compacted only from its second decode step on: under the overlap
    scheduler its prompt enters the radix tree (``cache_unfinished_req``) after the
    first decode batch is launched. Batch length tensors are replaced, never edited in
    place: the in-flight forward still reads the old ones.
    """
    reqs = batch.reqs
    due = [
        i
        for i, req in enumerate(reqs)
        if req.decode_batch_idx >= 1 and manager.needs_pass(req.kv_committed_len)
    ]
    if not due:
        return []
    _wait_for_inflight_forward(batch.seq_lens.device)
    shrink = torch.zeros(len(reqs), dtype=torch.int64)
    results = []
    log_lines = log_passes_enabled()
    free_slots_before = manager.pool.allocator.available_size() if log_lines else 0
    logged = []
    for i in due:
        try:
            result = run_pass_for_req(manager, reqs[i])
        except (ValueError, RuntimeError) as error:
            # Validation failed before any byte moved: serve on with the full KV.
            logger.error("sglang-evict: pass for request %s failed: %s", reqs[i].rid, error)
            _Active.totals.pass_failures += 1
            if _Active.metrics is not None:
                _Active.metrics.record_failure(manager.config.compaction)
            continue
        if result is None:
            continue
        shrink[i] = result.tokens_evicted
        results.append(result)
        if log_lines:
            logged.append(
                {
                    "rid": reqs[i].rid,
                    "tokens_before": result.tokens_before,
                    "tokens_after": result.tokens_after,
                    "pages_freed": result.pages_freed,
                }
            )
        if _Active.metrics is not None:
            _Active.metrics.record(result, manager.config.kv_budget_tokens)
    if _Active.metrics is not None:
        _Active.metrics.record_compactor(manager.compactor)
    _Active.totals.add(results)
    if logged:
        log_pass(logged, free_slots_before, manager.pool.allocator.available_size())
    if results:
        # New tensors of the same device and dtype (orig_seq_lens is int32).
        for name in ("seq_lens", "seq_lens_cpu", "orig_seq_lens"):
            lengths = getattr(batch, name)
            if lengths is not None:
                setattr(batch, name, lengths - shrink.to(lengths.device, lengths.dtype))
        batch.seq_lens_sum = None
    return results


def _before_prepare_for_decode(batch, *args, **kwargs):
    cache = batch.tree_cache
    if isinstance(cache, EvictingRadixCache) and batch.spec_algorithm.is_none():
        compact_decode_batch(cache.evictor, batch)
    return None  # arguments unchanged


def _after_forward_batch_init_new(forward_batch, *args, **kwargs):
    manager = _Active.manager
    if manager is not None and forward_batch.forward_mode.is_decode():
        forward_batch.positions = manager.decode_positions(
            forward_batch.req_pool_indices, forward_batch.seq_lens
        ).to(forward_batch.positions.device)
    return forward_batch
