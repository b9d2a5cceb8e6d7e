"""``EvictingRadixCache`` (SGLang's radix cache, aware of requests whose KV was evicted
and compacted) and the factory registered as ``--radix-cache-backend sglang-evict``."""

from __future__ import annotations

import logging

import torch
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode
from torch import Tensor

from sglang_evict.config import EvictionConfig
from sglang_evict.srt import capture, tier
from sglang_evict.srt.active import Active, EvictingCache
from sglang_evict.srt.graph_pool import pass_graphs_on
from sglang_evict.srt.introspection import log_passes_enabled, log_request
from sglang_evict.srt.manager import forward_stream_of, make_manager
from sglang_evict.srt.pools import free_slots
from sglang_evict.srt.request_policy import request_limits, settle_report
from sglang_evict.srt.server_args import (
    check_startup,
    config_from_env,
    model_facts_of_context,
    model_warnings,
)
from sglang_evict.srt.tp import TP_REDUCED_SCORERS, tp_score_reducer
from sglang_evict.srt.versioned import RequestLifecycle

logger = logging.getLogger(__name__)


class EvictingRadixCache(EvictingCache, RequestLifecycle, RadixCache):
    """SGLang's radix cache, aware of requests whose KV was evicted and compacted (the
    request lifecycle of the installed release: ``versioned.RequestLifecycle``).

    Invariants (``check_invariants`` verifies them; tests call it after every operation):
        * ``evictable_size_`` equals the tokens of unlocked nodes and ``protected_size_``
          those of locked nodes (SGLang's own accounting, recomputed from the tree);
        * a locked node's ancestors are locked (a locked node is never partially
          evictable);
        * no slot held by the tree is free in the allocator;
        * no request with evicted tokens inserts KV past its intact prefix: the
          tree maps token prefixes only to KV computed for exactly those tokens.
    """

    def settle_request(self, req) -> None:
        """The request's eviction report, before its state goes (SGLang streams the last
        output after the release); the release-specific lifecycle calls it."""
        report = settle_report(req, self.evictor)
        if report is not None and log_passes_enabled():
            log_request(req.rid, report)

    def __init__(self, params: CacheInitParams, config: EvictionConfig) -> None:
        super().__init__(params)
        self.evictor = make_manager(config, params)

    def inc_lock_ref(self, node: TreeNode):
        """SGLang's lock, plus a lease-store pin of the pages of every node that becomes
        locked (a locked node's pages are shared with a running request)."""
        newly_locked = self._path_with_lock_ref(node, 0)
        result = super().inc_lock_ref(node)
        for locked in newly_locked:
            self.evictor.pin_shared_pages(locked.value, pin=True)
        return result

    def dec_lock_ref(self, node: TreeNode, params=None):
        unlocked = self._path_with_lock_ref(node, 1)
        result = super().dec_lock_ref(node, params)
        for released in unlocked:
            self.evictor.pin_shared_pages(released.value, pin=False)
        return result

    def _path_with_lock_ref(self, node: TreeNode, lock_ref: int) -> list[TreeNode]:
        if self.disable or self.evictor.leases is None:
            return []
        path = []
        while node is not None and node is not self.root_node:
            if node.lock_ref == lock_ref and node.value is not None:
                path.append(node)
            node = node.parent
        return path

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


def radix_cache_factory(ctx) -> EvictingRadixCache:
    """The factory registered as ``--radix-cache-backend sglang-evict``."""
    config = config_from_env(ctx.params.page_size)
    facts = model_facts_of_context(ctx)
    check_startup(ctx.server_args, config, facts)
    if ctx.model_config is not None:
        for line in model_warnings(facts, config):
            logger.warning("%s", line)
    cache = EvictingRadixCache(ctx.params, config)
    cache.evictor.request_limits = request_limits(config, ctx.tp_size)
    if not pass_graphs_on(config, ctx.server_args, cache.evictor.device):
        cache.evictor.graphs = None  # default: pass graphs only beside SGLang's own
    # Passes wait, on the device, for the in-flight forward on this stream.
    cache.evictor.forward_stream = forward_stream_of(ctx.tp_worker)
    capture.attach(cache.evictor, getattr(ctx.tp_worker, "model_runner", None))
    tier.attach(cache.evictor, getattr(ctx.tp_worker, "model_runner", None))
    if ctx.tp_size > 1 and config.scorer in TP_REDUCED_SCORERS:
        if ctx.params.tp_cache_group is None:
            raise ValueError(
                "tensor parallelism without a CPU cache group: cannot agree on survivors"
            )
        cache.evictor.score_reducer = tp_score_reducer(
            ctx.params.tp_cache_group, cache.evictor.scorer.head_reduction
        )
    Active.manager = cache.evictor
    if getattr(ctx.server_args, "enable_metrics", False):
        from sglang_evict.metrics import EvictionMetrics

        Active.metrics = EvictionMetrics.create(config.scorer)
    plan = capture.STATE.plan if cache.evictor.query_ring is not None else None
    logger.info(
        "sglang-evict active: budget=%d cadence=%d sinks=%d protected=%d window=%d scorer=%s "
        "compaction=%s page_size=%d attention_backend=%s (%s, unchanged by the plugin); %s; "
        "pass group steps %s; passes %s",
        config.kv_budget_tokens,
        config.cadence_tokens,
        config.sink_tokens,
        config.protected_tokens,
        config.window_tokens,
        config.scorer,
        config.compaction,
        config.page_size,
        getattr(ctx.server_args, "attention_backend", None),
        capture.STATE.attention_backend,
        plan.describe() if plan is not None else "query capture off (the scorer reads no queries)",
        config.pass_group_steps,
        (
            f"replayed as CUDA graphs (their pool at most {config.pass_graph_pool_mib} MiB)"
            if cache.evictor.graphs is not None
            else "eager"
        ),
    )
    return cache
