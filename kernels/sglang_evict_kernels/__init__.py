"""Kernels of sglang-evict: repack (slot moves across every layer), scoring, and the
batched pass's fused score normalisation (``normalize``).

Each kernel has a launcher, its device code, and a plain torch reference beside it;
tests and benchmarks compare against the reference. This package imports neither
``sglang_evict`` nor ``compactor_service``.

    module          job
    repack          slot moves across every layer's K and V (the compaction's copy)
    scoring         key scores where the keys lie in the pool (``knorm``,
                    ``triattention``)
    normalize       the batched pass's fused per-row score normalisation
    tier_format     the quantized tier's format (KIVI layout, OTT's outlier tokens),
                    its storage and the torch reference quantizer
    tier_quant      quantize-and-pack groups of tokens into the tier (launcher)
    tier_attention  decode attention over the tier with its log-sum-exp; the merge
    tier_jit        the tier's Triton device code
    tier_cpu        the tier on CPU, C++ kernels built on first use: decode
                    attention, the decode step's merge, quantize-and-pack
                    (``csrc/``)
    guarded_copy    copies through a shared file's mapping under a SIGBUS guard (the
                    compactor's CPU pools; C++ built on first use, ``csrc/``)
    _device         host ints to device tensors in one copy
    _build          the C++ modules' builds, safe against a dead build's lock
"""

from sglang_evict_kernels._device import device_int64, to_device
from sglang_evict_kernels.repack import (
    repack_kv_independent,
    repack_kv_reference,
    repack_kv_triton,
)

__all__ = [
    "device_int64",
    "repack_kv_independent",
    "repack_kv_reference",
    "repack_kv_triton",
    "to_device",
]
