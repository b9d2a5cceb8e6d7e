"""The quantized tier inside SGLang's engine: its arena carved from the KV memory SGLang
sizes, and each decode layer's attention merged with the tier's.

Memory (the order matters, as for the query ring, ``capture``)::

    KVCacheConfigurator._resolve_memory_pool_config  AFTER: the KV pool gives up
                                                     --kv-tier-pool-share of its bytes,
                                                     in whole pages, to the arena
    ModelRunner.alloc_memory_pool                    AFTER: the arena is allocated, with
                                                     a row table per request-pool row
    radix_cache_factory                              the manager takes the arena

So SGLang's own figures (``max_total_num_tokens``, the decode log's ``#token``,
``/get_server_info``) count the pool after the carve, and the tier's bytes are memory
the server owns.

Attention: an AFTER hook on ``AttentionBackend.forward`` (the method every attention
layer reaches). For a decode batch whose requests hold tier groups it merges, by their
log-sum-exp (``sglang_evict_kernels.tier_attention.merge_attention_states``), the
backend's output over each request's full-precision KV with the request's attention
over its tier. The full side's log-sum-exp comes from the backend:

- ``torch_native`` (SGLang's CPU engine) returns none, so it is computed again from the
  same keys the backend read (``req_to_token[row, :seq_len]``). Where the compiled CPU
  kernels load (built when the arena is allocated), one call per layer does it all:
  the tier's attention, that log-sum-exp read from the pool where the keys lie, and the
  merge (``tier_decode_merge_cpu``; ``merged_by`` in ``get_server_info``'s ``tier``).
  Where they cannot be built, tensor operations do (``full_precision_lse``,
  ``tier_attention_torch``), said once in the log and in ``tier.cpu_kernel``;
- ``triton`` decodes split-KV in two stages, and stage 1 leaves each split's
  log-sum-exp in ``forward_metadata.attn_lse``: the full side's is their log-sum-exp over
  the splits stage 2 reduced (``split_kv_lse``; static shapes, no host read, so it can
  run inside SGLang's decode CUDA graphs), and the tier's side is one Triton kernel
  (``tier_attention_triton``). SGLang's engine runs this path on CPU under Triton's
  interpreter (``TRITON_INTERPRET=1``), where it generates what the reference loop does
  (tests/test_engine_tier_triton.py); it has not run on a GPU or inside CUDA graphs, so
  the server refuses ``triton`` with the tier on any device but the CPU
  (``server_args.TIER_BACKENDS_CPU_ONLY``; ``server_args.TIER_GPU_TRIAL_ENV`` lifts the
  refusal for the GPU check, ``scripts/gpu_check.sh tier``).

The server refuses the tier with any backend outside ``server_args.TIER_BACKENDS`` at
start (``server_args.startup_problems``).

Extend (prefill) batches never read the tier, and the hook asserts it (CPU: a read of
the batch's row counts): a pass demotes only tokens of a running request past its
prompt's shared prefix (shared prefixes never enter the tier), and a retracted or
finished request gives its tier back before its row is reused (a retracted request is
re-prefilled from its tokens, full precision).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch

from sglang_evict.config import EvictionConfig
from sglang_evict.srt.capture import kv_bytes_per_token_of, plugin_policy
from sglang_evict.srt.server_args import TIER_BACKENDS, tier_backend_refused
from sglang_evict.srt.versioned import attention_tp_size
from sglang_evict.srt.windows import layer_window
from sglang_evict.tier.demotion import attach_arena

logger = logging.getLogger(__name__)

_BACKEND_CLASSES = {"TorchNativeAttnBackend": "torch_native", "TritonAttnBackend": "triton"}
_FORWARD_ARGS = ("q", "k", "v", "layer", "forward_batch")


@dataclass
class TierPlan:
    """What the memory hook decided: the arena's size and what it costs the KV pool."""

    config: EvictionConfig
    num_groups: int
    num_layers: int
    kv_heads: int
    head_dim: int
    full_dtype: torch.dtype
    kv_bytes_per_token: int
    pool_tokens_before: int
    pool_tokens_after: int
    arena_bytes: int

    def describe(self) -> str:
        fmt = self.config
        return (
            f"quantized tier: {fmt.tier_bits} bits, groups of {fmt.tier_group_tokens} tokens, "
            f"{self.num_groups} group slots x {self.num_layers} layers "
            f"= {self.arena_bytes} bytes ({self.arena_bytes / 2**20:.2f} MiB, "
            f"--kv-tier-pool-share {fmt.tier_pool_share}): KV pool "
            f"{self.pool_tokens_before} -> {self.pool_tokens_after} tokens"
        )


@dataclass
class _Tier:
    """This scheduler process's tier (one model runner per process)."""

    plan: TierPlan | None = None
    arena: object | None = None  # sglang_evict.tier.arena.TierArena
    shared_arena: object | None = None  # its SharedArena with the compactor sidecar
    # decode layers merged, decode layers with no tier to merge, and the merges whose
    # full side's log-sum-exp came from triton's split-KV stage 1 (the rest: computed
    # again over the keys torch_native read)
    calls: dict = field(
        default_factory=lambda: {
            "decode_merged": 0,
            "decode_without": 0,
            "decode_windowed": 0,
            "split_kv_lse": 0,
        }
    )
    # CPU: the tier's side of the merge (``cpu_attention``) and what it is
    cpu_attention: object | None = None
    cpu_kernel: str = ""
    merged_by: str = ""  # the tier's side of the last merge (a function's name)


STATE = _Tier()


def tier_policy(server_args, page_size: int) -> EvictionConfig | None:
    config = plugin_policy(server_args, page_size)
    return config if config is not None and config.tier_bits is not None else None


def plan_tier(
    config: EvictionConfig,
    *,
    pool_tokens: int,
    kv_bytes_per_token: int,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    full_dtype: torch.dtype,
    page_size: int,
) -> TierPlan:
    """The arena for this pool and the whole pages left to the pool. Raises
    ``ValueError`` naming the flags when either would be empty."""
    from sglang_evict.tier.arena import arena_groups_for_share, group_bytes, slot_overhead_bytes

    fmt = config.tier_format(head_dim)
    groups = arena_groups_for_share(
        share=config.tier_pool_share,
        kv_pool_bytes=pool_tokens * kv_bytes_per_token,
        fmt=fmt,
        num_layers=num_layers,
        kv_heads=kv_heads,
        full_dtype=full_dtype,
    )
    if groups < 1:
        raise ValueError(
            f"--kv-tier-pool-share {config.tier_pool_share} of a {pool_tokens}-token KV pool "
            f"holds no tier group; raise it, --mem-fraction-static or --max-total-tokens"
        )
    arena_bytes = (groups + 1) * group_bytes(fmt, num_layers, kv_heads, full_dtype)
    arena_bytes += (groups + 1) * slot_overhead_bytes(fmt)  # scores and positions
    taken = -(-arena_bytes // kv_bytes_per_token)
    after = (pool_tokens - taken) // page_size * page_size
    if after < page_size:
        raise ValueError(
            f"the tier's arena takes {taken} of the KV pool's {pool_tokens} tokens; lower "
            f"--kv-tier-pool-share or raise --mem-fraction-static or --max-total-tokens"
        )
    return TierPlan(
        config,
        groups,
        num_layers,
        kv_heads,
        head_dim,
        full_dtype,
        kv_bytes_per_token,
        pool_tokens,
        after,
        arena_bytes,
    )


# --- hooks ----------------------------------------------------------------------------


def _after_resolve_memory_pool_config(pool_config, configurator, *args, **kwargs):
    """Shrink the KV pool by the tier's arena (``KVCacheConfigurator.
    _resolve_memory_pool_config``, AFTER)."""
    if configurator.is_draft_worker:
        return pool_config
    STATE.plan = None
    config = tier_policy(configurator.server_args, configurator.page_size)
    if config is None:
        return pool_config
    tp_size = attention_tp_size(configurator)
    model_config = configurator.model_config
    num_layers = configurator.layer_info.num_effective_layers
    plan = plan_tier(
        config,
        pool_tokens=pool_config.max_total_num_tokens,
        kv_bytes_per_token=kv_bytes_per_token_of(
            model_config, tp_size, num_layers, configurator.kv_cache_dtype
        ),
        num_layers=num_layers,
        kv_heads=model_config.get_num_kv_heads(tp_size),
        head_dim=model_config.head_dim,
        full_dtype=configurator.kv_cache_dtype,
        page_size=configurator.page_size,
    )
    pool_config.max_total_num_tokens = plan.pool_tokens_after
    STATE.plan = plan
    logger.info("sglang-evict %s", plan.describe())
    return pool_config


def _after_alloc_memory_pool(result, model_runner, *args, **kwargs):
    """Allocate the arena after SGLang's pools (``ModelRunner.alloc_memory_pool``)."""
    plan = STATE.plan
    if plan is None or model_runner.is_draft_worker:
        return result
    from sglang_evict.tier.arena import make_arena

    config = plan.config
    arena, STATE.shared_arena = make_arena(
        config.tier_format(plan.head_dim),
        num_groups=plan.num_groups,
        num_layers=plan.num_layers,
        kv_heads=plan.kv_heads,
        full_dtype=plan.full_dtype,
        device=model_runner.device,
        shared_dir=config.shm_dir if config.compactor == "grpc" else None,
    )
    rows = model_runner.req_to_token_pool.req_to_token.shape[0]
    arena.enable_rows(rows, config.tier_max_tokens // config.tier_group_tokens)
    STATE.arena = arena
    backend = getattr(getattr(model_runner, "server_args", None), "attention_backend", None)
    if arena.device.type == "cpu" and backend != "triton":  # triton: its Triton kernel
        STATE.cpu_attention, STATE.cpu_kernel = cpu_tier_attention()
    return result


def cpu_tier_attention():
    """``(function, what it is)``: the tier's attention for SGLang's CPU engine, the
    compiled kernel (``sglang_evict_kernels.tier_cpu``; built at start, once per machine,
    so no decode step waits for a compiler) or, where it cannot be built, the tensor
    form, with one warning naming why."""
    from sglang_evict_kernels.tier_attention import tier_attention_torch
    from sglang_evict_kernels.tier_cpu import ENV_SWITCH, cpu_kernel_status, tier_attention_cpu

    logger.info(
        "sglang-evict: loading the tier's CPU kernel (the first start on a machine builds it)"
    )
    loaded, why = cpu_kernel_status()
    if loaded:
        return tier_attention_cpu, "compiled"
    logger.warning(
        "sglang-evict: the tier's CPU kernel is not in use: %s. Decode steps use the tensor "
        "form, several times slower at long tiers (%s=0 asks for it on purpose)",
        why,
        ENV_SWITCH,
    )
    return tier_attention_torch, f"tensor form: {why}"


def attach(manager, model_runner) -> None:
    """Give the cache's manager this process's arena (the radix-cache factory); refuse
    an attention backend whose output the tier cannot merge with."""
    if manager.tier_policy is None:
        return
    if model_runner is None:  # CPU drivers carve their own arena (cpu_driver)
        return
    backend = type(getattr(model_runner, "attn_backend", None)).__name__
    name = _BACKEND_CLASSES.get(backend)
    device = torch.device(model_runner.device).type
    if name not in TIER_BACKENDS or tier_backend_refused(name, device):
        where = "" if name not in TIER_BACKENDS else f" on CPU ({name} on {device} is not)"
        raise ValueError(
            f"--kv-tier-bits merges the tier's attention with SGLang's "
            f"{' or '.join(TIER_BACKENDS)} attention backends only so far{where}; this "
            f"server runs {backend}: pass --attention-backend torch_native or drop --kv-tier-*"
        )
    if STATE.arena is None:
        raise ValueError(
            "--kv-tier-bits is set but no tier arena was made when SGLang sized its memory "
            "pools (a draft or unified-memory pool?); drop --kv-tier-*"
        )
    attach_arena(manager, STATE.arena, STATE.shared_arena)


def _after_attention_forward(result, backend, *args, **kwargs):
    """Merge a decode layer's output with the tier's attention (``AttentionBackend.
    forward``, AFTER); extend batches: assert they read no tier."""
    arena = STATE.arena
    if arena is None:
        return result
    named = dict(zip(_FORWARD_ARGS, args, strict=False))
    q, layer, forward_batch = (named.get(n, kwargs.get(n)) for n in ("q", "layer", "forward_batch"))
    if q is None or layer is None or forward_batch is None:
        return result
    mode = forward_batch.forward_mode
    if mode.is_decode():
        return merge_decode(result, q, layer, forward_batch, arena, backend)
    if mode.is_extend() and arena.device.type == "cpu":
        rows = forward_batch.req_pool_indices
        if bool((arena.row_counts[rows] > 0).any()):
            raise AssertionError(
                "sglang-evict: an extend batch holds a request with tier groups; the tier is "
                "filled by decode passes only and given back before a row is reused"
            )
    return result


def merge_decode(o, q, layer, forward_batch, arena, backend):
    """``o`` ``[B, Hq * D]`` (``backend``'s attention over each request's full-precision
    KV) merged with its attention over its tier; requests without a tier unchanged."""
    from sglang_evict_kernels.tier_attention import merge_attention_states, tier_attention_torch

    rows = forward_batch.req_pool_indices
    counts = arena.row_counts[rows]
    triton = _BACKEND_CLASSES.get(type(backend).__name__) == "triton"
    # torch_native on CPU: no graph to keep static, so read the counts on the host and
    # only the groups some request holds. ``triton`` runs as on a GPU (CUDA graphs: no
    # host read, the row table's static width, the tier's Triton kernel), on CPU too.
    host_reads = arena.device.type == "cpu" and not triton
    if host_reads and not bool((counts > 0).any()):
        STATE.calls["decode_without"] += 1
        return o
    if layer_window(layer) >= 0:  # no tier token lies in a window (srt.windows)
        STATE.calls["decode_windowed"] += 1
        return o
    if getattr(layer, "logit_cap", 0):
        raise RuntimeError(
            "sglang-evict: the quantized tier does not support attention with a logit cap "
            "yet; drop --kv-tier-*"
        )
    hq, d = layer.tp_q_head_num, layer.qk_head_dim
    queries = q.reshape(-1, hq, d)
    b = queries.shape[0]
    table = arena.row_table[rows]
    if host_reads:
        table = table[:, : int(counts.max())]
        k_buffer = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
        req_to_token = backend.req_to_token_pool.req_to_token
        if (
            STATE.cpu_kernel == "compiled"
            and layer.v_head_dim == d
            and k_buffer.dtype in _CPU_KERNEL_DTYPES
            and o.dtype in _CPU_KERNEL_DTYPES
            and req_to_token.dtype == torch.int32
        ):
            return merged_by_cpu_kernel(
                o, queries, layer, forward_batch, arena, k_buffer, req_to_token, table, counts
            )
        tier_attention = STATE.cpu_attention or tier_attention_torch
    else:
        from sglang_evict_kernels.tier_attention import tier_attention_triton as tier_attention
    o_tier, lse_tier = tier_attention(
        queries, arena.stores[layer.layer_id], table, counts, arena.fmt, sm_scale=layer.scaling
    )
    if triton:
        metadata = backend.forward_metadata
        indptr = metadata.kv_indptr
        lse_full = split_kv_lse(
            metadata.attn_lse[:b], metadata.num_kv_splits[:b], indptr[1 : b + 1] - indptr[:b]
        )
        STATE.calls["split_kv_lse"] += 1
    else:
        lse_full = full_precision_lse(queries, layer, forward_batch, backend)
    merged, _ = merge_attention_states(
        o.reshape(b, hq, layer.v_head_dim).float(), lse_full, o_tier, lse_tier
    )
    STATE.calls["decode_merged"] += 1
    STATE.merged_by = getattr(tier_attention, "__name__", "")
    return merged.to(o.dtype).reshape(o.shape)


# What the compiled merge reads (an fp8 pool takes the tensor path, which upcasts;
# SGLang's req_to_token is int32).
_CPU_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def merged_by_cpu_kernel(
    o, queries, layer, forward_batch, arena, k_buffer, req_to_token, table, counts
):
    """``merge_decode``'s result on SGLang's CPU engine in one compiled call per layer
    (``tier_decode_merge_cpu``: the tier's attention, the full side's log-sum-exp read
    from the pool where the keys lie, the merge), instead of a few dozen tensor
    operations; the same result as the tensor path to float32 rounding."""
    from sglang_evict_kernels.tier_cpu import tier_decode_merge_cpu

    merged = tier_decode_merge_cpu(
        queries,
        o.reshape(queries.shape[0], -1),
        k_buffer,
        req_to_token,
        forward_batch.req_pool_indices,
        forward_batch.seq_lens,
        arena.stores[layer.layer_id],
        table,
        counts,
        arena.fmt,
        sm_scale=layer.scaling,
    )
    STATE.calls["decode_merged"] += 1
    STATE.merged_by = "tier_decode_merge_cpu"
    return merged.reshape(o.shape)


def full_precision_lse(queries, layer, forward_batch, backend):
    """float32 ``[B, Hq]``: the log-sum-exp of each query's scores over the keys
    ``backend`` attended, ``req_to_token[row, :seq_len]`` (the new token's included)."""
    from sglang_evict_kernels.tier_attention import full_precision_lse_reference

    seq_lens = forward_batch.seq_lens
    width = int(forward_batch.seq_lens_cpu.max()) if forward_batch.seq_lens_cpu is not None else 0
    if width == 0:
        width = int(seq_lens.max())
    return full_precision_lse_reference(
        queries,
        backend.token_to_kv_pool.get_key_buffer(layer.layer_id),
        backend.req_to_token_pool.req_to_token,
        forward_batch.req_pool_indices,
        seq_lens,
        layer.scaling,
        width=width,
    )


@functools.cache
def _sglang_min_block_kv() -> int:
    """The token granularity of SGLang's split-KV decode splits (read once)."""
    from sglang.kernels.ops.attention.decode_attention import _MIN_BLOCK_KV

    return _MIN_BLOCK_KV


def split_kv_lse(split_lse, num_kv_splits, kv_lens, min_block_kv: int | None = None):
    """float32 ``[B, Hq]``: the log-sum-exp of each query over its request's KV, from the
    split-KV decode's stage 1 (``split_lse`` ``[B, Hq, max splits]``, each split's own).
    As SGLang's stage 2 reduces them: a request of ``L`` tokens in ``S`` splits has
    splits of ``P = ceil(ceil(L / S) / min_block_kv) * min_block_kv`` tokens, and split
    ``j`` counts when ``j * P < L`` (slots past those hold stale values). Static shapes."""
    if min_block_kv is None:
        min_block_kv = _sglang_min_block_kv()
    lens = kv_lens.to(torch.int64)
    splits = num_kv_splits.to(torch.int64).clamp(min=1)
    per_split = (-(-lens // splits) + min_block_kv - 1) // min_block_kv * min_block_kv
    starts = torch.arange(split_lse.shape[-1], device=lens.device)[None, :] * per_split[:, None]
    live = starts < lens[:, None]  # [B, splits]
    masked = split_lse.float().masked_fill(~live[:, None, :], float("-inf"))
    return torch.logsumexp(masked, dim=-1)


def report() -> dict | None:
    """The tier's part of the plugin's ``get_server_info`` report (None: no tier)."""
    plan, arena = STATE.plan, STATE.arena
    if plan is None:
        return None
    held = 0 if arena is None else arena.num_groups - arena.free_groups
    group_tokens = plan.config.tier_group_tokens
    return {
        "bits": plan.config.tier_bits,
        "group_tokens": group_tokens,
        "kv_heads": plan.kv_heads,  # this rank's: its share under tensor parallelism
        "num_groups": plan.num_groups,
        "groups_held": held,
        "tokens_held": held * group_tokens,
        "arena_bytes": plan.arena_bytes,
        "bytes_per_group": plan.arena_bytes // (plan.num_groups + 1),
        "pool_tokens_before": plan.pool_tokens_before,
        "pool_tokens_after": plan.pool_tokens_after,
        "requests_with_tier": 0 if arena is None else len(arena.owned),
        "hook_calls": dict(STATE.calls),
        "cpu_kernel": STATE.cpu_kernel or None,
        "merged_by": STATE.merged_by or None,
    }
