"""SGLang's memory classes driven on CPU as its scheduler drives them (``MemoryDriver``):
the demo's and the tests' engine, and the quality harness's."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from torch import Tensor

from sglang_evict.config import EvictionConfig
from sglang_evict.passes.manager import EvictionManager, PassResult
from sglang_evict.query_capture import QueryRing, RingShape
from sglang_evict.srt.backend import EvictingRadixCache
from sglang_evict.srt.capture import claim_query_rows
from sglang_evict.srt.hooks import compact_decode_batch
from sglang_evict.srt.request_policy import attach_policy
from sglang_evict.srt.versioned import (
    adopt_prefix,
    advance_after_decode_alloc,
    match_prefix,
    publish_prefill,
    release,
    req_kv,
    set_prefilled,
)
from sglang_evict.tier.demotion import attach_arena


@dataclass(frozen=True)
class Match:
    """A prefix match: the KV slots of the matched tokens and the tree node it ends on."""

    indices: Tensor
    last_node: object


def publish_cpu_runtime() -> None:
    """Publish process-wide server args, as a scheduler does at start (SGLang's release
    path reads them). For CPU drivers and tests only; a server publishes its own."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    publish(ServerArgs(model_path="dummy", device="cpu"), role="test")


class MemoryDriver:
    """SGLang's memory classes on CPU tensors — ``ReqToTokenPool``, the token or
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

    The model (``sglang_evict.models.reference_model``) reads and writes K/V at the slots this
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
            num_q_heads=model.num_heads,
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
        device: str = "cpu",
        num_q_heads: int | None = None,
    ) -> None:
        """``num_q_heads``: the model's query heads; with a query-reading scorer the
        driver then gives the plugin a query ring (``record_queries`` feeds it)."""
        from sglang.srt.mem_cache.allocator import (
            PagedTokenToKVPoolAllocator,
            TokenToKVPoolAllocator,
        )
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        publish_cpu_runtime()
        self.device = device
        self.page_size = page_size
        # The tier's arena is a share of the KV memory: the pool gives up its slots.
        self.tier_arena = self.shared_arena = None
        self.kv_memory_tokens = num_tokens  # the KV memory, in full-precision slots
        if config is not None and config.tier_bits is not None:
            self.tier_arena, self.shared_arena, num_tokens = _carve_tier(
                config,
                num_tokens=num_tokens,
                page_size=page_size,
                num_layers=num_layers,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                dtype=dtype,
                device=device,
            )
        self.num_tokens = num_tokens
        self.kv_pool = MHATokenToKVPool(
            size=num_tokens,
            page_size=page_size,
            dtype=dtype,
            head_num=num_kv_heads,
            head_dim=head_dim,
            layer_num=num_layers,
            device=device,
            enable_memory_saver=False,
        )
        if page_size == 1:
            self.allocator = TokenToKVPoolAllocator(
                num_tokens, dtype, device, self.kv_pool, need_sort=False
            )
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                num_tokens, page_size, dtype, device, self.kv_pool, need_sort=False
            )
        self.req_to_token_pool = ReqToTokenPool(
            max_requests, max_context, device, enable_memory_saver=False
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
        manager = self.evictor
        if manager is not None and self.tier_arena is not None:
            attach_arena(manager, self.tier_arena, self.shared_arena)
        if manager is not None and manager.scorer.needs_queries and num_q_heads is not None:
            shape = RingShape(
                num_layers=num_layers,
                num_request_rows=self.req_to_token_pool.req_to_token.shape[0],
                window=config.query_window_tokens,
                num_q_heads=num_q_heads,
                head_dim=head_dim,
                dtype=dtype,
            )
            manager.query_ring = QueryRing(shape, device)
        self.running: dict[str, object] = {}

    @property
    def evictor(self) -> EvictionManager | None:
        return self.cache.evictor if isinstance(self.cache, EvictingRadixCache) else None

    def match(self, tokens, extra_key: str | None = None) -> Match:
        """The radix tree's longest cached prefix of ``tokens``."""
        return Match(*match_prefix(self.cache, tokens, extra_key))

    def admit(
        self,
        rid: str,
        prompt: list[int],
        extra_key: str | None = None,
        custom_params: dict | None = None,
    ):
        """Admit a request; returns ``(req, prefix_len, extend_slots)``: the caller writes
        the K/V of ``prompt[prefix_len:]`` at ``extend_slots``, then calls ``prefill_done``.
        ``custom_params`` are the request's (its per-request policy, checked and attached
        as the scheduler's queue hook does; a refused one raises ``RequestPolicyError``)."""
        from array import array

        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        params = SamplingParams(max_new_tokens=1 << 20, custom_params=custom_params)
        req = Req(rid, "", array("q", prompt), params)
        req.extra_key = extra_key
        manager = self.evictor
        if manager is not None:
            attach_policy(req, manager.config, manager.request_limits)
        # As SGLang's scheduler does (max_prefix_len = input_len - 1): at least one
        # prompt token is computed, so a fully cached prompt still yields logits.
        match = self.match(prompt[:-1], extra_key)
        prefix = match.indices
        adopt_prefix(self.cache, req, prefix, match.last_node)
        if self.req_to_token_pool.alloc([req]) is None:
            raise RuntimeError("request pool exhausted")
        if self.evictor is not None and self.evictor.query_ring is not None:
            claim_query_rows(self.evictor.query_ring, self.req_to_token_pool, [req])
        n_prefix, n_total = len(prefix), len(prompt)
        if self.page_size == 1:
            slots = self.allocator.alloc(n_total - n_prefix)
        else:
            last_loc = int(prefix[-1]) if n_prefix else -1
            on_device = lambda value: torch.tensor([value], device=self.device)  # noqa: E731
            slots = self.allocator.alloc_extend(
                on_device(n_prefix),
                torch.tensor([n_prefix]),
                on_device(n_total),
                torch.tensor([n_total]),
                on_device(last_loc),
                n_total - n_prefix,
            )
        if slots is None:
            raise RuntimeError("KV pool exhausted at prefill")
        row = torch.cat([prefix.to(self.device, torch.int64), slots.to(torch.int64)])
        row_index = req_kv(req).req_pool_idx
        self.req_to_token_pool.write((row_index, slice(0, n_total)), row.to(torch.int32))
        set_prefilled(req, n_total)
        self.running[rid] = req
        return req, n_prefix, slots.to(torch.int64)

    def prefill_done(self, req) -> None:
        publish_prefill(req, self.cache)

    def schedule_batch(self, reqs: list):
        """The ``ScheduleBatch`` SGLang's scheduler holds for a decode step of ``reqs``,
        before ``prepare_for_decode`` (lengths on the pool's device, ``seq_lens_cpu``
        on the host)."""
        from types import SimpleNamespace

        from sglang.srt.managers.schedule_batch import ScheduleBatch
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
        lens = [req_kv(r).kv_committed_len for r in reqs]
        device = self.device
        rows = [req_kv(r).req_pool_idx for r in reqs]
        batch.req_pool_indices = torch.tensor(rows, dtype=torch.int64, device=device)
        batch.req_pool_indices_cpu = torch.tensor(rows, dtype=torch.int64)
        batch.seq_lens = torch.tensor(lens, dtype=torch.int64, device=device)
        batch.seq_lens_cpu = torch.tensor(lens, dtype=torch.int64)
        batch.orig_seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        return batch

    def prepare_decode(self, reqs: list) -> tuple[Tensor, Tensor, list[PassResult | None]]:
        """Returns ``(out_slots, positions, passes)`` for one decode step of ``reqs``."""
        from sglang.srt.mem_cache.allocation import alloc_for_decode

        batch = self.schedule_batch(reqs)
        manager = self.evictor
        done = {} if manager is None else {r.rid: r for r in compact_decode_batch(manager, batch)}
        passes: list[PassResult | None] = [done.get(req.rid) for req in reqs]
        out_slots = alloc_for_decode(batch, token_per_req=1)
        if out_slots is None:
            raise RuntimeError("KV pool exhausted at decode")
        advance_after_decode_alloc(reqs)  # what prepare_for_decode advances
        seq_lens = batch.seq_lens + 1
        positions = (
            manager.decode_positions(batch.req_pool_indices, seq_lens)
            if manager is not None
            else seq_lens - 1
        )
        return out_slots.to(torch.int64), positions, passes

    def finish(self, req) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        if not req.finished():  # as SGLang's scheduler marks it before releasing
            req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        release(req, self.cache, insert=True)
        del self.running[req.rid]

    def retract(self, req) -> None:
        """What ``ScheduleBatch.retract_decode`` does to a request (``release_req``): free
        its KV without inserting it into the tree and reset it for a later re-prefill of
        its prompt and output tokens."""
        release(req, self.cache, insert=False)
        req.reset_for_retract()
        del self.running[req.rid]

    @staticmethod
    def kv(req):
        """``req``'s KV bookkeeping (row index, committed, protected and allocated
        lengths) under the installed SGLang's names (``versioned.req_kv``)."""
        return req_kv(req)

    def row(self, req) -> Tensor:
        kv = req_kv(req)
        return self.req_to_token_pool.req_to_token[kv.req_pool_idx, : kv.kv_committed_len].long()

    def positions(self, req) -> Tensor:
        manager = self.evictor
        kv_len = req_kv(req).kv_committed_len
        if manager is None:
            return torch.arange(kv_len)
        return manager.positions(req.rid, kv_len)

    def tier_context(self, req):
        """``req``'s quantized tier for the model's forward (None: no tier, or an
        empty one)."""
        arena = self.tier_arena
        if arena is None or not arena.groups_of(req.rid):
            return None
        from sglang_evict.models.reference_model import TierContext

        table, counts = arena.table([req.rid])
        return TierContext(arena.stores, table, counts, arena.fmt)

    def tier_tokens(self, req) -> int:
        return 0 if self.tier_arena is None else self.tier_arena.tokens_of(req.rid)

    def free_tokens(self) -> int:
        return int(self.allocator.available_size())

    def held_tokens(self) -> int:
        """KV slots held by running requests (their private pages) and the radix tree."""
        return self.num_tokens - self.free_tokens()


def _carve_tier(
    config: EvictionConfig,
    *,
    num_tokens: int,
    page_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
):
    """``(arena, its SharedArena or None, pool tokens)``: the tier's arena sized as
    ``config.tier_pool_share`` of ``num_tokens`` slots' KV memory, the pool keeping the
    whole pages left: the plan SGLang's engine makes (``srt.tier.plan_tier``); shared
    with the compactor sidecar when the config uses one."""
    from sglang_evict.srt.tier import plan_tier
    from sglang_evict.tier.arena import make_arena

    slot_bytes = (
        2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    )
    plan = plan_tier(
        config,
        pool_tokens=num_tokens,
        kv_bytes_per_token=slot_bytes,
        num_layers=num_layers,
        kv_heads=num_kv_heads,
        head_dim=head_dim,
        full_dtype=dtype,
        page_size=page_size,
    )
    arena, shared = make_arena(
        config.tier_format(head_dim),
        num_groups=plan.num_groups,
        num_layers=num_layers,
        kv_heads=num_kv_heads,
        full_dtype=dtype,
        device=device,
        shared_dir=config.shm_dir if config.compactor == "grpc" else None,
    )
    return arena, shared, plan.pool_tokens_after
