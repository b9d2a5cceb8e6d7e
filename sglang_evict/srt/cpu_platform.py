"""A platform for SGLang's engine on a CPU-only machine, for the MoE families.

SGLang's transformers backend materialises the parameters its module replacement left
on the ``meta`` device (the MoE experts' and routers') with ``torch.empty_like(...,
device=get_device())`` (``TransformersForCausalLM._init_parameters``), and
``get_device()`` asks the current platform once no accelerator is found. On a
CPU-only machine without ``SGLANG_USE_CPU_ENGINE`` (which needs ``sgl_kernel``'s CPU
build, not on PyPI) that platform is SGLang's base ``SRTPlatform``, which has no
device: Qwen3-MoE and Mixtral stop there ("No accelerator ... is available"), dense
models never ask.

``SGLANG_PLATFORM=sglang_evict_cpu`` selects this platform through SGLang's own
platform plugins (entry point group ``sglang.srt.platforms``): the base platform,
unchanged, except that its device is the CPU. Unset, ``activate`` returns None and
SGLang's discovery goes on as without it. The engine tests set it for the MoE
families; a CPU server of a MoE model can too.
"""

from __future__ import annotations

import os

PLATFORM_NAME = "sglang_evict_cpu"
PLATFORM_CLASS = "sglang_evict.srt.cpu_platform:CpuDevicePlatform"


def activate() -> str | None:
    """SGLang's platform discovery calls this: the platform's class when
    ``SGLANG_PLATFORM`` names it, None otherwise (no effect)."""
    return PLATFORM_CLASS if os.environ.get("SGLANG_PLATFORM") == PLATFORM_NAME else None


def __getattr__(name: str):
    # The class is built when SGLang resolves it, so that importing this module (SGLang's
    # discovery imports every platform plugin) imports nothing of SGLang.
    if name == "CpuDevicePlatform":
        return _platform_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_CLASS = []


def _platform_class():
    if not _CLASS:
        import torch
        from sglang.srt.platforms.interface import SRTPlatform

        class CpuDevicePlatform(SRTPlatform):
            """SGLang's base platform whose device is the CPU."""

            device_name = "cpu"
            device_type = "cpu"

            def get_device(self, device_id: int = 0):
                return torch.device("cpu")

        _CLASS.append(CpuDevicePlatform)
    return _CLASS[0]
