"""The tier's CPU kernels, compiled: decode attention (``csrc/tier_attention_cpu.cpp``,
held to ``tier_attention_reference`` like the Triton kernel) and quantize-and-pack
(``csrc/tier_quantize_cpu.cpp``, held to ``quantize_into_reference`` bit for bit).

SGLang's CPU engine runs no Triton kernel in its decode step, and the tensor form
(``tier_attention_torch``) dequantizes every group of the batch into float32 tensors at
every layer: on a 2-core CPU that costs more than the model's own step. The kernel
reads the packed bytes of one group at a time instead. A pass's demotion quantizes its
groups at every layer; the reference does that in a few dozen small tensor operations
per layer, the quantize kernel in one call. It is built from source with
PyTorch's extension builder on first use (a C++ compiler and ninja; about half a minute,
once per machine: the build lands in ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``). ``cpu_kernel_status()`` says whether it loaded and why
not; SGLang's engine falls back to ``tier_attention_torch`` with one warning when it
did not, and ``tier_quant.quantize_into`` to the reference. ``SGLANG_EVICT_TIER_CPU_
KERNEL=0`` asks for the tensor form and the reference.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import platform
from pathlib import Path

import torch
from torch import Tensor

from sglang_evict_kernels._build import load_module
from sglang_evict_kernels.tier_attention import check_attention_inputs
from sglang_evict_kernels.tier_format import TierFormat, TierStore, check_quantize_inputs

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "tier_attention_cpu.cpp"  # binds the module
SOURCES = (SOURCE, CSRC / "tier_quantize_cpu.cpp")
HEADERS = (CSRC / "tier_cpu_common.h",)
ENV_SWITCH = "SGLANG_EVICT_TIER_CPU_KERNEL"


class CpuKernelUnavailable(RuntimeError):
    """The compiled CPU kernel could not be built or loaded (the message says why)."""


def _machine_tag() -> str:
    """Source and CPU in the build's name: the build uses ``-march=native``, so a cache
    folder shared between machines never hands one CPU another's build."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.read_bytes())
    digest.update(platform.machine().encode())
    try:
        flags = [
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        ][:1]
    except OSError:
        flags = []
    digest.update("".join(flags).encode())
    digest.update(torch.__version__.encode())
    return digest.hexdigest()[:16]


@functools.cache
def _load():
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        raise CpuKernelUnavailable(f"turned off by {ENV_SWITCH}=0")
    missing = [str(path) for path in (*SOURCES, *HEADERS) if not path.is_file()]
    if missing:
        raise CpuKernelUnavailable(
            f"its source {', '.join(missing)} is missing from the installed package"
        )
    try:
        return load_module(
            f"sglang_evict_tier_cpu_{_machine_tag()}",
            [str(path) for path in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as error:  # a missing compiler or ninja, a failed build
        first = str(error).strip().splitlines()[:1] or [type(error).__name__]
        raise CpuKernelUnavailable(
            f"building it failed ({first[0][:300]}); it needs a C++ compiler and ninja "
            f"(`pip install ninja`)"
        ) from error


def load_cpu_kernel():
    """The compiled module; builds it on first use. Raises ``CpuKernelUnavailable``."""
    return _load()


def cpu_kernel_status() -> tuple[bool, str]:
    """``(loaded, why not)``: builds the kernel if it was not yet."""
    try:
        load_cpu_kernel()
    except CpuKernelUnavailable as error:
        return False, str(error)
    return True, ""


def cpu_kernel_in_use() -> bool:
    """Whether the compiled kernels are loaded or can be (builds them on first call);
    False when turned off or unbuildable (``cpu_kernel_status`` says why)."""
    return cpu_kernel_status()[0]


def tier_attention_cpu(
    q: Tensor,
    store: TierStore,
    group_table: Tensor,
    num_groups: Tensor,
    fmt: TierFormat,
    sm_scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """``tier_attention_reference``'s result (float32 ``o [B, Hq, D]``, ``lse [B, Hq]``)
    from the packed bytes, by the compiled kernel; CPU tensors only."""
    check_attention_inputs(q, store, group_table, num_groups, fmt)
    store.check_contiguous()
    if q.device.type != "cpu" or store.k_codes.device.type != "cpu":
        raise ValueError(
            "tier_attention_cpu runs on CPU tensors; on CUDA use tier_attention_triton"
        )
    sm_scale = 1.0 / math.sqrt(fmt.head_dim) if sm_scale is None else sm_scale
    kernel = load_cpu_kernel()
    o, lse = kernel.tier_attention(
        q.float().contiguous(),
        group_table.to(torch.int64).contiguous(),
        num_groups.to(torch.int64).contiguous(),
        *store.kernel_args(),
        fmt.bits,
        fmt.value_group_channels,
        float(sm_scale),
    )
    return o, lse


def tier_decode_merge_cpu(
    q: Tensor,
    o_full: Tensor,
    k_buffer: Tensor,
    req_to_token: Tensor,
    rows: Tensor,
    lens: Tensor,
    store: TierStore,
    group_table: Tensor,
    num_groups: Tensor,
    fmt: TierFormat,
    sm_scale: float | None = None,
) -> Tensor:
    """``tier_attention.decode_merge_reference``'s result in one call: per (request, KV
    head) the tier's attention, the log-sum-exp over the request's keys read where they
    lie in the pool (``req_to_token`` int32, as SGLang keeps it) and the merge; a
    request without a tier gets ``o_full``'s rows as they are. CPU tensors only."""
    check_attention_inputs(q, store, group_table, num_groups, fmt)
    store.check_contiguous()
    if q.device.type != "cpu" or k_buffer.device.type != "cpu":
        raise ValueError("tier_decode_merge_cpu runs on CPU tensors")
    sm_scale = 1.0 / math.sqrt(fmt.head_dim) if sm_scale is None else sm_scale
    return load_cpu_kernel().tier_decode_merge(
        q.float().contiguous(),
        o_full.contiguous(),
        k_buffer.contiguous(),
        req_to_token.contiguous(),
        rows.to(torch.int64).contiguous(),
        lens.to(torch.int64).contiguous(),
        group_table.to(torch.int64).contiguous(),
        num_groups.to(torch.int64).contiguous(),
        *store.kernel_args(),
        fmt.bits,
        fmt.value_group_channels,
        float(sm_scale),
    )


def quantize_into_cpu(
    store: TierStore,
    group_slots: Tensor,
    k_buffer: Tensor,
    v_buffer: Tensor,
    token_slots: Tensor,
    fmt: TierFormat,
) -> None:
    """``quantize_into_reference``'s bytes by the compiled kernel, written at
    ``group_slots`` (distinct slots) of ``store``; CPU tensors only."""
    check_quantize_inputs(store, group_slots, k_buffer, v_buffer, token_slots, fmt)
    store.check_contiguous()
    if k_buffer.device.type != "cpu" or store.k_codes.device.type != "cpu":
        raise ValueError("quantize_into_cpu runs on CPU tensors; on CUDA use quantize_into_triton")
    if group_slots.numel() == 0:
        return
    load_cpu_kernel().tier_quantize(
        k_buffer.contiguous(),
        v_buffer.contiguous(),
        token_slots.to(torch.int64).contiguous(),
        group_slots.to(torch.int64).contiguous(),
        *store.kernel_args(),
        fmt.bits,
        fmt.value_group_channels,
    )
