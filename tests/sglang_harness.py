"""Drive SGLang's real memory classes (ReqToTokenPool, token/paged allocator,
MHATokenToKVPool, the registered radix cache) through the calls its scheduler makes,
on CPU tensors, with the plugin's pass in between.

Calls mirrored from SGLang 0.5.17's scheduler: ``match_prefix`` + ``inc_lock_ref`` at
admission, ``ReqToTokenPool.alloc``, the allocator's ``alloc_extend`` (prefill),
``maybe_cache_unfinished_req`` once the prefill is done (the prompt enters the tree),
``alloc_decode`` for each decode batch (``alloc`` with page size 1), row writes, and
``release_kv_cache`` at finish. KV content is synthetic but traceable: the K/V rows
written for a token encode (token id, logical position, layer), so any slot can be
checked against the token and position it must hold.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from sglang.srt.managers.schedule_batch import Req, ReqKvInfo, ScheduleBatch
from sglang.srt.mem_cache.allocation import alloc_for_decode
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import maybe_cache_unfinished_req, release_kv_cache
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.runtime_context import publish
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from sglang_evict.config import EvictionConfig
from sglang_evict.sglang_adapter import EvictingRadixCache, compact_decode_batch, free_slots

NUM_LAYERS, NUM_HEADS, HEAD_DIM = 2, 2, 8

# SGLang's release path reads process-wide server args (speculative algorithm, thinking
# cache); a scheduler publishes them at start, so the harness does too.
publish(ServerArgs(model_path="dummy", device="cpu"), role="test")
# What ScheduleBatch and alloc_for_decode read of the model config (a decoder-only LM).
_MODEL_CONFIG = SimpleNamespace(vocab_size=32_000, is_encoder_decoder=False)


def kv_rows(token_id: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[layers, heads, dim] K and V for a token at a position (deterministic)."""
    generator = torch.Generator().manual_seed(token_id * 100_003 + 7)
    k = torch.randn(NUM_LAYERS, NUM_HEADS, HEAD_DIM, generator=generator)
    k[:, :, 0] = position  # channel 0: position; channel 1: token id
    k[:, :, 1] = token_id
    v = torch.randn(NUM_LAYERS, NUM_HEADS, HEAD_DIM, generator=generator)
    v[:, :, 0] = position
    return k, v


@dataclass
class Engine:
    page_size: int
    config: EvictionConfig | None = None
    num_tokens: int = 8192
    max_requests: int = 64
    max_context: int = 2048
    pass_log: list = field(default_factory=list)  # (rid, PassResult)
    # (tokens the plans freed, tokens the allocator gained) per decode batch with passes
    free_log: list = field(default_factory=list)

    def __post_init__(self) -> None:
        p = self.page_size
        self.kv = MHATokenToKVPool(
            size=self.num_tokens,
            page_size=p,
            dtype=torch.float32,
            head_num=NUM_HEADS,
            head_dim=HEAD_DIM,
            layer_num=NUM_LAYERS,
            device="cpu",
            enable_memory_saver=False,
        )
        if p == 1:
            self.allocator = TokenToKVPoolAllocator(
                self.num_tokens, torch.float32, "cpu", self.kv, need_sort=False
            )
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                self.num_tokens, p, torch.float32, "cpu", self.kv, need_sort=False
            )
        self.req_to_token_pool = ReqToTokenPool(
            self.max_requests, self.max_context, "cpu", enable_memory_saver=False
        )
        self.cache_params = params = CacheInitParams(
            disable=False,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=p,
        )
        self.cache = EvictingRadixCache(params, self.config) if self.config else RadixCache(params)
        self.running: dict[str, Req] = {}

    # --- scheduler calls ------------------------------------------------------------

    def add_request(self, rid: str, prompt: list[int], extra_key: str | None = None) -> Req:
        req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=4096))
        req.extra_key = extra_key
        match = self.match(prompt, extra_key)
        prefix = match.device_indices
        req.prefix_indices, req.last_node = prefix, match.last_device_node
        req.cache_protected_len = len(prefix)
        self.cache.inc_lock_ref(req.last_node)
        assert self.req_to_token_pool.alloc([req]) is not None
        n_prefix, n_total = len(prefix), len(prompt)
        if self.page_size == 1:
            new_slots = self.allocator.alloc(n_total - n_prefix)
        else:
            last_loc = int(prefix[-1]) if n_prefix else -1
            new_slots = self.allocator.alloc_extend(
                torch.tensor([n_prefix]),
                torch.tensor([n_prefix]),
                torch.tensor([n_total]),
                torch.tensor([n_total]),
                torch.tensor([last_loc]),
                n_total - n_prefix,
            )
        assert new_slots is not None, "pool exhausted"
        row = torch.cat([prefix, new_slots])
        self.req_to_token_pool.write((req.req_pool_idx, slice(0, n_total)), row.to(torch.int32))
        for position in range(n_prefix, n_total):
            self._write_kv(int(row[position]), prompt[position], position)
        req.kv_committed_len = n_total
        req.kv = ReqKvInfo(kv_allocated_len=n_total, swa_evicted_seqlen=0)
        # After the prefill's result is processed, the scheduler inserts the prompt into
        # the tree (maybe_cache_unfinished_req): its page-aligned part becomes tree-owned
        # and locked by this request, and cache_protected_len moves to its end.
        req._refresh_fill_ids()
        req.set_extend_range(n_prefix, n_total)
        maybe_cache_unfinished_req(req, self.cache)
        self.running[rid] = req
        return req

    def decode_step(self, req: Req, token_id: int):
        """One decode step of one request (see ``decode_batch``); the pass result or None."""
        return self.decode_batch([req], [token_id])[0]

    def decode_batch(self, reqs: list[Req], token_ids: list[int]) -> list:
        """One decode step of a batch, as the scheduler runs it: a real ``ScheduleBatch``
        holding the running requests, the plugin's ``prepare_for_decode`` hook, SGLang's
        own ``alloc_for_decode`` (allocation + row write), the counters
        ``prepare_for_decode`` advances, and each new token's KV written at the position
        the ``ForwardBatch.init_new`` hook computes (what the model's attention does)."""
        batch = ScheduleBatch.init_new(
            reqs,
            self.req_to_token_pool,
            self.allocator,
            self.cache,
            _MODEL_CONFIG,
            enable_overlap=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        )
        lens = [r.kv_committed_len for r in reqs]
        batch.req_pool_indices = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        batch.seq_lens = torch.tensor(lens, dtype=torch.int64)
        batch.seq_lens_cpu = torch.tensor(lens, dtype=torch.int64)
        batch.orig_seq_lens = torch.tensor(lens, dtype=torch.int32)
        results: list = [None] * len(reqs)
        if isinstance(self.cache, EvictingRadixCache):
            free_before = self.free_token_count()
            passes = iter(compact_decode_batch(self.cache.evictor, batch))
            for i, req in enumerate(reqs):
                if req.kv_committed_len != lens[i]:
                    results[i] = next(passes)
                    self.pass_log.append((req.rid, results[i]))
            planned = sum(r.pages_freed for r in results if r is not None) * self.page_size
            if planned:
                self.free_log.append((planned, self.free_token_count() - free_before))
            assert torch.equal(batch.seq_lens, torch.tensor([r.kv_committed_len for r in reqs]))
        out_cache_loc = alloc_for_decode(batch, token_per_req=1)
        assert out_cache_loc is not None, "pool exhausted"
        for req in reqs:  # what prepare_for_decode advances after allocating
            req.decode_batch_idx += 1
            req.kv_committed_len += 1
        seq_lens_after = batch.seq_lens + 1
        if isinstance(self.cache, EvictingRadixCache):
            positions = self.cache.evictor.decode_positions(batch.req_pool_indices, seq_lens_after)
        else:
            positions = seq_lens_after - 1
        for slot, token_id, position, req in zip(
            out_cache_loc.tolist(), token_ids, positions.tolist(), reqs, strict=True
        ):
            self._write_kv(slot, token_id, position)
            req.output_ids.append(token_id)
        return results

    def finish(self, req: Req) -> None:
        release_kv_cache(req, self.cache)
        del self.running[req.rid]

    # --- observations ---------------------------------------------------------------

    def match(self, tokens: list[int], extra_key: str | None = None):
        """The radix cache's prefix match, as the scheduler calls it at admission."""
        return self.cache.match_prefix(
            MatchPrefixParams(key=RadixKey(array("q", tokens), extra_key))
        )

    def position_offset(self, req: Req) -> int:
        if isinstance(self.cache, EvictingRadixCache):
            return self.cache.evictor.position_offset(req.rid)
        return 0

    def row(self, req: Req) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_committed_len].long()

    def logical_positions(self, req: Req) -> torch.Tensor:
        if isinstance(self.cache, EvictingRadixCache):
            return self.cache.evictor.positions(req.rid, req.kv_committed_len)
        return torch.arange(req.kv_committed_len)

    def free_token_count(self) -> int:
        return int(self.allocator.available_size())

    def check(self) -> None:
        """Every invariant, after every operation: the cache's, each request's state,
        the KV each request reads, and global slot accounting (nothing leaked or shared)."""
        p = self.page_size
        if isinstance(self.cache, EvictingRadixCache):
            self.cache.check_invariants()
        owned = [free_slots(self.allocator)]
        tree = [self.cache.all_values_flatten().long()] if self.cache.total_size() else []
        owned += tree
        tree_set = set(torch.cat(tree).tolist()) if tree else set()
        for req in self.running.values():
            if isinstance(self.cache, EvictingRadixCache):
                self.cache.evictor.check_request(req.rid, req.kv_committed_len)
            row = self.row(req)
            tokens = list(req.origin_input_ids) + list(req.output_ids)
            positions = self.logical_positions(req)
            expected_token = torch.tensor([tokens[int(q)] for q in positions], dtype=torch.float32)
            k0 = self.kv.k_buffer[0][row]
            assert torch.equal(k0[:, 0, 0], positions.float()), f"{req.rid}: KV position mismatch"
            assert torch.equal(k0[:, 0, 1], expected_token), f"{req.rid}: KV token mismatch"
            private = row[req.cache_protected_len :]
            if p > 1 and row.numel():  # the request owns whole pages from its private start
                pages = torch.unique(private // p)
                private = (pages[:, None] * p + torch.arange(p)).reshape(-1)
            assert not (set(private.tolist()) & tree_set), f"{req.rid}: private slot in tree"
            owned.append(private)
        every = torch.cat(owned) if owned else torch.zeros(0, dtype=torch.int64)
        assert torch.unique(every).numel() == every.numel(), "a slot is owned twice"
        assert every.numel() == self.num_tokens, (
            f"leak: {self.num_tokens - every.numel()} slots neither free, cached nor held"
        )

    def _write_kv(self, slot: int, token_id: int, position: int) -> None:
        k, v = kv_rows(token_id, position)
        for layer in range(NUM_LAYERS):
            self.kv.k_buffer[layer][slot] = k[layer]
            self.kv.v_buffer[layer][slot] = v[layer]
