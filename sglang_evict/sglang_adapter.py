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

import atexit
import logging
import os
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


def version_problem(installed: str | None) -> str | None:
    """Why the plugin cannot run against SGLang ``installed`` (None: not installed), or
    None if it can."""
    if installed is None:
        return (
            f"sglang-evict needs SGLang {SGLANG_VERSION_TARGET}, but SGLang is not installed; "
            f'install it with: pip install "sglang=={SGLANG_VERSION_TARGET}"'
        )
    if installed != SGLANG_VERSION_TARGET:
        return (
            f"sglang-evict was written against SGLang {SGLANG_VERSION_TARGET}, found "
            f"{installed}; its internals differ between releases. Install "
            f'"sglang=={SGLANG_VERSION_TARGET}" or an sglang-evict release for {installed}.'
        )
    return None


def check_sglang_version() -> None:
    """Raise ``RuntimeError`` unless the installed SGLang is the targeted release."""
    problem = version_problem(installed_sglang_version())
    if problem:
        raise RuntimeError(problem)


# Refuse to load against another release before touching any internal.
check_sglang_version()

from sglang.srt.mem_cache.base_prefix_cache import InsertParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode  # noqa: E402

from compactor_service.client import FallbackCompactor, GrpcCompactor  # noqa: E402
from compactor_service.compactor import Compactor, InProcessCompactor  # noqa: E402
from compactor_service.health import socket_target  # noqa: E402
from compactor_service.leases import InProcessLeaseStore, LeaseStore  # noqa: E402
from compactor_service.shared_pool import (  # noqa: E402
    PoolLayout,
    create_shared_buffers,
    export_cuda_buffers,
)
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


def share_kv_pool(kv_pool: MHATokenToKVPool, shm_dir: str) -> tuple[PoolLayout, object]:
    """Make ``kv_pool``'s buffers mappable by the compactor process; return the layout
    and the owner of the shared memory (``close()`` removes it).

    CUDA: the buffers stay where they are and are exported by IPC handle. CPU: the
    buffers move into one tmpfs file (contents copied) and the pool's per-layer lists
    and pointer tables are re-pointed at it — done at start-up, before any forward.
    """
    if kv_pool.head_dim != kv_pool.v_head_dim:
        raise ValueError("the compactor sidecar needs equal K and V head dims (MHA)")
    if torch.device(kv_pool.device).type == "cuda":
        return export_cuda_buffers(kv_pool.k_buffer, kv_pool.v_buffer, kv_pool.page_size), None
    first = kv_pool.k_buffer[0]
    shared = create_shared_buffers(
        num_layers=len(kv_pool.k_buffer),
        num_slots=first.shape[0],
        num_kv_heads=first.shape[1],
        head_dim=first.shape[2],
        dtype=first.dtype,
        page_size=kv_pool.page_size,
        directory=shm_dir,
        copy_from=(kv_pool.k_buffer, kv_pool.v_buffer),
    )
    kv_pool.k_buffer = shared.k
    kv_pool.v_buffer = shared.v
    kv_pool._init_data_ptrs_and_strides()
    return shared.layout, shared


def make_lease_store(config: EvictionConfig) -> LeaseStore | None:
    if config.lease_store == "none":
        return None
    if config.lease_store == "redis":
        from compactor_service.redis_leases import RedisLeaseStore

        return RedisLeaseStore(config.redis_url, namespace=config.lease_namespace)
    return InProcessLeaseStore()


def make_compactor(
    config: EvictionConfig, pool: SGLangPoolAccess, leases: LeaseStore | None
) -> Compactor:
    """The configured compactor: in-process, or the sidecar with an in-process fallback
    (which completes, with the same plans, any pass the sidecar cannot)."""
    if config.compactor == "inprocess":
        return InProcessCompactor(
            pool.k_buffers, pool.v_buffers, leases=leases, page_size=pool.page_size
        )
    layout, shared = share_kv_pool(pool.kv_pool, config.shm_dir)
    if shared is not None:
        atexit.register(shared.close)
    fallback = InProcessCompactor(
        pool.k_buffers, pool.v_buffers, leases=leases, page_size=pool.page_size
    )
    sidecar = GrpcCompactor(
        socket_target(config.compactor_socket),
        layout,
        timeout_s=config.compactor_timeout_ms / 1000,
    )
    return FallbackCompactor(sidecar, fallback, mode=config.compactor_fallback)


def make_manager(
    config: EvictionConfig, params: CacheInitParams, compactor: Compactor | None = None
) -> EvictionManager:
    """An ``EvictionManager`` over the pools a radix cache is built with."""
    allocator = params.token_to_kv_pool_allocator
    pool = SGLangPoolAccess(params.req_to_token_pool, allocator, allocator.get_kvcache())
    leases = make_lease_store(config)
    if compactor is None:
        compactor = make_compactor(config, pool, leases)
    return EvictionManager(
        config=config,
        pool=pool,
        compactor=compactor,
        num_request_rows=params.req_to_token_pool.req_to_token.shape[0],
        device=allocator.device,
        leases=leases,
        lease_holder=f"scheduler-{os.getpid()}",
    )


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


# --- server integration: backend factory, hooks ------------------------------------------

BACKEND_NAME = "sglang-evict"
# The policy reaches SGLang's scheduler processes through the environment (they inherit
# it from `sglang-evict serve`): a JSON object of EvictionConfig fields, page size excluded.
CONFIG_ENV = "SGLANG_EVICT_CONFIG"
HOOK_PREPARE_FOR_DECODE = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode"
HOOK_FORWARD_BATCH_INIT = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
# Scorers whose survivors do not depend on this rank's KV heads, and those whose
# per-rank scores are reduced across tensor-parallel ranks (``tp_score_reducer``).
_RANK_INDEPENDENT_SCORERS = ("streaming", "random")
_TP_REDUCED_SCORERS = ("knorm",)


class _Active:
    """The manager of this process's evicting cache (one scheduler per process)."""

    manager: EvictionManager | None = None
    metrics = None


def config_from_env(page_size: int, environ: dict | None = None) -> EvictionConfig:
    """Read the policy that `sglang-evict serve` put in ``SGLANG_EVICT_CONFIG``."""
    import json
    import os

    raw = (environ if environ is not None else os.environ).get(CONFIG_ENV)
    if not raw:
        raise ValueError(
            f"--radix-cache-backend {BACKEND_NAME} needs an eviction policy: start the server "
            f"with `sglang-evict serve --kv-budget N ...` (or set {CONFIG_ENV} to a JSON object "
            f'such as {{"kv_budget_tokens": 2048}})'
        )
    try:
        fields = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(f"{CONFIG_ENV} is not valid JSON: {error}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{CONFIG_ENV} must hold a JSON object of eviction settings")
    fields.pop("page_size", None)
    try:
        return EvictionConfig(**fields, page_size=page_size)
    except TypeError as error:
        raise ValueError(f"{CONFIG_ENV}: {error}") from None


def unsupported_server_args(server_args, scorer: str | None = None) -> list[str]:
    """Messages naming each SGLang flag this plugin cannot run with (empty if fine)."""
    problems = []
    refusals = (
        (
            "speculative_algorithm",
            lambda v: v is not None,
            "--speculative-algorithm",
            "speculative decoding derives draft positions from KV lengths",
        ),
        (
            "enable_mixed_chunk",
            bool,
            "--enable-mixed-chunk",
            "mixed chunks recompute running requests' KV lengths from token counts",
        ),
        (
            "enable_hierarchical_cache",
            bool,
            "--enable-hierarchical-cache",
            "the host-memory tier would offload compacted rows as if they were token rows",
        ),
        (
            "enable_streaming_session",
            bool,
            "--enable-streaming-session",
            "streaming sessions restore KV lengths from token counts across turns",
        ),
        (
            "strip_thinking_cache",
            bool,
            "--strip-thinking-cache",
            "it also rewrites which KV a finished request hands to the tree",
        ),
        ("enable_lmcache", bool, "--enable-lmcache", "it selects its own radix cache"),
        ("enable_flexkv", bool, "--enable-flexkv", "it selects its own radix cache"),
        (
            "kv_canary",
            lambda v: v not in (None, "none"),
            "--kv-canary",
            "it verifies row i against token i",
        ),
        (
            "pp_size",
            lambda v: v is not None and v > 1,
            "--pp-size > 1",
            "pipeline stages would each need the same survivors",
        ),
        (
            "disaggregation_mode",
            lambda v: v not in (None, "null"),
            "--disaggregation-mode",
            "transferred KV assumes token rows",
        ),
    )
    for attribute, is_set, flag, why in refusals:
        if is_set(getattr(server_args, attribute, None)):
            problems.append(f"{flag} is not supported with sglang-evict yet ({why}); remove it")
    tp_size = getattr(server_args, "tp_size", 1) or 1
    supported_under_tp = _RANK_INDEPENDENT_SCORERS + _TP_REDUCED_SCORERS
    if tp_size > 1 and scorer is not None and scorer not in supported_under_tp:
        problems.append(
            f"--tp-size {tp_size} with --kv-scorer {scorer} is not supported yet (each rank "
            f"holds different KV heads and this scorer's per-rank inputs are not split "
            f"yet); use --kv-scorer {' or '.join(supported_under_tp)}, or --tp-size 1"
        )
    return problems


def parse_server_args(argv: list[str]):
    """SGLang's own parsing of ``sglang.launch_server`` arguments into ``ServerArgs``."""
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(list(argv))


def tp_score_reducer(group, head_reduction: str):
    """Combine per-token scores across the tensor-parallel ranks sharing requests.

    Each rank scores its own KV heads (an equal share); its per-token score is the mean
    (or max) over those heads, so the mean of the ranks' means is the mean over all heads,
    and the max of maxima the max. Runs on SGLang's CPU group for the cache
    (``tp_cache_group``): one all-reduce of ``num_tokens`` floats per pass.
    """
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    op = dist.ReduceOp.MAX if head_reduction == "max" else dist.ReduceOp.SUM

    def reduce(scores: Tensor) -> Tensor:
        combined = scores.detach().to("cpu", torch.float32).clone()
        dist.all_reduce(combined, op=op, group=group)
        if head_reduction != "max":
            combined /= world_size
        return combined.to(scores.device)

    return reduce


def radix_cache_factory(ctx) -> EvictingRadixCache:
    """The factory registered as ``--radix-cache-backend sglang-evict``."""
    config = config_from_env(ctx.params.page_size)
    problems = unsupported_server_args(ctx.server_args, config.scorer)
    if config.make_scorer().needs_queries:
        problems.append(
            f"--kv-scorer {config.scorer} reads queries captured inside the attention "
            f"forward, which the server path does not capture yet; use knorm, streaming "
            f"or triattention"
        )
    for flag, reason in (
        (ctx.is_hybrid_swa, "sliding-window (hybrid SWA) models"),
        (ctx.is_hybrid_ssm, "hybrid SSM/linear-attention models"),
        (ctx.is_dsa, "DeepSeek sparse-attention models"),
        (ctx.enable_hierarchical_cache, "--enable-hierarchical-cache"),
    ):
        if flag:
            problems.append(f"sglang-evict does not support {reason} yet")
    if problems:
        raise ValueError("; ".join(problems))
    cache = EvictingRadixCache(ctx.params, config)
    if ctx.tp_size > 1 and config.scorer in _TP_REDUCED_SCORERS:
        if ctx.params.tp_cache_group is None:
            raise ValueError(
                "tensor parallelism without a CPU cache group: cannot agree on survivors"
            )
        cache.evictor.score_reducer = tp_score_reducer(
            ctx.params.tp_cache_group, cache.evictor.scorer.head_reduction
        )
    _Active.manager = cache.evictor
    if getattr(ctx.server_args, "enable_metrics", False):
        from sglang_evict.metrics import EvictionMetrics

        _Active.metrics = EvictionMetrics.create(config.scorer)
    logger.info(
        "sglang-evict active: budget=%d cadence=%d sinks=%d protected=%d window=%d scorer=%s "
        "compaction=%s page_size=%d attention_backend=%s (unchanged by the plugin)",
        config.kv_budget_tokens,
        config.cadence_tokens,
        config.sink_tokens,
        config.protected_tokens,
        config.window_tokens,
        config.scorer,
        config.compaction,
        config.page_size,
        getattr(ctx.server_args, "attention_backend", None),
    )
    return cache


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
    for i in due:
        try:
            result = run_pass_for_req(manager, reqs[i])
        except (ValueError, RuntimeError) as error:
            # Validation failed before any byte moved: serve on with the full KV.
            logger.error("sglang-evict: pass for request %s failed: %s", reqs[i].rid, error)
            if _Active.metrics is not None:
                _Active.metrics.record_failure(manager.config.compaction)
            continue
        if result is None:
            continue
        shrink[i] = result.tokens_evicted
        results.append(result)
        if _Active.metrics is not None:
            _Active.metrics.record(result, manager.config.kv_budget_tokens)
    if _Active.metrics is not None:
        _Active.metrics.record_compactor(manager.compactor)
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


def install() -> None:
    """Register the radix-cache backend and the hooks (idempotent)."""
    from sglang.srt.mem_cache.registry import (
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND_NAME in registered_radix_cache_backends():
        return
    register_radix_cache_backend(BACKEND_NAME, radix_cache_factory)
    HookRegistry.register(HOOK_PREPARE_FOR_DECODE, _before_prepare_for_decode, HookType.BEFORE)
    HookRegistry.register(HOOK_FORWARD_BATCH_INIT, _after_forward_batch_init_new, HookType.AFTER)


# --- CPU driver: SGLang's memory classes, driven as its scheduler drives them ---------------


def publish_cpu_runtime() -> None:
    """Publish process-wide server args, as a scheduler does at start (SGLang's release
    path reads them). For CPU drivers and tests only; a server publishes its own."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    publish(ServerArgs(model_path="dummy", device="cpu"), role="test")


class MemoryDriver:
    """SGLang 0.5.17's memory classes on CPU tensors — ``ReqToTokenPool``, the token or
    paged allocator, ``MHATokenToKVPool`` and the radix cache (``EvictingRadixCache``
    when a policy is given, SGLang's ``RadixCache`` otherwise) — driven through the calls
    its scheduler makes:

        admit          match_prefix + inc_lock_ref, ReqToTokenPool.alloc, alloc_extend
                       (token allocator: alloc), the row write
        prefill_done   maybe_cache_unfinished_req (the prompt enters the tree)
        prepare_decode a ScheduleBatch of the running requests, the plugin's
                       prepare_for_decode work, alloc_for_decode, the counters
                       prepare_for_decode advances, the ForwardBatch hook's positions
        finish         release_kv_cache

    The model (``sglang_evict.reference_model``) reads and writes K/V at the slots this
    returns. Used by ``sglang-evict demo`` and the tests.
    """

    @classmethod
    def for_model(cls, model, *, page_size: int, num_tokens: int, **kwargs):
        """A driver whose KV pool fits ``model`` (a ``PagedLlama``: layers, KV heads,
        head dim, dtype), with ``num_tokens`` rounded up to whole pages."""
        return cls(
            page_size=page_size,
            num_tokens=-(-num_tokens // page_size) * page_size,
            num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            dtype=model.dtype,
            **kwargs,
        )

    def __init__(
        self,
        *,
        page_size: int,
        num_tokens: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        config: EvictionConfig | None = None,
        max_requests: int = 64,
        max_context: int = 4096,
    ) -> None:
        from sglang.srt.mem_cache.allocator import (
            PagedTokenToKVPoolAllocator,
            TokenToKVPoolAllocator,
        )
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        publish_cpu_runtime()
        self.page_size = page_size
        self.num_tokens = num_tokens
        self.kv_pool = MHATokenToKVPool(
            size=num_tokens,
            page_size=page_size,
            dtype=dtype,
            head_num=num_kv_heads,
            head_dim=head_dim,
            layer_num=num_layers,
            device="cpu",
            enable_memory_saver=False,
        )
        if page_size == 1:
            self.allocator = TokenToKVPoolAllocator(
                num_tokens, dtype, "cpu", self.kv_pool, need_sort=False
            )
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                num_tokens, page_size, dtype, "cpu", self.kv_pool, need_sort=False
            )
        self.req_to_token_pool = ReqToTokenPool(
            max_requests, max_context, "cpu", enable_memory_saver=False
        )
        self.cache_params = CacheInitParams(
            disable=False,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=page_size,
        )
        self.cache = (
            EvictingRadixCache(self.cache_params, config)
            if config
            else RadixCache(self.cache_params)
        )
        self.running: dict[str, object] = {}

    @property
    def evictor(self) -> EvictionManager | None:
        return self.cache.evictor if isinstance(self.cache, EvictingRadixCache) else None

    def match(self, tokens, extra_key: str | None = None):
        from array import array

        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        return self.cache.match_prefix(
            MatchPrefixParams(key=RadixKey(array("q", tokens), extra_key))
        )

    def admit(self, rid: str, prompt: list[int], extra_key: str | None = None):
        """Admit a request; returns ``(req, prefix_len, extend_slots)``: the caller writes
        the K/V of ``prompt[prefix_len:]`` at ``extend_slots``, then calls ``prefill_done``."""
        from array import array

        from sglang.srt.managers.schedule_batch import Req, ReqKvInfo
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=1 << 20))
        req.extra_key = extra_key
        # As SGLang's scheduler does (max_prefix_len = input_len - 1): at least one
        # prompt token is computed, so a fully cached prompt still yields logits.
        match = self.match(prompt[:-1], extra_key)
        prefix = match.device_indices
        req.prefix_indices, req.last_node = prefix, match.last_device_node
        req.cache_protected_len = len(prefix)
        self.cache.inc_lock_ref(req.last_node)
        if self.req_to_token_pool.alloc([req]) is None:
            raise RuntimeError("request pool exhausted")
        n_prefix, n_total = len(prefix), len(prompt)
        if self.page_size == 1:
            slots = self.allocator.alloc(n_total - n_prefix)
        else:
            last_loc = int(prefix[-1]) if n_prefix else -1
            slots = self.allocator.alloc_extend(
                torch.tensor([n_prefix]),
                torch.tensor([n_prefix]),
                torch.tensor([n_total]),
                torch.tensor([n_total]),
                torch.tensor([last_loc]),
                n_total - n_prefix,
            )
        if slots is None:
            raise RuntimeError("KV pool exhausted at prefill")
        row = torch.cat([prefix.to(torch.int64), slots.to(torch.int64)])
        self.req_to_token_pool.write((req.req_pool_idx, slice(0, n_total)), row.to(torch.int32))
        req.kv_committed_len = n_total
        req.kv = ReqKvInfo(kv_allocated_len=n_total, swa_evicted_seqlen=0)
        self.running[rid] = req
        return req, n_prefix, slots.to(torch.int64)

    def prefill_done(self, req) -> None:
        from sglang.srt.mem_cache.common import maybe_cache_unfinished_req

        req._refresh_fill_ids()
        req.set_extend_range(len(req.prefix_indices), req.kv_committed_len)
        maybe_cache_unfinished_req(req, self.cache)

    def prepare_decode(self, reqs: list) -> tuple[Tensor, Tensor, list[PassResult | None]]:
        """Returns ``(out_slots, positions, passes)`` for one decode step of ``reqs``."""
        from types import SimpleNamespace

        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.mem_cache.allocation import alloc_for_decode
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        model_config = SimpleNamespace(vocab_size=1 << 20, is_encoder_decoder=False)
        batch = ScheduleBatch.init_new(
            reqs,
            self.req_to_token_pool,
            self.allocator,
            self.cache,
            model_config,
            enable_overlap=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        )
        lens = [r.kv_committed_len for r in reqs]
        batch.req_pool_indices = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        batch.seq_lens = torch.tensor(lens, dtype=torch.int64)
        batch.seq_lens_cpu = torch.tensor(lens, dtype=torch.int64)
        batch.orig_seq_lens = torch.tensor(lens, dtype=torch.int32)
        passes: list[PassResult | None] = [None] * len(reqs)
        manager = self.evictor
        if manager is not None:
            done = iter(compact_decode_batch(manager, batch))
            for i, req in enumerate(reqs):
                if req.kv_committed_len != lens[i]:
                    passes[i] = next(done)
        out_slots = alloc_for_decode(batch, token_per_req=1)
        if out_slots is None:
            raise RuntimeError("KV pool exhausted at decode")
        for req in reqs:  # what prepare_for_decode advances after allocating
            req.decode_batch_idx += 1
            req.kv_committed_len += 1
        seq_lens = batch.seq_lens + 1
        positions = (
            manager.decode_positions(batch.req_pool_indices, seq_lens)
            if manager is not None
            else seq_lens - 1
        )
        return out_slots.to(torch.int64), positions, passes

    def finish(self, req) -> None:
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, self.cache)
        del self.running[req.rid]

    def retract(self, req) -> None:
        """What ``ScheduleBatch.retract_decode`` does to a request (``release_req``): free
        its KV without inserting it into the tree and reset it for a later re-prefill of
        its prompt and output tokens."""
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, self.cache, is_insert=False)
        req.reset_for_retract()
        del self.running[req.rid]

    def row(self, req) -> Tensor:
        return self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_committed_len].long()

    def positions(self, req) -> Tensor:
        manager = self.evictor
        if manager is None:
            return torch.arange(req.kv_committed_len)
        return manager.positions(req.rid, req.kv_committed_len)

    def free_tokens(self) -> int:
        return int(self.allocator.available_size())

    def held_tokens(self) -> int:
        """KV slots held by running requests (their private pages) and the radix tree."""
        return self.num_tokens - self.free_tokens()
