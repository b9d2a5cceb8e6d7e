"""Choosing Triton's interpreter on a machine without a GPU: SGLang's paged allocator
launches Triton kernels, which run there only under the interpreter, and the choice
must be made before SGLang (or Triton) is imported."""

from __future__ import annotations

import os


def use_triton_interpreter_without_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
