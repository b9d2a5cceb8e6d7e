"""The small evicting setup the fault tests drive through SGLang's memory classes: a
tiny paged Llama and a ``MemoryDriver`` whose policy runs a pass every other token."""

from __future__ import annotations

from sglang_evict.config import EvictionConfig
from sglang_evict.reference_model import PagedLlama, build_tiny_llama
from sglang_evict.srt.cpu_driver import MemoryDriver

PAGE = 4
POOL_TOKENS = 2048
MAX_CONTEXT = 512


def fault_model() -> PagedLlama:
    return PagedLlama(build_tiny_llama(seed=3))


def make_driver(model: PagedLlama, **fields) -> MemoryDriver:
    """Budget 32, cadence 2, 2 sinks, window 8, page size 4; ``fields`` adds the
    compactor and lease-store settings under test."""
    config = EvictionConfig(
        kv_budget_tokens=32,
        cadence_tokens=2,
        sink_tokens=2,
        window_tokens=8,
        page_size=PAGE,
        **fields,
    )
    return MemoryDriver.for_model(
        model, page_size=PAGE, num_tokens=POOL_TOKENS, config=config, max_context=MAX_CONTEXT
    )


def plain_driver(model: PagedLlama) -> MemoryDriver:
    """The same pool without eviction (the full-cache reference)."""
    return MemoryDriver.for_model(
        model, page_size=PAGE, num_tokens=POOL_TOKENS, max_context=MAX_CONTEXT
    )
