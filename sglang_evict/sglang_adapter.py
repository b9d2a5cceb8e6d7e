"""The one module that touches SGLang internals.

Written against SGLang ``SGLANG_VERSION_TARGET`` (0.5.17, the newest release pinning
torch 2.11, the lent GPU's torch). Internals move between releases (0.5.23 replaced
``cache_finished_req``/``cache_unfinished_req`` with a checkpoint API), so everything
the plugin needs from SGLang goes through here, and ``check_sglang_version`` refuses to
load the plugin against any other version.

What it provides:
    ``SGLangPoolAccess``    the mechanism's ``KVPoolAccess`` over SGLang's
                            ``ReqToTokenPool``, token/paged allocator and
                            ``MHATokenToKVPool``.
    ``EvictingRadixCache``  SGLang's ``RadixCache`` plus an ``EvictionManager``; a
                            finished request with evicted tokens inserts only its intact
                            prefix, so compacted KV is never offered as a prefix.
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version

import torch
from torch import Tensor

SGLANG_VERSION_TARGET = "0.5.17"
logger = logging.getLogger(__name__)


def installed_sglang_version() -> str | None:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def check_sglang_version(installed: str | None = None) -> None:
    """Raise ``RuntimeError`` unless the installed SGLang is the targeted release."""
    installed = installed if installed is not None else installed_sglang_version()
    if installed is None:
        raise RuntimeError(
            f"sglang-evict needs SGLang {SGLANG_VERSION_TARGET}, but SGLang is not installed; "
            f'install it with: pip install "sglang=={SGLANG_VERSION_TARGET}"'
        )
    if installed != SGLANG_VERSION_TARGET:
        raise RuntimeError(
            f"sglang-evict {__package__} was written against SGLang {SGLANG_VERSION_TARGET}, "
            f"found {installed}; its internals differ between releases. Install "
            f'"sglang=={SGLANG_VERSION_TARGET}" or an sglang-evict release for {installed}.'
        )


# Imports of SGLang internals stay below the version check's definition; importing this
# module requires SGLang (the plugin's entry point checks the version first).
from sglang.srt.mem_cache.base_prefix_cache import InsertParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode  # noqa: E402

from compactor_service.compactor import Compactor, InProcessCompactor  # noqa: E402
from sglang_evict.config import EvictionConfig  # noqa: E402
from sglang_evict.evictor import EvictionManager, PassResult  # noqa: E402


class SGLangPoolAccess:
    """``KVPoolAccess`` over SGLang's request-to-token pool, allocator and MHA KV pool."""

    def __init__(self, req_to_token_pool, allocator, kv_pool) -> None:
        if not isinstance(kv_pool, MHATokenToKVPool):
            raise ValueError(
                f"sglang-evict supports MHA KV pools (MHATokenToKVPool); this model uses "
                f"{type(kv_pool).__name__} (MLA, hybrid SWA/linear and quantised FP4/MXFP8 "
                f"pools are not supported yet)"
            )
        if (
            getattr(kv_pool, "use_hnd", False)
            or getattr(kv_pool, "kv_cache_layout", "nhd") != "nhd"
        ):
            raise ValueError(
                "sglang-evict supports the default NHD KV layout only; unset "
                "SGLANG_USE_HND_KVCACHE and any kv_cache_layout override"
            )
        self.req_to_token = req_to_token_pool.req_to_token
        self.allocator = allocator
        self.kv_pool = kv_pool
        self.page_size = allocator.page_size

    @property
    def k_buffers(self) -> list[Tensor]:
        return list(self.kv_pool.k_buffer)

    @property
    def v_buffers(self) -> list[Tensor]:
        return list(self.kv_pool.v_buffer)

    def read_row(self, req_pool_idx: int, length: int) -> Tensor:
        return self.req_to_token[req_pool_idx, :length].to("cpu", torch.int64)

    def write_row(self, req_pool_idx: int, row: Tensor) -> None:
        self.req_to_token[req_pool_idx, : row.numel()] = row.to(
            self.req_to_token.device, torch.int32
        )

    def gather_keys(self, slots: Tensor) -> Tensor:
        pool = self.kv_pool
        slots = slots.to(pool.device)
        layers = []
        for buffer in pool.k_buffer:
            keys = buffer.index_select(0, slots)
            if pool.store_dtype != pool.dtype:  # fp8 stored as uint8
                keys = keys.view(pool.dtype)
            layers.append(keys.float())
        return torch.stack(layers)

    def alloc_pages(self, num_pages: int) -> Tensor | None:
        slots = self.allocator.alloc(num_pages * self.page_size)
        if slots is None:
            return None
        return (slots[:: self.page_size] // self.page_size).to("cpu", torch.int64)

    def free_pages(self, pages: Tensor) -> None:
        if pages.numel():
            self.allocator.free((pages * self.page_size).to(self.allocator.device))


def make_manager(
    config: EvictionConfig, params: CacheInitParams, compactor: Compactor | None = None
) -> EvictionManager:
    """An ``EvictionManager`` over the pools a radix cache is built with."""
    allocator = params.token_to_kv_pool_allocator
    pool = SGLangPoolAccess(params.req_to_token_pool, allocator, allocator.get_kvcache())
    if compactor is None:
        compactor = InProcessCompactor(pool.k_buffers, pool.v_buffers)
    return EvictionManager(config=config, pool=pool, compactor=compactor)


class EvictingRadixCache(RadixCache):
    """SGLang's radix cache, aware of requests whose KV was evicted and compacted.

    Invariants (``check_invariants`` verifies them; tests call it after every operation):
        * ``evictable_size_`` equals the tokens of unlocked nodes and ``protected_size_``
          those of locked nodes (SGLang's own accounting, recomputed from the tree);
        * a locked node's ancestors are locked (a locked node is never partially
          evictable);
        * no slot held by the tree is free in the allocator;
        * no request with evicted tokens inserts KV past its intact prefix: the
          tree maps token prefixes only to KV computed for exactly those tokens.
    """

    def __init__(self, params: CacheInitParams, config: EvictionConfig) -> None:
        super().__init__(params)
        self.evictor = make_manager(config, params)

    def cache_finished_req(self, req, is_insert: bool = True, *, kv_len_to_handle: int):
        state = self.evictor.states.get(req.rid)
        if state is None or self.disable:
            return super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle)
        try:
            self._cache_finished_evicted_req(req, is_insert, kv_len_to_handle)
        finally:
            self.evictor.forget(req.rid)

    def _cache_finished_evicted_req(self, req, is_insert: bool, kv_len: int) -> None:
        """Insert at most the intact prefix (up to the first entry whose KV no longer
        matches its token), free everything else the request holds."""
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
        return super().cache_unfinished_req(req, chunked=chunked)

    def check_invariants(self) -> None:
        evictable, protected = 0, 0
        tree_slots: list[Tensor] = []
        stack: list[TreeNode] = [self.root_node]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is self.root_node:
                continue
            if node.lock_ref < 0:
                raise AssertionError(f"node {node.id} has lock_ref {node.lock_ref}")
            if node.lock_ref > 0:
                protected += len(node.key)
                parent = node.parent
                if parent is not self.root_node and parent.lock_ref < node.lock_ref:
                    raise AssertionError(f"node {node.id} is locked more than its parent")
            else:
                evictable += len(node.key)
            if node.value is not None and len(node.value):
                tree_slots.append(node.value.to("cpu", torch.int64))
        if evictable != self.evictable_size_ or protected != self.protected_size_:
            raise AssertionError(
                f"tree accounting: evictable {self.evictable_size_} (tree says {evictable}), "
                f"protected {self.protected_size_} (tree says {protected})"
            )
        if tree_slots:
            slots = torch.cat(tree_slots)
            if torch.unique(slots).numel() != slots.numel():
                raise AssertionError("a slot is held by two tree nodes")
            free = free_slots(self.token_to_kv_pool_allocator)
            if torch.isin(slots, free).any():
                raise AssertionError("a slot held by the tree is free in the allocator")


def free_slots(allocator) -> Tensor:
    """int64 CPU tensor of every slot the allocator considers free."""
    pages = torch.cat([allocator.free_pages, allocator.release_pages]).to("cpu", torch.int64)
    if allocator.page_size == 1:
        return pages
    offsets = torch.arange(allocator.page_size, dtype=torch.int64)
    return (pages[:, None] * allocator.page_size + offsets).reshape(-1)


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
