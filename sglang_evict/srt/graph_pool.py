"""The pass CUDA graphs' memory pool, counted against SGLang's KV pool.

Passes replayed as CUDA graphs (``sglang_evict.passes.graphs``) keep their intermediates
in one memory pool of their own, captured lazily while the server runs. SGLang sizes its
KV pool at start-up from the memory it profiles free, so a pool growing afterwards would
take memory SGLang left for activations and its own decode graphs. The server therefore
reserves the pool's limit (``--kv-pass-graph-pool-mib``) when SGLang sizes the KV pool,
the way the query ring is reserved (``sglang_evict.srt.capture``)::

    KVCacheConfigurator._resolve_memory_pool_config   AFTER: the KV pool is sized down
                                                      by the limit, in whole pages
    radix_cache_factory                               the manager's graphs get the limit;
                                                      shapes past it run eagerly

Only a server that will replay passes reserves: the pool on CUDA, SGLang's CUDA graphs
on, ``--no-kv-pass-cuda-graph`` not given, and neither the quantized tier nor the gRPC
compactor on, whose passes run eagerly (``pass_graphs_on``, the one decision the cache
factory follows too).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sglang_evict.config import EvictionConfig
from sglang_evict.query_capture import pool_after_reserving
from sglang_evict.srt.capture import kv_bytes_per_token_of, plugin_policy
from sglang_evict.srt.versioned import attention_tp_size, decode_cuda_graphs_off

logger = logging.getLogger(__name__)


def pass_graphs_on(config: EvictionConfig, server_args, device) -> bool:
    """Whether this server replays passes as CUDA graphs: not turned off, the KV pool on
    CUDA, SGLang's own decode graphs on, and no part on whose passes run eagerly (the
    quantized tier's demotion, the gRPC sidecar's moves: ``PassManager._graphable``).
    ``--kv-pass-cuda-graph`` with any of those off or on is refused at start-up
    (``server_args.startup_problems``)."""
    if config.pass_cuda_graph is False:
        return False
    if config.tier_bits is not None or config.compactor == "grpc":
        return False
    if not str(device).startswith("cuda"):
        return False
    return not decode_cuda_graphs_off(server_args)


@dataclass(frozen=True)
class GraphPoolPlan:
    """What the reservation took out of the KV pool."""

    limit_bytes: int
    kv_bytes_per_token: int
    pool_tokens_before: int
    pool_tokens_after: int

    @property
    def reserved_tokens(self) -> int:
        return self.pool_tokens_before - self.pool_tokens_after

    def describe(self) -> str:
        return (
            f"pass CUDA graphs: a memory pool of at most {self.limit_bytes / 2**20:.0f} MiB, "
            f"counted as {self.reserved_tokens} KV tokens of {self.kv_bytes_per_token} bytes: "
            f"KV pool {self.pool_tokens_before} -> {self.pool_tokens_after} tokens "
            f"(--kv-pass-graph-pool-mib)"
        )


def plan_graph_pool(
    limit_mib: int, *, pool_tokens: int, kv_bytes_per_token: int, page_size: int
) -> GraphPoolPlan:
    """The KV pool left beside a graph pool of ``limit_mib``, in whole pages. Raises
    ``ValueError`` naming the flags when the reservation leaves no pool."""
    limit_bytes = limit_mib * 2**20
    reserved, after = pool_after_reserving(pool_tokens, limit_bytes, kv_bytes_per_token, page_size)
    if after < page_size:
        raise ValueError(
            f"--kv-pass-graph-pool-mib {limit_mib} reserves {reserved} KV tokens for the pass "
            f"CUDA graphs, but the KV pool holds {pool_tokens}; lower --kv-pass-graph-pool-mib, "
            f"raise --mem-fraction-static or --max-total-tokens, or pass "
            f"--no-kv-pass-cuda-graph"
        )
    return GraphPoolPlan(limit_bytes, kv_bytes_per_token, pool_tokens, after)


def _after_resolve_memory_pool_config_graph_pool(pool_config, configurator, *args, **kwargs):
    """Shrink the KV pool by the pass graphs' pool limit
    (``KVCacheConfigurator._resolve_memory_pool_config``, AFTER)."""
    if configurator.is_draft_worker:  # the target's manager runs the passes
        return pool_config
    server_args = configurator.server_args
    config = plugin_policy(server_args, configurator.page_size)
    if config is None or not pass_graphs_on(config, server_args, configurator.device):
        return pool_config
    plan = plan_graph_pool(
        config.pass_graph_pool_mib,
        pool_tokens=pool_config.max_total_num_tokens,
        kv_bytes_per_token=kv_bytes_per_token_of(
            configurator.model_config,
            attention_tp_size(configurator),
            configurator.layer_info.num_effective_layers,
            configurator.kv_cache_dtype,
        ),
        page_size=configurator.page_size,
    )
    pool_config.max_total_num_tokens = plan.pool_tokens_after
    logger.info("sglang-evict %s", plan.describe())
    return pool_config
