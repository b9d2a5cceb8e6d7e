"""Where the kernel tests run their Triton kernels: the GPU when there is one (compiled
for real, programs in parallel), else the CPU under Triton's interpreter (conftest
selects it; programs run one after another). References always run on CPU tensors.

Triton's interpreter is chosen per process: on a CUDA machine it is off, so Triton
kernels (ours, and SGLang's paged allocator's, which the memory-class tests drive at
page size > 1) cannot take CPU tensors there; ``needs_cpu_triton`` skips those tests.
"""

from __future__ import annotations

import os

import pytest
import torch

KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = KERNEL_DEVICE.type == "cpu"
CPU_TRITON = os.environ.get("TRITON_INTERPRET") == "1"  # Triton kernels take CPU tensors

needs_cpu_triton = pytest.mark.skipif(
    not CPU_TRITON,
    reason="Triton kernels on CPU tensors need Triton's interpreter, off on a CUDA machine",
)


def on_kernel_device(value):
    """A tensor, or a list of tensors, on ``KERNEL_DEVICE``."""
    if isinstance(value, torch.Tensor):
        return value.to(KERNEL_DEVICE)
    return [t.to(KERNEL_DEVICE) for t in value]


def on_host(value):
    """A tensor, or a tuple/list of tensors, back on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    return type(value)(t.cpu() for t in value)
