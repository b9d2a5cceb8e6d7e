"""Building the plugin's ``EvictionManager`` over the pools a radix cache is built with:
the lease store, the compactor (in-process, or the sidecar with its fallback)."""

from __future__ import annotations

import atexit
import os

from sglang.srt.mem_cache.cache_init_params import CacheInitParams

from compactor_service.client import FallbackCompactor, GrpcCompactor
from compactor_service.compactor import Compactor, InProcessCompactor
from compactor_service.health import socket_target
from compactor_service.leases import InProcessLeaseStore, LeaseStore
from compactor_service.tls import channel_credentials, parse_tcp_address
from sglang_evict.config import EvictionConfig
from sglang_evict.passes.manager import EvictionManager
from sglang_evict.srt.pools import SGLangPoolAccess, share_kv_pool
from sglang_evict.srt.request_policy import request_limits


def make_lease_store(config: EvictionConfig) -> LeaseStore | None:
    if config.lease_store == "none":
        return None
    if config.lease_store == "redis":
        from compactor_service.redis_leases import RedisLeaseStore

        return RedisLeaseStore(config.redis_url, namespace=config.lease_namespace)
    return InProcessLeaseStore()


def make_compactor(
    config: EvictionConfig, pool: SGLangPoolAccess, leases: LeaseStore | None
) -> Compactor | None:
    """The configured compactor: None for in-process passes (the manager moves slots
    on the pool's device from device plans), or the sidecar with an in-process
    fallback (which completes, with the same host plans, any pass the sidecar cannot)."""
    if config.compactor == "inprocess":
        return None
    layout, shared = share_kv_pool(pool.kv_pool, config.shm_dir)
    if shared is not None:
        atexit.register(shared.close)
    fallback = InProcessCompactor(
        pool.k_buffers, pool.v_buffers, leases=leases, page_size=pool.page_size
    )
    target = socket_target(config.compactor_socket)
    if config.compactor_address is not None:
        target = parse_tcp_address(config.compactor_address, "--kv-compactor-address").target
    credentials = channel_credentials(
        config.compactor_tls_ca,
        config.compactor_tls_cert,
        config.compactor_tls_key,
        flag_prefix="--kv-compactor-tls",
    )
    sidecar = GrpcCompactor(
        target, layout, timeout_s=config.compactor_timeout_ms / 1000, credentials=credentials
    )
    return FallbackCompactor(sidecar, fallback, mode=config.compactor_fallback)


def make_manager(config: EvictionConfig, params: CacheInitParams) -> EvictionManager:
    """An ``EvictionManager`` over the pools a radix cache is built with."""
    allocator = params.token_to_kv_pool_allocator
    pool = SGLangPoolAccess(params.req_to_token_pool, allocator, allocator.get_kvcache())
    leases = make_lease_store(config)
    compactor = make_compactor(config, pool, leases)
    req_to_token = params.req_to_token_pool.req_to_token
    manager = EvictionManager(
        config=config,
        pool=pool,
        compactor=compactor,
        num_request_rows=req_to_token.shape[0],
        row_capacity=req_to_token.shape[1],
        device=allocator.device,
        leases=leases,
        lease_holder=f"scheduler-{os.getpid()}",
    )
    # One rank; the radix-cache factory replaces it with the server's TP size.
    manager.request_limits = request_limits(config)
    return manager


def forward_stream_of(tp_worker) -> object | None:
    """The stream SGLang runs the model's forward on (``ModelRunner.forward_stream``,
    the one the scheduler's ``forward_stream`` also names), or None (no worker, CPU).
    Captured when the radix cache is built, so that a pass can wait for the in-flight
    forward on the device (``EvictionManager.order_after_forward``)."""
    runner = getattr(tp_worker, "model_runner", None)
    return getattr(runner, "forward_stream", None)
