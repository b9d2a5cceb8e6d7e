"""KV pool access over SGLang's pools: the mechanism's ``KVPoolAccess`` over
``ReqToTokenPool``, the token/paged allocator and ``MHATokenToKVPool`` or
``MLATokenToKVPool``; the allocator's free set; sharing the pool's buffers with the
compactor process.

An MLA pool (DeepSeek V2/V3/R1, Kimi K2) holds one row a token a layer: the compressed
latent ``c_kv`` (``kv_lora_rank``) followed by the rotary part of the key
(``qk_rope_head_dim``, written rotated at the token's position, as an MHA key is), one
"head" wide. To the mechanism it is a pool of keys without values: ``k_buffers`` are its
latent buffers, ``v_buffers`` is empty, so a move copies the one row every layer holds
and a key scorer (``knorm``) reads the latent row. Its FP4 and sparse-attention (DSA)
variants keep other layouts and are refused."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from torch import Tensor

from compactor_service.cuda_ipc import export_cuda_buffers
from compactor_service.shared_pool import PoolLayout, create_shared_buffers
from sglang_evict.passes.batch.indices import arange
from sglang_evict.srt.versioned import free_page_ids, give_back_pages


def is_latent_pool(kv_pool) -> bool:
    """An MLA pool of the plain layout (not its FP4 or DSA variants)."""
    return type(kv_pool) is MLATokenToKVPool


class SGLangPoolAccess:
    """``KVPoolAccess`` over SGLang's request-to-token pool, allocator and MHA or MLA KV
    pool."""

    def __init__(self, req_to_token_pool, allocator, kv_pool) -> None:
        self.latent = is_latent_pool(kv_pool)
        if not (self.latent or isinstance(kv_pool, MHATokenToKVPool)):
            raise ValueError(
                f"sglang-evict supports MHA and MLA KV pools (MHATokenToKVPool, "
                f"MLATokenToKVPool); this model uses {type(kv_pool).__name__} (hybrid "
                f"SWA/linear, DSA and quantised FP4/MXFP8 pools are not supported yet)"
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
        """Per layer ``[slots, kv_heads, head_dim]``; an MLA pool's latent rows
        ``[slots, 1, kv_lora_rank + qk_rope_head_dim]``."""
        return list(self.kv_pool.kv_buffer if self.latent else self.kv_pool.k_buffer)

    @property
    def v_buffers(self) -> list[Tensor]:
        """Per layer; none for an MLA pool (its values are the latent rows)."""
        return [] if self.latent else list(self.kv_pool.v_buffer)

    def read_rows(self, rows: Tensor, width: int) -> Tensor:
        return self.req_to_token[:, :width].index_select(0, rows).to(torch.int64)

    def write_rows(self, rows: Tensor, values: Tensor) -> None:
        columns = arange(values.shape[1], values.device).unsqueeze(0)
        self.req_to_token.index_put_(
            (rows.unsqueeze(1), columns), values.to(self.req_to_token.dtype)
        )

    def gather_layer_keys(self, layer: int, slots: Tensor) -> Tensor:
        """float ``[len(slots), kv_heads, head_dim]``: one layer's cached keys."""
        pool = self.kv_pool
        keys = self.k_buffers[layer].index_select(0, slots.to(pool.device))
        if pool.store_dtype != pool.dtype:  # fp8 stored as uint8
            keys = keys.view(pool.dtype)
        return keys.float()

    def gather_keys(self, slots: Tensor) -> Tensor:
        return torch.stack(
            [self.gather_layer_keys(layer, slots) for layer in range(len(self.k_buffers))]
        )

    def available_pages(self) -> int:
        """Free pages the allocator can hand out now (a length: no device read)."""
        return self.allocator.available_size() // self.page_size

    def alloc_pages(self, num_pages: int) -> Tensor | None:
        """int64 device ids of ``num_pages`` whole pages (slicing the free list on the
        host: no synchronisation), or None if the pool is short."""
        slots = self.allocator.alloc(num_pages * self.page_size)
        if slots is None:
            return None
        return torch.div(slots[:: self.page_size], self.page_size, rounding_mode="floor")

    def release_pages(self, pages: Tensor) -> None:
        """Give pages (slots when the page size is 1) back without synchronising
        (``versioned.give_back_pages``)."""
        if pages.numel():
            give_back_pages(self.allocator, pages)


def share_kv_pool(kv_pool: MHATokenToKVPool, shm_dir: str) -> tuple[PoolLayout, object]:
    """Make ``kv_pool``'s buffers mappable by the compactor process; return the layout
    and the owner of the shared memory (``close()`` removes it).

    CUDA: the buffers stay where they are and are exported by IPC handle. CPU: the
    buffers move into one file of the pool directory ``shm_dir`` (contents copied; the
    compactor maps files from that directory only) and the pool's per-layer lists and
    pointer tables are re-pointed at it — done at start-up, before any forward.
    """
    if is_latent_pool(kv_pool) or kv_pool.head_dim != kv_pool.v_head_dim:
        raise ValueError(
            "the compactor sidecar needs an MHA pool with equal K and V head dims; an MLA "
            "pool is compacted in-process (--kv-compactor inprocess)"
        )
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


def free_slots(allocator) -> Tensor:
    """int64 CPU tensor of every slot the allocator considers free."""
    pages = free_page_ids(allocator)
    if allocator.page_size == 1:
        return pages
    offsets = torch.arange(allocator.page_size, dtype=torch.int64)
    return (pages[:, None] * allocator.page_size + offsets).reshape(-1)
