"""Test-session setup shared by every test module.

Without a GPU, Triton kernels (SGLang's allocator kernels, ours) can only run under
Triton's interpreter, which must be chosen before any kernel is decorated, i.e. before
SGLang or our kernels are imported. On a CUDA machine the variable is left alone so
kernels compile for real.
"""

from __future__ import annotations

import os

import pytest
import torch

# Tests never reach the network (CI has none): model weights are built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# SGLang's own memory checks, which the harness runs after every operation: the
# busy-time pool accounting and the KV page (use-after-free / double-free) check.
os.environ.setdefault("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY", "1")
os.environ.setdefault("SGLANG_CHECK_KV_PAGE_INVARIANTS", "1")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server on a loopback port for the whole test session."""
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()
