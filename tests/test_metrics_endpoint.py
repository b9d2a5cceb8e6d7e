"""Eviction metrics reach SGLang's own /metrics route.

A separate process plays SGLang's scheduler: it builds the cache through the registered
backend factory with ``--enable-metrics`` and runs passes. Another plays SGLang's HTTP
server: it mounts ``add_prometheus_middleware`` (which serves every process's metrics
from the Prometheus multiprocess directory) on an app and reads ``/metrics``. Both are
real processes: prometheus_client fixes its storage mode at import, from the environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCHEDULER = textwrap.dedent(
    """
    import torch
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext
    from sglang.srt.server_args import ServerArgs
    from sglang_evict.srt.backend import radix_cache_factory
    from sglang_evict.srt.cpu_driver import MemoryDriver
    from tests.sglang_harness import build_component

    driver = MemoryDriver(page_size=16, num_tokens=2048, num_layers=2, num_kv_heads=2,
                          head_dim=8)
    server_args = ServerArgs(model_path="dummy", device="cpu", enable_metrics=True)
    driver.cache = radix_cache_factory(build_component(TreeCacheBuildContext,
        server_args=server_args, params=driver.cache_params, is_hybrid_swa=False,
        is_hybrid_ssm=False, enable_hierarchical_cache=False, disable_radix_cache=False,
        effective_chunked_prefill_size=None, tp_worker=None, model_config=None, tp_size=1,
        tp_rank=0, tp_group=None))
    req, _, slots = driver.admit("a", list(range(8)))
    driver.prefill_done(req)
    generator = torch.Generator().manual_seed(0)
    done = []
    for step in range(120):
        slots, positions, passes = driver.prepare_decode([req])
        done += [p for p in passes if p is not None]
        for layer in range(2):
            driver.kv_pool.k_buffer[layer][slots] = torch.randn(1, 2, 8, generator=generator)
        req.output_ids.append(step)
    print(len(done), sum(p.tokens_evicted for p in done), sum(p.pages_freed for p in done),
          flush=True)
    """
)


HTTP_SERVER = textwrap.dedent(
    """
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from sglang.srt.utils.common import add_prometheus_middleware

    app = FastAPI()
    add_prometheus_middleware(app)
    print(TestClient(app).get("/metrics").text)
    """
)


def test_pass_metrics_appear_on_sglangs_metrics_route(tmp_path):
    policy = {"kv_budget_tokens": 48, "cadence_tokens": 16, "window_tokens": 16, "scorer": "knorm"}
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
        "SGLANG_EVICT_CONFIG": json.dumps(policy),
    }
    result = subprocess.run(
        [sys.executable, "-c", SCHEDULER], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    num_passes, tokens_evicted, pages_freed = map(int, result.stdout.split()[-3:])
    assert num_passes >= 3

    served = subprocess.run(
        [sys.executable, "-c", HTTP_SERVER], env=env, capture_output=True, text=True, timeout=300
    )
    assert served.returncode == 0, served.stderr[-3000:]
    text = served.stdout
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith("sglang_evict:")
    }
    labels = '{scorer="knorm",strategy="hole_fill"}'
    assert samples[f"sglang_evict:passes_total{labels}"] == num_passes
    assert samples[f"sglang_evict:tokens_evicted_total{labels}"] == tokens_evicted
    assert samples[f"sglang_evict:pages_freed_total{labels}"] == pages_freed
    assert samples[f"sglang_evict:pass_duration_seconds_count{labels}"] == num_passes
    assert samples['sglang_evict:budget_occupancy_ratio_count{scorer="knorm"}'] == num_passes
