"""The SGLang side of the plugin: the only package that touches ``sglang.srt.*``.

Written against SGLang 0.5.17 (``SGLANG_VERSION_TARGET``: the newest release pinning
torch 2.11, the lent GPU's torch) and 0.5.23 (the newest release). Internals move
between releases (0.5.23 replaced ``cache_finished_req``/``cache_unfinished_req`` with a
checkpoint API and moved a request's KV fields to ``req.kv``), so importing this package
first checks the installed release and refuses any other, naming the supported ones;
what differs between the two is in ``versioned``, nowhere else. Everything else in
``sglang_evict`` talks to these modules, one per integration surface:

    module          surface                                   SGLang classes touched
    versioned       what differs between 0.5.17 and 0.5.23    Req / ReqKvInfo, allocators,
                    (KV fields, cache lifecycle, allocator)   RadixCache, PrefillAdder
    pools           KV pool access, the allocator's free set  ReqToTokenPool, allocators,
                    sharing buffers with the compactor        MHATokenToKVPool
    manager         EvictionManager over a cache's pools      CacheInitParams
    capture         queries copied into the query ring        AttentionBackend.forward,
                    inside the attention; the ring's KV-pool  KVCacheConfigurator,
                    reservation                               ModelRunner
    graph_pool      the pass CUDA graphs' memory pool         KVCacheConfigurator
                    counted against the KV pool
    tier            the quantized tier's arena carved from    KVCacheConfigurator,
                    the KV pool; decode attention merged      ModelRunner,
                    with the tier's (log-sum-exp)             AttentionBackend.forward
    windows         windowed layers follow logical positions  TorchNativeAttnBackend
                    after compaction (``torch_native``)       (forward_decode)
    backend         EvictingRadixCache + registered factory   RadixCache, TreeNode
    hooks           decode-step passes, decode positions      ScheduleBatch, ForwardBatch
    admission       admission and retraction see an evicting  PrefillAdder, ScheduleBatch
                    request's bounded KV; pressure passes     (check_decode_mem)
    server_args     policy from the environment; refusals     ServerArgs
    request_policy  per-request policy (custom_params), its   TokenizerManager, Scheduler,
                    checks, the per-request report            Req (customized_info)
    frontend        per-gen policy in frontend programs       sglang.lang (RuntimeEndpoint,
                                                              SglGen)
    tp              score reduction across TP ranks           the CPU cache group
    active          what the surfaces share in a scheduler    -
                    process (manager, metrics, totals), the
                    evicting cache's marker class
    cpu_driver      memory classes driven on CPU (tests,      Req, ScheduleBatch,
                    demo, quality harness)                    alloc_for_decode, release
    introspection   the plugin's state in get_server_info,    Scheduler (internal
                    the idle check, the per-pass log line     state, idle check)
    cpu_platform    SGLang's base platform with the CPU as   SRTPlatform (platform
                    its device (``SGLANG_PLATFORM``): the     plugins)
                    MoE families on a CPU-only machine
    engine_runner   SGLang's engine in a child process of     sglang.Engine
                    its own, its log read (tests, demo)
    preflight       whether an engine would start, checked    ServerArgs, ModelConfig,
                    without starting it (GPU checks on CPU)   the pool hooks above
    watchdog        stack dumps while a scheduler starts      ModelRunner, Scheduler
                    (``SGLANG_EVICT_STALL_DUMP_S``)           (run_event_loop)
    pool_estimate   SGLang's KV and request pools on a GPU    ServerArgs (memory
                    of a given size, the query ring's share   defaults), ModelConfig
                    of them (``serve --dry-run``)
    process_start   SGLang's scheduler and detokenizer        multiprocessing's start
                    forked instead of spawned, where asked    method as SGLang sets it
                    and safe (``SGLANG_EVICT_ENGINE_FORK``)   (Engine, launch_server)

A new surface gets its own module here.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

SGLANG_VERSION_TARGET = "0.5.17"  # the GPU-verified release (torch 2.11, the lent GPU's)
# Releases the plugin runs on; what differs between them is in ``versioned``.
SUPPORTED_SGLANG_VERSIONS = ("0.5.17", "0.5.23")


def installed_sglang_version() -> str | None:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def version_problem(installed: str | None) -> str | None:
    """Why the plugin cannot run against SGLang ``installed`` (None: not installed), or
    None if it can."""
    supported = " or ".join(SUPPORTED_SGLANG_VERSIONS)
    if installed is None:
        return (
            f"sglang-evict needs SGLang {supported}, but SGLang is not installed; install "
            f'it with: pip install "sglang-evict[sglang]" (SGLang {SGLANG_VERSION_TARGET})'
        )
    if installed not in SUPPORTED_SGLANG_VERSIONS:
        return (
            f"sglang-evict supports SGLang {supported}, found {installed}; its internals "
            f"differ between releases. Install one of them "
            f'(pip install "sglang=={SGLANG_VERSION_TARGET}") or an sglang-evict release '
            f"for {installed}."
        )
    return None


def check_sglang_version() -> None:
    """Raise ``RuntimeError`` unless the installed SGLang is the targeted release."""
    problem = version_problem(installed_sglang_version())
    if problem:
        raise RuntimeError(problem)


# Refuse to load against another release before any module here touches an internal.
check_sglang_version()


def install() -> None:
    """Register the radix-cache backend and the hooks (idempotent)."""
    from sglang.srt.mem_cache.registry import (
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_evict.srt.admission import (
        HOOK_ADD_ONE_REQ,
        HOOK_CHECK_DECODE_MEM,
        HOOK_RUNNING_OFFSET,
        _after_check_decode_mem,
        _after_running_offset,
        _around_add_one_req,
    )
    from sglang_evict.srt.backend import radix_cache_factory
    from sglang_evict.srt.capture import (
        HOOK_ALLOC_POOL,
        HOOK_ATTENTION_FORWARD,
        HOOK_RESOLVE_POOL,
        _after_alloc_memory_pool,
        _before_attention_forward,
    )
    from sglang_evict.srt.hooks import (
        HOOK_FORWARD_BATCH_INIT,
        HOOK_PREPARE_FOR_DECODE,
        _after_forward_batch_init_new,
        _before_prepare_for_decode,
    )
    from sglang_evict.srt.introspection import (
        HOOK_INTERNAL_STATE,
        HOOK_ON_IDLE,
        _after_get_internal_state,
        _after_on_idle,
    )
    from sglang_evict.srt.request_policy import (
        HOOK_ADD_REQUEST_TO_QUEUE,
        HOOK_VALIDATE_REQUEST,
        _after_validate_one_request,
        _before_add_request_to_queue,
    )
    from sglang_evict.srt.server_args import BACKEND_NAME
    from sglang_evict.srt.tier import _after_alloc_memory_pool as _after_alloc_tier
    from sglang_evict.srt.tier import _after_attention_forward
    from sglang_evict.srt.watchdog import HOOK_RUN_EVENT_LOOP, _before_run_event_loop
    from sglang_evict.srt.watchdog import _after_alloc_memory_pool as _after_alloc_watchdog
    from sglang_evict.srt.windows import HOOK_TORCH_NATIVE_DECODE, _after_forward_decode

    if BACKEND_NAME in registered_radix_cache_backends():
        return
    register_radix_cache_backend(BACKEND_NAME, radix_cache_factory)
    HookRegistry.register(HOOK_PREPARE_FOR_DECODE, _before_prepare_for_decode, HookType.BEFORE)
    HookRegistry.register(HOOK_FORWARD_BATCH_INIT, _after_forward_batch_init_new, HookType.AFTER)
    HookRegistry.register(HOOK_INTERNAL_STATE, _after_get_internal_state, HookType.AFTER)
    HookRegistry.register(HOOK_ON_IDLE, _after_on_idle, HookType.AFTER)
    HookRegistry.register(HOOK_VALIDATE_REQUEST, _after_validate_one_request, HookType.AFTER)
    HookRegistry.register(HOOK_ADD_REQUEST_TO_QUEUE, _before_add_request_to_queue, HookType.BEFORE)
    for hook in resolve_pool_hooks():
        HookRegistry.register(HOOK_RESOLVE_POOL, hook, HookType.AFTER)
    HookRegistry.register(HOOK_ALLOC_POOL, _after_alloc_memory_pool, HookType.AFTER)
    HookRegistry.register(HOOK_ALLOC_POOL, _after_alloc_tier, HookType.AFTER)
    HookRegistry.register(HOOK_ALLOC_POOL, _after_alloc_watchdog, HookType.AFTER)
    HookRegistry.register(HOOK_RUN_EVENT_LOOP, _before_run_event_loop, HookType.BEFORE)
    HookRegistry.register(HOOK_ATTENTION_FORWARD, _before_attention_forward, HookType.BEFORE)
    HookRegistry.register(HOOK_ATTENTION_FORWARD, _after_attention_forward, HookType.AFTER)
    HookRegistry.register(HOOK_TORCH_NATIVE_DECODE, _after_forward_decode, HookType.AFTER)
    HookRegistry.register(HOOK_RUNNING_OFFSET, _after_running_offset, HookType.AFTER)
    HookRegistry.register(HOOK_ADD_ONE_REQ, _around_add_one_req, HookType.AROUND)
    HookRegistry.register(HOOK_CHECK_DECODE_MEM, _after_check_decode_mem, HookType.AFTER)


def resolve_pool_hooks() -> tuple:
    """The AFTER hooks on ``KVCacheConfigurator._resolve_memory_pool_config``, in the
    order they run: each takes its reservation out of the KV pool the one before left
    (the query ring, the pass graphs' pool, the tier's arena)."""
    from sglang_evict.srt.capture import _after_resolve_memory_pool_config as capture
    from sglang_evict.srt.graph_pool import _after_resolve_memory_pool_config_graph_pool
    from sglang_evict.srt.tier import _after_resolve_memory_pool_config as tier

    return (capture, _after_resolve_memory_pool_config_graph_pool, tier)
