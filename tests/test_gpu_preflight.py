"""The engines the GPU checks start would start: checked here, on CPU, where CI runs,
before a lent GPU spends minutes finding out (``sglang_evict.srt.preflight``).

On 2026-11-28 an H200 lease lost both of its calls to engines that failed at start: an
argument SGLang 0.5.17 does not have (``cuda_graph_max_bs``), then a pass-graph pool
reserved for a tier server at a 4,096-token pool. The preflight finds both (the last
test), and every GPU test's and the GPU bench's engine passes it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from sglang_evict.srt.versioned import IS_0_5_23
from tests.engine_harness import (
    ENGINE_TIER,
    EngineSpec,
    engine_process_of,
    policy_fields,
)
from tests.test_benches import load
from tests.test_engine_capture import GPU_BACKENDS, gpu_capture_spec
from tests.test_engine_tier_triton import gpu_tier_specs

# The GPU machine runs SGLang 0.5.17, and the pool's check follows its configurator.
pytestmark = pytest.mark.skipif(IS_0_5_23, reason="the lent GPU runs SGLang 0.5.17")


def problems_of(spec: EngineSpec) -> list[str]:
    from sglang_evict.srt.preflight import preflight

    return preflight(engine_process_of(spec, None, os.devnull))


def test_the_gpu_tests_engines_would_start():
    specs = dict(gpu_tier_specs())
    for backend in GPU_BACKENDS:
        for graphs in (True, False):
            specs[f"capture {backend} graphs={graphs}"] = gpu_capture_spec(backend, graphs)
    found = {label: problems_of(spec) for label, spec in specs.items()}
    assert all(not p for p in found.values()), found


def test_the_gpu_benchs_engines_would_start(tmp_path):
    """``scripts/gpu_check.sh``'s engine bench, every mode it runs (``engine``'s and
    ``tier``'s defaults), on the bench's own flag: no engine starts."""
    from sglang_evict.models.engine_model import ensure_engine_model

    bench = load("engine_eviction")
    model = str(ensure_engine_model(variant="head_dim64"))
    modes = "plain,off,on:1+graph,on:auto+graph,on+tier"
    argv = ["--model", model, "--modes", modes, "--paired", "--preflight"]
    assert bench.main([*argv, "--out", str(tmp_path / "x.json")]) == 0
    # ``stall``'s: the tier engine with SGLang's prefill graphs kept.
    stall = ["--model", model, "--modes", "on+tier", "--prefill-graphs", "--preflight"]
    assert bench.main([*stall, "--out", str(tmp_path / "y.json")]) == 0
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_preflight_finds_what_stopped_the_gpu_engines(engine_model):
    tier_gpu = gpu_tier_specs()["graphs"]
    engine_args = json.loads(tier_gpu.engine_json)
    # an argument this SGLang does not have
    bad_argument = EngineSpec.plugin(
        1,
        engine_args={**engine_args, "cuda_graph_max_bs": 4},
        env=json.loads(tier_gpu.env_json),
        **tier_gpu.policy(),
    )
    (problem,) = problems_of(bad_argument)
    assert "cuda_graph_max_bs" in problem
    # a reservation the pool cannot hold: the pass graphs' 256 MiB at 4,096 tokens
    replaying = EngineSpec.plugin(1, engine_args=engine_args, **policy_fields(**ENGINE_TIER))
    (problem,) = problems_of(replaying)
    assert "--kv-pass-graph-pool-mib 256" in problem and "holds 4096" in problem
    # the tier with triton on a GPU without the trial switch
    untried = EngineSpec.plugin(1, engine_args=engine_args, **tier_gpu.policy())
    (problem,) = problems_of(untried)
    assert "--attention-backend triton on cuda" in problem
    # plain SGLang: SGLang's arguments only
    assert problems_of(EngineSpec.plain(engine_args=engine_args)) == []


def test_preflight_names_a_model_it_cannot_read_and_an_fp8_pool_it_sizes(tmp_path):
    spec = gpu_tier_specs()["no tier"]
    engine_args = json.loads(spec.engine_json)
    missing = EngineSpec.plugin(
        1, engine_args={**engine_args, "model_path": str(tmp_path / "none")}, **spec.policy()
    )
    (problem,) = problems_of(missing)
    assert str(tmp_path / "none") in problem
    fp8 = EngineSpec.plugin(
        1, engine_args={**engine_args, "kv_cache_dtype": "fp8_e4m3"}, **spec.policy()
    )
    assert problems_of(fp8) == []


GPU_CHECK = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
TIER_FAST_SETUP_S = 30  # pip's editable install and the Triton cache's restore, measured: ~20 s


def test_tier_fast_fits_a_lease_in_order_and_its_engines_would_start(tmp_path):
    """``gpu_check.sh tier-fast`` as a lease would run it, printed (``GPU_CHECK_DRY_RUN``)
    rather than run: four steps in the issue's order, within 8 minutes with the set-up,
    each streaming its own file; its test exists and its engines pass the preflight."""
    from sglang_evict.models.engine_model import ensure_engine_model

    model = str(ensure_engine_model(variant="head_dim64"))
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "OUT": str(tmp_path), "MODEL": model}
    run = subprocess.run(
        ["bash", str(GPU_CHECK), "tier-fast"],
        capture_output=True,
        text=True,
        env=env,
        cwd=GPU_CHECK.parents[1],
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    steps = [line.split() for line in run.stdout.splitlines() if line.startswith("step ")]
    files = [words[2] for words in steps]
    assert files == ["bench_tier.txt", "pytest_gpu_tier.log", "engine_tier.txt", "bench_repack.txt"]
    assert sum(int(words[1]) for words in steps) + TIER_FAST_SETUP_S <= 8 * 60
    commands = {words[2]: words[3:] for words in steps}
    for name in ("bench_tier.txt", "bench_repack.txt"):
        assert (GPU_CHECK.parents[1] / commands[name][1]).is_file(), commands[name]
    (node,) = [arg for arg in commands["pytest_gpu_tier.log"] if "::" in arg]
    path, _, test = node.partition("::")
    assert f"def {test}(" in (GPU_CHECK.parents[1] / path).read_text()
    bench = load("engine_eviction")
    argv = commands["engine_tier.txt"][2:]  # after "python3 benches/engine_eviction.py"
    assert argv[argv.index("--model") + 1] == model
    assert bench.main([*argv, "--preflight"]) == 0
    assert not list(tmp_path.iterdir())  # printed only: nothing ran, nothing written
