"""What SGLang's KV pool and request pool would be on a GPU of a given size, and what
the query ring takes of them: the dry run's figures (``serve --dry-run --gpu-memory-gib``)
for a GPU this machine may not have.

SGLang's own arithmetic (0.5.17 and 0.5.23 agree on every step used here):

* ``mem_fraction_static``: ``ServerArgs._handle_gpu_memory_settings``, run by SGLang's
  own argument parsing with the GPU's capacity in MiB (``parse_server_args``'s
  ``gpu_memory_mib``) in place of the device's;
* the KV pool (``KVCacheConfigurator._profile_available_bytes``): the memory free
  before the weights load times ``mem_fraction_static``, less the weights, in cells of
  ``kv_bytes_per_token``;
* the request pool (``KVCacheConfigurator.resolve_max_num_reqs``):
  ``clamp(pool_tokens / context_len * 512, 2048, 4096)`` rows (``--max-running-requests``
  instead when given), at most ``pool_tokens // 2``, plus SGLang's padding row.

Estimates, said where printed: the weights are the model's parameters (counted on
PyTorch's meta device from config.json, no weights read) at the model's dtype, split
evenly across tensor-parallel ranks; the memory free before the weights load is taken
as the whole GPU (the CUDA context's few hundred MiB not subtracted), so the pool is
at most this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_evict.config import EvictionConfig
from sglang_evict.srt.capture import kv_bytes_per_token_of, plan_capture

MIN_REQUEST_ROWS, MAX_REQUEST_ROWS = 2048, 4096  # resolve_max_num_reqs's clamp


@dataclass(frozen=True)
class PoolEstimate:
    gpu_memory_mib: float
    mem_fraction_static: float
    num_parameters: int
    weight_bytes: int  # per rank
    kv_bytes_per_token: int
    pool_tokens: int
    num_request_rows: int  # SGLang's padding row included

    @property
    def pool_bytes(self) -> int:
        return self.pool_tokens * self.kv_bytes_per_token


def _attention_tp_size(server_args) -> int:
    """Ranks one attention layer's heads are split over (DP attention splits the TP
    group into ``dp_size`` attention groups)."""
    tp_size = server_args.tp_size or 1
    if getattr(server_args, "enable_dp_attention", False):
        return max(tp_size // (server_args.dp_size or 1), 1)
    return tp_size


def _kv_dtype(server_args, model_config) -> torch.dtype:
    """The KV pool's dtype: the model's, or an 8-bit one (``--kv-cache-dtype fp8_*``)."""
    auto = server_args.kv_cache_dtype in (None, "auto")
    return model_config.dtype if auto else torch.float8_e4m3fn


def count_parameters(hf_config) -> int:
    """The model's parameters, counted on the meta device (nothing allocated, nothing
    read). Raises ``ValueError`` when transformers cannot build the model."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError, TypeError, ImportError) as error:
        raise ValueError(f"transformers cannot build {type(hf_config).__name__}: {error}") from None
    return sum(p.numel() for p in model.parameters())


def request_rows(pool_tokens: int, context_len: int, max_running_requests: int | None) -> int:
    """SGLang's request-pool rows for a pool of ``pool_tokens`` (padding row included)."""
    if max_running_requests is not None:
        rows = min(max_running_requests, pool_tokens // 2)
    else:
        estimated = int(pool_tokens / context_len * 512)
        rows = min(max(min(estimated, MAX_REQUEST_ROWS), MIN_REQUEST_ROWS), pool_tokens // 2)
    return rows + 1


def estimate_pool(server_args, gpu_memory_mib: float) -> PoolEstimate:
    """SGLang's pools for ``server_args`` (parsed for a GPU of ``gpu_memory_mib``) on
    one rank. Raises ``ValueError`` naming the fix when the weights leave no pool."""
    from sglang.srt.configs.model_config import ModelConfig

    model_config = ModelConfig.from_server_args(server_args)
    tp_size = _attention_tp_size(server_args)
    dtype = model_config.dtype
    kv_dtype = _kv_dtype(server_args, model_config)
    num_parameters = count_parameters(model_config.hf_config)
    element = torch.empty((), dtype=dtype).element_size()
    weight_bytes = num_parameters * element // (server_args.tp_size or 1)
    fraction = server_args.mem_fraction_static
    if fraction is None:  # 0.5.23 decides it as the server starts
        raise ValueError(
            "this SGLang release picks --mem-fraction-static as the server starts, not "
            "when it parses its arguments: give --mem-fraction-static for the estimate"
        )
    static_bytes = int(gpu_memory_mib * 2**20 * fraction)
    kv_bytes_per_token = kv_bytes_per_token_of(
        model_config, tp_size, model_config.num_hidden_layers, kv_dtype
    )
    pool_tokens = (static_bytes - weight_bytes) // kv_bytes_per_token
    if server_args.max_total_tokens is not None:
        pool_tokens = min(pool_tokens, server_args.max_total_tokens)
    if pool_tokens <= 0:
        raise ValueError(
            f"on a {gpu_memory_mib / 1024:.0f} GiB GPU the weights ({weight_bytes / 2**30:.1f} "
            f"GiB a rank) leave no KV pool at --mem-fraction-static {fraction}: raise it, "
            f"raise --tp-size, or give a larger --gpu-memory-gib"
        )
    return PoolEstimate(
        gpu_memory_mib=gpu_memory_mib,
        mem_fraction_static=fraction,
        num_parameters=num_parameters,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_bytes_per_token,
        pool_tokens=pool_tokens,
        num_request_rows=request_rows(
            pool_tokens, model_config.context_len, server_args.max_running_requests
        ),
    )


def ring_line(config: EvictionConfig, server_args, gpu_memory_mib: float) -> str:
    """The dry run's line on the query ring against SGLang's KV pool on that GPU: the
    ring the server's own planner (``capture.plan_capture``) would make there."""
    import dataclasses

    from sglang.srt.configs.model_config import ModelConfig

    estimate = estimate_pool(server_args, gpu_memory_mib)
    model_config = ModelConfig.from_server_args(server_args)
    plan = plan_capture(
        config,
        pool_tokens=estimate.pool_tokens,
        num_request_rows=estimate.num_request_rows,
        model_config=model_config,
        tp_size=_attention_tp_size(server_args),
        num_layers=model_config.num_hidden_layers,
        kv_cache_dtype=_kv_dtype(server_args, model_config),
        model_dtype=model_config.dtype,
        page_size=server_args.page_size or 1,
    )
    shared = plan.shape
    per_row = dataclasses.replace(shared, num_slots=None)
    pool = estimate.pool_bytes
    return (
        f"# query ring, for a GPU of {gpu_memory_mib / 1024:g} GiB (an estimate: SGLang's "
        f"mem_fraction_static {estimate.mem_fraction_static} for it, "
        f"{estimate.num_parameters / 1e9:.2f}B parameters = "
        f"{estimate.weight_bytes / 2**30:.1f} GiB of weights a rank, KV pool at most "
        f"{estimate.pool_tokens} tokens = {pool / 2**30:.1f} GiB, "
        f"{estimate.num_request_rows} request rows): {shared.slots} slots x "
        f"{shared.bytes_per_row / 2**20:.1f} MiB = {shared.total_bytes / 2**30:.2f} GiB, "
        f"{shared.total_bytes / pool:.1%} of the KV pool (one slot per request row would "
        f"take {per_row.total_bytes / 2**30:.1f} GiB, {per_row.total_bytes / pool:.0%})"
    )
