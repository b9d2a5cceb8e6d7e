"""``KVPoolAccess`` over plain tensors of one device, without an engine: the pass's
benchmark and the tests that run passes where SGLang's pool classes cannot (the
``meta`` device). The engine's is ``sglang_evict.srt.pools.SGLangPoolAccess``."""

from __future__ import annotations

import torch
from torch import Tensor

from sglang_evict.passes.batch.indices import arange


class TensorPool:
    """Per-layer K/V buffers ``[num_pages * page_size, kv_heads, head_dim]``, a
    request-to-token table ``[rows, capacity]`` (int32, as SGLang's) and ``free``, the
    int64 ids of the free pages (slots when the page size is 1), handed out from the
    front; page 0 is the padding page and is never free."""

    def __init__(
        self,
        *,
        k_buffers: list[Tensor],
        v_buffers: list[Tensor],
        page_size: int,
        rows: int,
        capacity: int,
    ) -> None:
        self.k_buffers, self.v_buffers = list(k_buffers), list(v_buffers)
        self.page_size = page_size
        self.device = self.k_buffers[0].device
        self.num_pages = self.k_buffers[0].shape[0] // page_size
        self.req_to_token = torch.zeros(rows, capacity, dtype=torch.int32, device=self.device)
        self.free = torch.arange(1, self.num_pages, device=self.device)

    def read_rows(self, rows: Tensor, width: int) -> Tensor:
        return self.req_to_token[:, :width].index_select(0, rows).to(torch.int64)

    def write_rows(self, rows: Tensor, values: Tensor) -> None:
        columns = arange(values.shape[1], values.device).unsqueeze(0)
        self.req_to_token.index_put_((rows.unsqueeze(1), columns), values.to(torch.int32))

    def gather_layer_keys(self, layer: int, slots: Tensor) -> Tensor:
        return self.k_buffers[layer].index_select(0, slots.to(self.device)).float()

    def gather_keys(self, slots: Tensor) -> Tensor:
        return torch.stack([self.gather_layer_keys(i, slots) for i in range(len(self.k_buffers))])

    def available_pages(self) -> int:
        return self.free.numel()

    def alloc_pages(self, num_pages: int) -> Tensor | None:
        if num_pages > self.free.numel():
            return None
        pages, self.free = self.free[:num_pages], self.free[num_pages:]
        return pages

    def release_pages(self, pages: Tensor) -> None:
        self.free = torch.cat([pages.to(self.device), self.free])
