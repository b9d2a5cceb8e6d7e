"""What differs between the SGLang releases the plugin supports (0.5.17 and 0.5.23),
in one place; every other module of ``sglang_evict.srt`` asks here.

    what                          0.5.17                       0.5.23
    a request's KV bookkeeping    req.req_pool_idx,            req.kv.req_pool_idx,
                                  req.kv_committed_len,        req.kv.kv_committed_len,
                                  req.cache_protected_len,     req.kv.cache_protected_len,
                                  req.kv.kv_allocated_len      req.kv.kv_allocated_len
    a waiting request's matched   len(req.prefix_indices)      req.prefix_len
    prefix
    the allocator's free pages    free_pages + release_pages   get_all_free_pages() (free
                                                               + staged until merged)
    freeing distinct page ids     _release_page_ids / the      free_page_ids
                                  open free group
    PrefillAdder's reservation    rem_total_token_offset       memory_budget.total_offset
    KVCacheConfigurator's         configurator.ps              runtime_context.get_parallel()
    attention TP size

``req_kv(req)`` hands out the object holding the four KV fields (the request itself
behind a small view on 0.5.17, ``req.kv`` on 0.5.23), so callers read and write
``req_kv(req).kv_committed_len`` alike on both. The radix cache's request lifecycle,
which changed most (0.5.17: ``cache_unfinished_req`` / ``cache_finished_req``; 0.5.23:
``checkpoint`` on a running or finished request, then ``on_release`` after every
release: finish, retraction or abort), is ``RequestLifecycle`` below: one method set per
release, selected by ``IS_0_5_23``, mixed into ``backend.EvictingRadixCache``.
"""

from __future__ import annotations

from importlib.metadata import version

import torch
from torch import Tensor

SGLANG_VERSION = version("sglang")
IS_0_5_23 = SGLANG_VERSION == "0.5.23"


class _ReqKv0517:
    """0.5.17: the request's own KV fields, named as 0.5.23's ``req.kv`` names them."""

    __slots__ = ("_req",)

    def __init__(self, req) -> None:
        self._req = req

    @property
    def req_pool_idx(self):
        return self._req.req_pool_idx

    @req_pool_idx.setter
    def req_pool_idx(self, value) -> None:
        self._req.req_pool_idx = value

    @property
    def kv_committed_len(self) -> int:
        return self._req.kv_committed_len

    @kv_committed_len.setter
    def kv_committed_len(self, value: int) -> None:
        self._req.kv_committed_len = value

    @property
    def cache_protected_len(self) -> int:
        return self._req.cache_protected_len

    @property
    def kv_allocated_len(self) -> int:
        return self._req.kv.kv_allocated_len

    @kv_allocated_len.setter
    def kv_allocated_len(self, value: int) -> None:
        self._req.kv.kv_allocated_len = value


def req_kv(req):
    """The holder of ``req``'s ``req_pool_idx``, ``kv_committed_len``,
    ``cache_protected_len`` and ``kv_allocated_len``."""
    return req.kv if IS_0_5_23 else _ReqKv0517(req)


def _kv_lengths_0523(req) -> tuple[int, int, int, int]:
    kv = req.kv
    return kv.req_pool_idx, kv.kv_committed_len, kv.cache_protected_len, kv.kv_allocated_len


def _kv_lengths_0517(req) -> tuple[int, int, int, int]:
    return req.req_pool_idx, req.kv_committed_len, req.cache_protected_len, req.kv.kv_allocated_len


def _set_kv_len_0523(req, num_tokens: int) -> None:
    kv = req.kv
    kv.kv_committed_len = kv.kv_allocated_len = num_tokens


def _set_kv_len_0517(req, num_tokens: int) -> None:
    req.kv_committed_len = req.kv.kv_allocated_len = num_tokens


# ``(req_pool_idx, kv_committed_len, cache_protected_len, kv_allocated_len)`` of a
# request, read without ``req_kv``'s view object: the decode step's due check reads
# them for every running request at every step.
kv_lengths = _kv_lengths_0523 if IS_0_5_23 else _kv_lengths_0517
# ``set_kv_len(req, n)``: committed and allocated KV lengths both ``n`` (a pass's
# survivors), without the view object.
set_kv_len = _set_kv_len_0523 if IS_0_5_23 else _set_kv_len_0517


def matched_prefix_len(req) -> int:
    """Tokens of a waiting request's prompt matched in the radix tree."""
    return req.prefix_len if IS_0_5_23 else len(req.prefix_indices)


def free_page_ids(allocator) -> Tensor:
    """int64 CPU tensor of every page id (slot at page size 1) the allocator holds free,
    including pages freed but not merged into its free list yet (0.5.17:
    ``release_pages``; 0.5.23's paged allocator: ``staged_pages``)."""
    if IS_0_5_23:
        pages = allocator.get_all_free_pages()
    else:
        pages = torch.cat([allocator.free_pages, allocator.release_pages])
    return pages.to("cpu", torch.int64)


def give_back_pages(allocator, pages: Tensor) -> None:
    """Return distinct page ids (slots at page size 1) to the allocator without a host
    synchronisation: ``free`` of a paged allocator runs ``torch.unique`` (a
    data-dependent shape), which the pass's distinct ids do not need. 0.5.23 has
    ``free_page_ids`` for exactly this; 0.5.17 takes them the way its ``free`` would
    put them on the free list (``_release_page_ids``, or the open free group)."""
    pages = pages.to(allocator.device)
    if allocator.page_size == 1:
        allocator.free(pages)  # a concatenation on both releases
    elif IS_0_5_23:
        allocator.free_page_ids(pages)
    elif allocator.is_not_in_free_group:
        allocator._release_page_ids(pages)
    else:
        allocator.free_page_reps_group.append(pages * allocator.page_size)


def admission_offset(adder) -> float:
    """What a ``PrefillAdder`` holds back for admitted and running requests."""
    return adder.memory_budget.total_offset if IS_0_5_23 else adder.rem_total_token_offset


def add_to_admission_offset(adder, tokens: float) -> None:
    """Add to what a ``PrefillAdder`` holds back for admitted and running requests
    (0.5.17: ``rem_total_token_offset``; 0.5.23: ``memory_budget.total_offset``)."""
    if IS_0_5_23:
        adder.memory_budget.total_offset += tokens
    else:
        adder.rem_total_token_offset += tokens


def attention_tp_size(configurator) -> int:
    """The attention TP size a ``KVCacheConfigurator`` sizes the pool for (0.5.17: its
    ``ps``; 0.5.23: the process's parallel context)."""
    if IS_0_5_23:
        from sglang.srt.runtime_context import get_parallel

        return get_parallel().attn_tp_size
    return configurator.ps.attn_tp_size


def decode_cuda_graphs_off(server_args) -> bool:
    """Whether SGLang's decode CUDA graphs are off: ``--disable-cuda-graph`` on both
    releases; on 0.5.23 also ``--cuda-graph-backend-decode disabled``, which leaves
    ``disable_cuda_graph`` False."""
    if getattr(server_args, "disable_cuda_graph", False):
        return True
    return IS_0_5_23 and getattr(server_args, "cuda_graph_backend_decode", None) == "disabled"


# --- the radix cache's request lifecycle -------------------------------------------------


def _keeps_prompt_private(cache) -> bool:
    """``--kv-evict-prompt``: the unshared prompt stays the request's own (as SGLang
    keeps a partial page), not offered to other requests, so passes may evict it."""
    return cache.evictor.config.evict_prompt and not cache.disable


class _Lifecycle0517:
    """0.5.17: ``cache_unfinished_req`` after a prefill, ``cache_finished_req`` at every
    release (finish, retraction, abort)."""

    def cache_finished_req(self, req, is_insert: bool = True, *, kv_len_to_handle: int):
        self.settle_request(req)  # the backend's: the request's report, before its state goes
        state = self.evictor.states.get(req.rid)
        try:
            if state is None or self.disable:
                return super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle)
            self._cache_finished_evicted_req(req, is_insert, kv_len_to_handle)
        finally:
            # Always: a request whose passes all failed has no state, but its failures
            # are counted (its backoff and report) until it goes.
            self.evictor.forget(req.rid)

    def _cache_finished_evicted_req(self, req, is_insert: bool, kv_len: int) -> None:
        """Insert at most the intact prefix (up to the first entry whose KV no longer
        matches its token), free everything else the request holds."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        if self.disable_finished_insert:
            is_insert = False
        intact = self.evictor.intact_prefix_len(req.rid, kv_len)
        token_ids = (req.origin_input_ids + req.output_ids)[:intact]
        kv_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, :kv_len]
        radix_key = RadixKey(token_ids, req.extra_key, is_bigram=self.is_eagle).page_aligned(
            self.page_size
        )
        key_len = len(radix_key)
        values = kv_indices[:key_len].to(dtype=torch.int64, copy=True)
        if is_insert:
            priority = getattr(req, "priority", 0) or 0
            result = self.insert(InsertParams(key=radix_key, value=values, priority=priority))
            freed_end = result.prefix_len
        else:
            freed_end = key_len
        # The frozen shared prefix is intact, so key_len >= cache_protected_len.
        self.token_to_kv_pool_allocator.free_segments(
            [
                (kv_indices[req.cache_protected_len : freed_end], req.cache_protected_len),
                (kv_indices[key_len:], key_len),
            ]
        )
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req, chunked: bool = False):
        if req.rid in self.evictor.states:
            # An evicted request's row no longer matches its tokens: insert nothing more.
            return
        if _keeps_prompt_private(self):
            # The KV SGLang counts as the request's is what lies past cache_protected_len.
            fill_len = len(req.get_fill_ids())
            row = self.req_to_token_pool.req_to_token[req.req_pool_idx, :fill_len]
            req.prefix_indices = row.to(dtype=torch.int64, copy=True)
            return
        return super().cache_unfinished_req(req, chunked=chunked)


class _Lifecycle0523:
    """0.5.23: ``checkpoint`` publishes a running request's prefill and, once finished,
    its final insert (``release_kv_cache`` then frees the rest of the row); ``on_release``
    follows every release (finish, retraction, abort)."""

    def checkpoint(self, req, *, up_to: int, **kwargs):
        tracked = req.rid in self.evictor.states
        if not req.finished():
            if tracked or _keeps_prompt_private(self):
                # An evicted request's row no longer matches its tokens (or its prompt
                # stays its own): insert nothing; release frees the row past the prefix.
                return None
            return super().checkpoint(req, up_to=up_to, **kwargs)
        if tracked and not self.disable:
            # At most the intact prefix: up to the first entry whose KV no longer
            # matches its token. The frozen shared prefix is intact.
            up_to = min(up_to, self.evictor.intact_prefix_len(req.rid, req.kv.kv_committed_len))
        return super().checkpoint(req, up_to=up_to, **kwargs)

    def on_release(self, req, *, checkpointed: bool) -> None:
        self.settle_request(req)  # the backend's: the request's report, before its state goes
        self.evictor.forget(req.rid)
        return super().on_release(req, checkpointed=checkpointed)


RequestLifecycle = _Lifecycle0523 if IS_0_5_23 else _Lifecycle0517


# --- the scheduler's calls, as ``cpu_driver.MemoryDriver`` makes them ----------------------


def adopt_prefix(cache, req, prefix: Tensor, last_node) -> None:
    """A waiting request takes its matched prefix and locks its tree path (0.5.17:
    ``prefix_indices`` and ``inc_lock_ref``; 0.5.23: ``prefix_len`` and a ``TreeLock``)."""
    if IS_0_5_23:
        req.prefix_len = len(prefix)
        req.last_node = last_node
        req.kv.cache_protected_len = len(prefix)
        req.lock = cache.lock(last_node)
    else:
        req.prefix_indices, req.last_node = prefix, last_node
        req.cache_protected_len = len(prefix)
        cache.inc_lock_ref(last_node)


def set_prefilled(req, num_tokens: int) -> None:
    """The request's row holds ``num_tokens`` computed entries (committed, allocated)."""
    if IS_0_5_23:
        req.kv.kv_committed_len = req.kv.kv_allocated_len = num_tokens
    else:
        from sglang.srt.managers.schedule_batch import ReqKvInfo

        req.kv_committed_len = num_tokens
        req.kv = ReqKvInfo(kv_allocated_len=num_tokens, swa_evicted_seqlen=0)


def publish_prefill(req, cache) -> None:
    """After the prefill: the prompt enters the tree (0.5.17 ``maybe_cache_unfinished_req``,
    0.5.23 ``checkpoint_kv_cache``)."""
    kv = req_kv(req)
    if IS_0_5_23:
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        req.refresh_fill_ids()
        req.extend_end = kv.kv_committed_len  # this round extended [prefix_len, here)
        checkpoint_kv_cache(req, cache)
    else:
        from sglang.srt.mem_cache.common import maybe_cache_unfinished_req

        req._refresh_fill_ids()
        req.set_extend_range(len(req.prefix_indices), kv.kv_committed_len)
        maybe_cache_unfinished_req(req, cache)


def advance_after_decode_alloc(reqs) -> None:
    """What ``prepare_for_decode`` advances per request once the decode slots are
    allocated (0.5.23's ``alloc_for_decode`` advances the KV lengths itself)."""
    for req in reqs:
        req.decode_batch_idx += 1
        if not IS_0_5_23:
            req.kv_committed_len += 1


def release(req, cache, *, insert: bool) -> None:
    """``release_kv_cache``: at a finish (``insert``: the tree keeps what it can) or a
    retraction / abort (nothing inserted)."""
    from sglang.srt.mem_cache.common import release_kv_cache

    if IS_0_5_23:
        release_kv_cache(req, cache, checkpoint=insert)
    else:
        release_kv_cache(req, cache, is_insert=insert)


def match_prefix(cache, tokens, extra_key: str | None = None) -> tuple[Tensor, object]:
    """``(KV slots of the matched prefix, the node it ends on)`` for ``tokens`` (0.5.17's
    match result carries the slots; 0.5.23's a length, the slots lie on the path)."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), extra_key)))
    if IS_0_5_23:
        path = cache.path_device_indices(match.last_device_node)
        return path[: match.device_prefix_len], match.last_device_node
    return match.device_indices, match.last_device_node


# The modules whose ``get_device_memory_capacity`` SGLang's argument parsing calls to
# pick its memory defaults (``server_args._device_memory_mib`` stands in a GPU's size).
DEVICE_MEMORY_READERS = (
    (
        "sglang.srt.arg_groups.memory_hook",
        "sglang.srt.arg_groups.kv_shard_hook",
        "sglang.srt.arg_groups.model_overrides.qwen3_vl",
    )
    if IS_0_5_23
    else ("sglang.srt.server_args",)
)
