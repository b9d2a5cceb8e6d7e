"""Query capture inside SGLang's attention: each layer's queries of every decode and
extend forward are copied into the plugin's query ring (``sglang_evict.query_capture``)
for the query-reading scorers (``window``, ``rkv``). The attention backend SGLang chose
runs unchanged: no eager fallback, no attention scores materialised.

Where: a BEFORE hook on ``AttentionBackend.forward``, the method every attention layer
reaches: ``RadixAttention.forward`` calls it eagerly, inside a captured decode CUDA graph,
and from the prefill graphs' split ops (which run eagerly between graph pieces); the
hybrid and two-batch-overlap backends delegate to their children's. The backends' own
``forward_decode``/``forward_extend`` (``torch_native``, ``triton``, ``flashinfer``,
...) get the same arguments as without the plugin: the hook only reads them. The query
is taken as the backend receives it, after the model applied RoPE (what the scorers
need), with the batch's request-pool rows and logical positions (the plugin's offsets
included: ``hooks``).

When the ring is made (the order matters: the decode CUDA graphs must hold its writes)::

    ModelRunner init (scheduler process)
      KVCacheConfigurator._resolve_memory_pool_config  AFTER: the KV pool is sized down
                                                       by the ring, in whole pages
      ModelRunner.alloc_memory_pool                    AFTER: the ring is allocated
      attention backends, CUDA graph capture           graphs record the ring's copies
    radix_cache_factory                                the manager takes the ring

Slots (``query_capture``, shared): the ring holds ``default_slots`` requests (or
``--kv-query-slots``), not one per request-pool row: only a request a pass may read the
queries of holds one (``needs_query_slot``). Admission reserves it
(``sglang_evict.srt.admission``: a request finding none free waits), the ``ForwardBatch``
of an extend batch, built on the forward stream after every earlier forward, points the
rows SGLang handed to new requests at their slots and empties those slots
(``claim_query_rows``: no query of a slot's previous request is ever read as the new
one's), and the request's release gives it back (``EvictionManager.forget``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from sglang_evict.config import EvictionConfig
from sglang_evict.query_capture import QueryRing, RingShape, default_slots, pool_after_reserving
from sglang_evict.scorers import SCORERS
from sglang_evict.srt.request_policy import policy_of
from sglang_evict.srt.versioned import attention_tp_size, req_kv

logger = logging.getLogger(__name__)

HOOK_ATTENTION_FORWARD = "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.forward"
HOOK_RESOLVE_POOL = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._resolve_memory_pool_config"
)
HOOK_ALLOC_POOL = "sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool"

_FORWARD_ARGS = ("q", "k", "v", "layer", "forward_batch")
# Arguments with which a backend applies RoPE (or MLA's split rope) itself: the query it
# receives is then not the one the scorers need.
_ROPE_IN_BACKEND_ARGS = ("cos_sin_cache", "q_rope")


@dataclass
class CapturePlan:
    """What the memory hook decided: the ring's shape and what it costs the KV pool."""

    shape: RingShape
    kv_bytes_per_token: int
    page_size: int
    pool_tokens_before: int
    pool_tokens_after: int

    @property
    def ring_bytes(self) -> int:
        return self.shape.total_bytes

    @property
    def reserved_tokens(self) -> int:
        return self.pool_tokens_before - self.pool_tokens_after

    def describe(self) -> str:
        s = self.shape
        return (
            f"query capture: W={s.window} queries x {s.num_layers} layers x {s.num_q_heads} "
            f"q heads x head_dim {s.head_dim} x {s.dtype} per slot, {s.slots} slots for "
            f"{s.num_request_rows} request rows = {self.ring_bytes} bytes "
            f"({self.ring_bytes / 2**20:.2f} MiB, {self.pool_share:.1%} of the KV pool), "
            f"counted as {self.reserved_tokens} KV tokens of {self.kv_bytes_per_token} bytes: "
            f"KV pool {self.pool_tokens_before} -> {self.pool_tokens_after} tokens"
        )

    @property
    def pool_share(self) -> float:
        """The ring's bytes over the KV pool's before it (what the ring takes)."""
        return self.ring_bytes / max(self.pool_tokens_before * self.kv_bytes_per_token, 1)


@dataclass
class _Capture:
    """This scheduler process's capture state (one model runner per process)."""

    plan: CapturePlan | None = None
    ring: QueryRing | None = None
    attention_backend: str | None = None  # the runner's backend class, for the report
    calls: dict = field(default_factory=lambda: {"decode": 0, "extend": 0})


STATE = _Capture()


def plugin_policy(server_args, page_size: int) -> EvictionConfig | None:
    """The policy when this server runs the plugin, else None (also when the policy is
    missing or invalid: the cache factory refuses that server with the fix)."""
    from sglang_evict.srt.server_args import BACKEND_NAME, config_from_env

    if getattr(server_args, "radix_cache_backend", None) != BACKEND_NAME:
        return None
    try:
        return config_from_env(page_size)
    except ValueError:
        return None


def capture_policy(server_args, page_size: int) -> EvictionConfig | None:
    """The policy when this server runs the plugin with a query-reading scorer, else
    None (``plugin_policy``)."""
    config = plugin_policy(server_args, page_size)
    return config if config is not None and config.make_scorer().needs_queries else None


def kv_bytes_per_token_of(model_config, tp_size: int, num_layers: int, kv_cache_dtype) -> int:
    """SGLang's own bytes per KV token of an MHA pool (pool_configurator's cell size)."""
    kv_heads = model_config.get_num_kv_heads(tp_size)
    kv_element = torch.empty((), dtype=kv_cache_dtype).element_size()
    return kv_heads * (model_config.head_dim + model_config.v_head_dim) * num_layers * kv_element


def plan_capture(
    config: EvictionConfig,
    *,
    pool_tokens: int,
    num_request_rows: int,
    model_config,
    tp_size: int,
    num_layers: int,
    kv_cache_dtype: torch.dtype,
    model_dtype: torch.dtype,
    page_size: int,
) -> CapturePlan:
    """The ring for this model and request pool, and the KV pool left beside it: its
    slots ``--kv-query-slots`` or ``default_slots`` of the pool (at most one per row).
    Raises ``ValueError`` naming the flags when the ring leaves no pool."""
    kv_bytes_per_token = kv_bytes_per_token_of(model_config, tp_size, num_layers, kv_cache_dtype)
    slots = config.query_slots or default_slots(
        pool_tokens=pool_tokens,
        budget_tokens=config.kv_budget_tokens,
        num_request_rows=num_request_rows,
    )
    shape = RingShape(
        num_layers=num_layers,
        num_request_rows=num_request_rows,
        window=config.query_window_tokens,
        num_q_heads=model_config.get_num_attention_heads(tp_size),
        head_dim=model_config.head_dim,
        dtype=model_dtype,
        num_slots=min(slots, num_request_rows),
    )
    reserved, after = pool_after_reserving(
        pool_tokens, shape.total_bytes, kv_bytes_per_token, page_size
    )
    if after < page_size:
        raise ValueError(
            f"--kv-scorer {config.scorer} keeps the last {shape.window} queries of "
            f"{shape.slots} requests: {shape.total_bytes / 2**20:.1f} MiB, "
            f"{reserved} KV tokens, but the KV pool holds {pool_tokens}; lower "
            f"--kv-query-slots or --kv-query-window, raise --mem-fraction-static or "
            f"--max-total-tokens, or use a scorer that reads no queries"
        )
    return CapturePlan(shape, kv_bytes_per_token, page_size, pool_tokens, after)


# --- hooks ----------------------------------------------------------------------------


def _after_resolve_memory_pool_config(pool_config, configurator, *args, **kwargs):
    """Shrink the KV pool by the ring (``KVCacheConfigurator._resolve_memory_pool_config``,
    AFTER): the pool and the ring together take what the pool alone would have."""
    if configurator.is_draft_worker:  # shares the target's request pool and ring
        return pool_config
    STATE.plan = None
    page_size = configurator.page_size
    config = capture_policy(configurator.server_args, page_size)
    if config is None:
        return pool_config
    plan = plan_capture(
        config,
        pool_tokens=pool_config.max_total_num_tokens,
        num_request_rows=pool_config.max_running_requests + 1,  # + SGLang's padding row
        model_config=configurator.model_config,
        tp_size=attention_tp_size(configurator),
        num_layers=configurator.layer_info.num_effective_layers,
        kv_cache_dtype=configurator.kv_cache_dtype,
        model_dtype=configurator.model_dtype,
        page_size=page_size,
    )
    pool_config.max_total_num_tokens = plan.pool_tokens_after
    STATE.plan = plan
    logger.info("sglang-evict %s", plan.describe())
    return pool_config


def _after_alloc_memory_pool(result, model_runner, *args, **kwargs):
    """Allocate the ring right after SGLang's pools (``ModelRunner.alloc_memory_pool``,
    AFTER), before the attention backends and CUDA graphs exist."""
    plan = STATE.plan
    if plan is None or model_runner.is_draft_worker:
        return result
    rows = model_runner.req_to_token_pool.req_to_token.shape[0]
    if rows != plan.shape.num_request_rows:
        raise RuntimeError(
            f"sglang-evict sized the query ring for {plan.shape.num_request_rows} request rows, "
            f"but SGLang's request pool has {rows}"
        )
    STATE.ring = QueryRing(plan.shape, device=model_runner.device)
    return result


def _before_attention_forward(backend, *args, **kwargs):
    """Copy the layer's queries into the ring (``AttentionBackend.forward``, BEFORE);
    the arguments go on to the backend unchanged."""
    ring = STATE.ring
    if ring is None:
        return None
    named = dict(zip(_FORWARD_ARGS, args, strict=False))  # save_kv_cache may follow
    q, layer, forward_batch = (named.get(n, kwargs.get(n)) for n in ("q", "layer", "forward_batch"))
    if q is None or layer is None or forward_batch is None:
        return None
    capture_layer_queries(ring, q, layer, forward_batch, kwargs)
    return None


def capture_layer_queries(ring: QueryRing, q, layer, forward_batch, kwargs: dict) -> None:
    """One layer's part of a forward: decode batches write every request's query,
    extend batches each request's last ``W``; other modes (idle, speculative) nothing."""
    mode = forward_batch.forward_mode
    is_decode = mode.is_decode()
    if not is_decode and not (mode.is_extend() and not mode.is_target_verify()):
        return
    if getattr(layer, "is_cross_attention", False):
        return
    rope_args = [name for name in _ROPE_IN_BACKEND_ARGS if kwargs.get(name) is not None]
    if rope_args:
        raise RuntimeError(
            f"sglang-evict query capture: this model's attention applies RoPE inside the "
            f"backend ({', '.join(rope_args)}), so the queries it receives are not the ones "
            f"--kv-scorer {{window,rkv}} needs; use a scorer that reads no queries"
        )
    if layer.layer_id >= ring.shape.num_layers:
        raise RuntimeError(
            f"sglang-evict query capture: attention layer {layer.layer_id} is outside the "
            f"{ring.shape.num_layers} layers the ring was sized for"
        )
    queries = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    num_tokens = queries.shape[0]
    positions = forward_batch.positions[:num_tokens]
    if is_decode:
        STATE.calls["decode"] += 1
        rows = forward_batch.req_pool_indices[:num_tokens]
        ring.write_decode(layer.layer_id, queries, rows, positions)
    else:
        STATE.calls["extend"] += 1
        ring.write_extend(
            layer.layer_id,
            queries,
            forward_batch.req_pool_indices,
            positions,
            forward_batch.extend_start_loc,
            forward_batch.extend_seq_lens,
        )


def needs_query_slot(manager, req) -> bool:
    """Whether a pass may read ``req``'s queries: it evicts, with a scorer that reads
    queries, and its prompt plus ``max_new_tokens`` exceed its budget (a request that
    never holds more than its budget is never passed)."""
    policy = policy_of(req) or manager.default_policy
    if not policy.enabled or not SCORERS[policy.scorer].needs_queries:
        return False
    total = len(req.origin_input_ids) + req.sampling_params.max_new_tokens
    return total > policy.kv_budget_tokens


def claim_query_rows(ring: QueryRing, req_to_token_pool, reqs, manager=None) -> None:
    """Point the rows SGLang handed to new requests since their last claim (the request
    pool counts each hand-out in ``req_generation``) at their slots, emptied: the
    reserved one of each request ``needs_query_slot`` (all, without a ``manager``)."""
    rows = [req_kv(req).req_pool_idx for req in reqs]
    generations = [int(req_to_token_pool.req_generation[row]) for row in rows]
    needs = [manager is None or needs_query_slot(manager, req) for req in reqs]
    ring.claim_rows(rows, generations, [req.rid for req in reqs], needs)


def on_forward_batch(forward_batch, batch, model_runner, manager=None) -> None:
    """``ForwardBatch.init_new`` of an extend batch (on the forward stream): claim the
    rows of its requests before the forward writes them."""
    ring = STATE.ring
    if ring is None or batch is None or not forward_batch.forward_mode.is_extend():
        return
    claim_query_rows(ring, model_runner.req_to_token_pool, batch.reqs, manager)


def attach(manager, model_runner) -> None:
    """Give the cache's manager this process's ring (the radix-cache factory). A cache
    built without a model runner (tests, CPU drivers) runs no attention here: it gets
    no ring, and a query-reading scorer's passes refuse with the fix."""
    if model_runner is None:
        return
    STATE.attention_backend = type(getattr(model_runner, "attn_backend", None)).__name__
    if not manager.scorer.needs_queries:
        return
    ring = STATE.ring
    if ring is None:
        raise ValueError(
            f"--kv-scorer {manager.scorer.name} reads captured queries, but no query ring was "
            f"made when SGLang sized its memory pools (a draft or unified-memory pool?); "
            f"use a scorer that reads no queries"
        )
    if ring.shape.num_request_rows != manager.num_request_rows:
        raise ValueError(
            f"the query ring has {ring.shape.num_request_rows} request rows, the request "
            f"pool {manager.num_request_rows}"
        )
    manager.query_ring = ring


def report() -> dict | None:
    """The capture's part of the plugin's ``get_server_info`` report."""
    plan = STATE.plan
    if plan is None:
        return {"attention_backend": STATE.attention_backend, "ring_bytes": 0}
    shape = plan.shape
    return {
        "attention_backend": STATE.attention_backend,
        "window": shape.window,
        "num_layers": shape.num_layers,
        "num_q_heads": shape.num_q_heads,
        "head_dim": shape.head_dim,
        "dtype": str(shape.dtype).removeprefix("torch."),
        "num_rows": shape.num_rows,
        "num_slots": shape.slots,
        "pool_share": plan.pool_share,
        "ring_bytes": plan.ring_bytes,
        "allocated_bytes": 0 if STATE.ring is None else STATE.ring.nbytes,
        "free_slots": None if STATE.ring is None else STATE.ring.free_slots,
        "slot_misses": None if STATE.ring is None else STATE.ring.slot_misses,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "reserved_kv_tokens": plan.reserved_tokens,
        "pool_tokens_before": plan.pool_tokens_before,
        "pool_tokens_after": plan.pool_tokens_after,
        "hook_calls": dict(STATE.calls),
    }
