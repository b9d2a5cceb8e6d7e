"""The SGLang plugin's integration points: entry point, backend registration, hooks,
startup refusals, configuration from the environment, metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from sglang.srt.mem_cache.registry import TreeCacheBuildContext
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.server_args import ServerArgs

from sglang_evict import metrics as metric_names
from sglang_evict.calibrate import calibrate
from sglang_evict.config import EvictionConfig
from sglang_evict.metrics import EvictionMetrics
from sglang_evict.models.reference_model import build_tiny_llama
from sglang_evict.scorers.triattention_stats import save_stats
from sglang_evict.srt import (
    SGLANG_VERSION_TARGET,
    SUPPORTED_SGLANG_VERSIONS,
    check_sglang_version,
    version_problem,
)
from sglang_evict.srt.active import Active
from sglang_evict.srt.backend import EvictingRadixCache, radix_cache_factory
from sglang_evict.srt.hooks import _after_forward_batch_init_new
from sglang_evict.srt.server_args import CONFIG_ENV, config_from_env, startup_problems
from sglang_evict.srt.versioned import req_kv
from tests.sglang_harness import HEAD_DIM, NUM_HEADS, NUM_LAYERS, Engine, build_component


def test_entry_point_registers_backend_and_hooks_in_a_fresh_sglang_process():
    """What SGLang's scheduler process does at start: load_plugins() via entry points."""
    script = textwrap.dedent(
        """
        from sglang.srt.plugins import load_plugins
        load_plugins()
        load_plugins()  # idempotent
        import sglang_evict.plugin as plugin
        plugin.register()  # and so is register()
        from sglang.srt.mem_cache.registry import registered_radix_cache_backends
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
        print(registered_radix_cache_backends().count("sglang-evict"))
        print(hasattr(ScheduleBatch.prepare_for_decode, "__wrapped__"))
        print(hasattr(ForwardBatch.init_new, "__wrapped__"))
        """
    )
    env = {**os.environ, "SGLANG_PLUGINS": "sglang_evict"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["1", "True", "True"]


def test_importing_the_plugin_module_has_no_side_effects():
    script = (
        "import sys, sglang_evict.plugin; "
        "print('sglang_evict.srt' in sys.modules, 'sglang' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.stdout.split() == ["False", "False"]


def test_other_sglang_versions_are_refused_with_the_fix():
    for release in ("0.5.21", "0.5.16", "0.6.0"):
        problem = version_problem(release)
        assert f"supports SGLang 0.5.17 or 0.5.23, found {release}" in problem
        assert f'"sglang=={SGLANG_VERSION_TARGET}"' in problem
    assert "not installed" in version_problem(None)
    for release in SUPPORTED_SGLANG_VERSIONS:
        assert version_problem(release) is None
    check_sglang_version()  # the installed release is a supported one


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (dict(speculative_algorithm="EAGLE"), "--speculative-algorithm"),
        (dict(enable_mixed_chunk=True), "--enable-mixed-chunk"),
        (dict(enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
        (dict(strip_thinking_cache=True), "--strip-thinking-cache"),
        (dict(pp_size=2), "--pp-size"),
        (dict(kv_canary="log"), "--kv-canary"),
        (dict(kv_cache_dtype="mxfp8"), "--kv-cache-dtype mxfp8/"),
        (dict(disable_radix_cache=True), "--disable-radix-cache"),
    ],
)
def test_unsupported_flag_combinations_are_refused_naming_the_flag(flags, named):
    server_args = ServerArgs(model_path="dummy", device="cpu", **flags)
    problems = startup_problems(server_args, EvictionConfig(kv_budget_tokens=1024, scorer="knorm"))
    assert len(problems) == 1 and named in problems[0]


def test_supported_flags_pass_and_tp_needs_a_scorer_whose_ranks_can_agree(tmp_path):
    def problems(server_args, scorer, **params):
        config = EvictionConfig(kv_budget_tokens=1024, scorer=scorer, scorer_params=params)
        return startup_problems(server_args, config)

    assert problems(ServerArgs(model_path="dummy", device="cpu"), "knorm") == []
    tp2 = ServerArgs(model_path="dummy", device="cpu", tp_size=2)
    for scorer in ("streaming", "random", "knorm"):  # rank-independent or reduced across ranks
        assert problems(tp2, scorer) == []
    stats = tmp_path / "stats.safetensors"
    save_stats(calibrate(build_tiny_llama(), torch.arange(32)), stats)
    (problem,) = problems(tp2, "triattention", stats_path=str(stats))
    assert "--tp-size 2 with --kv-scorer triattention is not supported" in problem


def test_config_from_environment():
    config = config_from_env(16, {CONFIG_ENV: json.dumps({"kv_budget_tokens": 512})})
    assert (config.kv_budget_tokens, config.page_size) == (512, 16)
    with pytest.raises(ValueError, match="sglang-evict serve --kv-budget"):
        config_from_env(16, {})
    with pytest.raises(ValueError, match="not valid JSON"):
        config_from_env(16, {CONFIG_ENV: "{"})
    with pytest.raises(ValueError, match="unexpected keyword argument 'kv_budjet'"):
        config_from_env(16, {CONFIG_ENV: json.dumps({"kv_budjet": 1})})
    with pytest.raises(ValueError, match="kv_budget_tokens=10"):
        config_from_env(16, {CONFIG_ENV: json.dumps({"kv_budget_tokens": 10})})


def build_context(engine: Engine, server_args: ServerArgs, **overrides) -> TreeCacheBuildContext:
    values = dict(
        server_args=server_args,
        params=engine.cache_params,
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        effective_chunked_prefill_size=None,
        tp_worker=None,
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )
    values.update(overrides)
    return build_component(TreeCacheBuildContext, **values)


def test_backend_factory_builds_the_evicting_cache(monkeypatch):
    engine = Engine(page_size=16)
    monkeypatch.setenv(CONFIG_ENV, json.dumps({"kv_budget_tokens": 256, "scorer": "streaming"}))
    monkeypatch.setattr(Active, "manager", None)
    cache = radix_cache_factory(build_context(engine, ServerArgs(model_path="dummy", device="cpu")))
    assert isinstance(cache, EvictingRadixCache)
    assert cache.evictor.config.page_size == 16 and Active.manager is cache.evictor


def test_backend_factory_refuses_hybrid_models_and_bad_flags(monkeypatch):
    engine = Engine(page_size=16)
    monkeypatch.setenv(CONFIG_ENV, json.dumps({"kv_budget_tokens": 256}))
    server_args = ServerArgs(model_path="dummy", device="cpu", enable_mixed_chunk=True)
    with pytest.raises(
        ValueError,
        match=r"--enable-mixed-chunk.*sliding-window",
    ):
        radix_cache_factory(build_context(engine, server_args, is_hybrid_swa=True))


@pytest.mark.parametrize("scorer", ["window", "rkv"])
def test_backend_serves_query_reading_scorers_but_not_under_torch_compile(monkeypatch, scorer):
    engine = Engine(page_size=16)
    monkeypatch.setenv(CONFIG_ENV, json.dumps({"kv_budget_tokens": 256, "scorer": scorer}))
    monkeypatch.setattr(Active, "manager", None)
    server_args = ServerArgs(model_path="dummy", device="cpu")
    cache = radix_cache_factory(build_context(engine, server_args))
    assert cache.evictor.scorer.name == scorer
    server_args = ServerArgs(model_path="dummy", device="cpu", enable_torch_compile=True)
    with pytest.raises(ValueError, match=f"--enable-torch-compile with --kv-scorer {scorer}"):
        radix_cache_factory(build_context(engine, server_args))


def engine_shaped_llama(num_layers: int = NUM_LAYERS):
    """A model of the harness engine's heads and head_dim."""
    return build_tiny_llama(
        num_layers=num_layers,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_HEADS,
        hidden_size=NUM_HEADS * HEAD_DIM,
    )


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    """An HF model folder of the harness engine's shape (layers, heads, head_dim)."""
    path = tmp_path_factory.mktemp("engine-model")
    engine_shaped_llama().save_pretrained(path)
    return path


@pytest.mark.parametrize("stats_layers", [NUM_LAYERS, NUM_LAYERS + 1])
def test_backend_refuses_triattention_stats_of_another_model_naming_both_shapes(
    monkeypatch, tmp_path, engine_model, stats_layers
):
    """Stats of another model would be refused at every decode step; the factory
    refuses them once, at startup, with the shapes and the calibration command."""
    from sglang.srt.configs.model_config import ModelConfig

    stats = tmp_path / "stats.safetensors"
    save_stats(calibrate(engine_shaped_llama(stats_layers), torch.arange(32)), stats)
    policy = {"kv_budget_tokens": 256, "scorer": "triattention"}
    monkeypatch.setenv(
        CONFIG_ENV, json.dumps({**policy, "scorer_params": {"stats_path": str(stats)}})
    )
    monkeypatch.setattr(Active, "manager", None)
    context = build_context(
        Engine(page_size=16),
        ServerArgs(model_path="dummy", device="cpu"),
        model_config=ModelConfig(model_path=str(engine_model)),
    )
    if stats_layers == NUM_LAYERS:
        assert isinstance(radix_cache_factory(context), EvictingRadixCache)
        return
    with pytest.raises(ValueError) as refused:
        radix_cache_factory(context)
    message = str(refused.value)
    assert f"stats are for {stats_layers} layers x {NUM_HEADS} attention heads" in message
    assert f"the model has {NUM_LAYERS} layers x {NUM_HEADS} attention heads" in message
    assert f"sglang-evict calibrate --model-path {engine_model}" in message


def test_backend_refuses_what_mla_cannot_serve_before_touching_the_pool(monkeypatch, tmp_path):
    from sglang.srt.configs.model_config import ModelConfig
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(tmp_path)
    # MLA runs with eviction (tests/test_engine_mla.py); a query scorer is refused
    monkeypatch.setenv(CONFIG_ENV, json.dumps({"kv_budget_tokens": 256, "scorer": "window"}))
    context = build_context(
        Engine(page_size=16),
        ServerArgs(model_path="dummy", device="cpu"),
        model_config=ModelConfig(model_path=str(tmp_path)),
    )
    with pytest.raises(ValueError, match=r"--kv-scorer window on DeepseekV3ForCausalLM"):
        radix_cache_factory(context)


def test_forward_batch_hook_adds_each_requests_position_offset(monkeypatch):
    config = EvictionConfig(
        kv_budget_tokens=64, cadence_tokens=16, window_tokens=16, scorer="streaming", page_size=1
    )
    engine = Engine(page_size=1, config=config)
    req = engine.add_request("a", list(range(40)))
    for step in range(60):
        engine.decode_step(req, step)
    offset = engine.position_offset(req)
    assert offset > 0
    monkeypatch.setattr(Active, "manager", engine.cache.evictor)
    seq_lens = torch.tensor([req_kv(req).kv_committed_len + 1, 5])
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=2,
        input_ids=torch.zeros(2, dtype=torch.int64),
        req_pool_indices=torch.tensor([req_kv(req).req_pool_idx, 7]),
        seq_lens=seq_lens,
        out_cache_loc=torch.zeros(2, dtype=torch.int64),
        seq_lens_sum=int(seq_lens.sum()),
        positions=seq_lens - 1,
    )
    _after_forward_batch_init_new(forward_batch)
    # The evicted request decodes at its true position; the other is untouched.
    assert forward_batch.positions.tolist() == [40 + 60, 4]
    forward_batch.forward_mode = ForwardMode.EXTEND
    forward_batch.positions = torch.tensor([0, 1])
    _after_forward_batch_init_new(forward_batch)
    assert forward_batch.positions.tolist() == [0, 1]


def test_forward_batch_hook_keeps_sglangs_positions_until_a_request_is_compacted(monkeypatch):
    """While no request has been compacted every offset is 0: the decode hook leaves
    SGLang's own positions tensor in place (no tensor operation on the step); after the
    first pass it adds the offsets."""
    config = EvictionConfig(
        kv_budget_tokens=64, cadence_tokens=16, window_tokens=16, scorer="streaming", page_size=1
    )
    engine = Engine(page_size=1, config=config)
    req = engine.add_request("a", list(range(40)))
    monkeypatch.setattr(Active, "manager", engine.cache.evictor)

    def hooked_positions():
        seq_lens = torch.tensor([req_kv(req).kv_committed_len + 1])
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=1,
            input_ids=torch.zeros(1, dtype=torch.int64),
            req_pool_indices=torch.tensor([req_kv(req).req_pool_idx]),
            seq_lens=seq_lens,
            out_cache_loc=torch.zeros(1, dtype=torch.int64),
            seq_lens_sum=int(seq_lens.sum()),
            positions=seq_lens - 1,
        )
        sglangs = forward_batch.positions
        _after_forward_batch_init_new(forward_batch)
        return sglangs, forward_batch.positions

    steps = 0
    while not engine.pass_log:
        sglangs, hooked = hooked_positions()
        assert hooked is sglangs and engine.cache.evictor.num_tracked_requests() == 0
        engine.decode_step(req, steps)
        steps += 1
    sglangs, hooked = hooked_positions()
    assert hooked is not sglangs
    assert hooked.tolist() == [40 + steps] and sglangs.tolist() == [req_kv(req).kv_committed_len]


def test_metrics_count_what_the_passes_did():
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    recorder = EvictionMetrics.create("knorm", registry=registry)
    config = EvictionConfig(
        kv_budget_tokens=64, cadence_tokens=16, window_tokens=16, page_size=16, scorer="knorm"
    )
    engine = Engine(page_size=16, config=config)
    req = engine.add_request("a", list(range(40)))
    for step in range(100):
        engine.decode_step(req, step)
    for _, result in engine.pass_log:  # one request: one result per batched pass
        recorder.record_batch([result], result.duration_s)
    labels = {"strategy": "hole_fill", "scorer": "knorm"}

    def value(name, **extra):
        return registry.get_sample_value(name, {**labels, **extra})

    results = [r for _, r in engine.pass_log]
    assert value(metric_names.PASSES_TOTAL) == len(results) > 0
    assert value(metric_names.PAGES_FREED_TOTAL) == sum(r.pages_freed for r in results)
    assert value(metric_names.TOKENS_EVICTED_TOTAL) == sum(r.tokens_evicted for r in results)
    assert value(metric_names.SLOT_COPIES_TOTAL) == sum(r.slot_copies for r in results)
    assert value(metric_names.BYTES_MOVED_TOTAL) == sum(r.bytes_moved for r in results)
    assert value(metric_names.PASS_DURATION_SECONDS + "_count") == len(results)
    occupancy = registry.get_sample_value(
        metric_names.BUDGET_OCCUPANCY_RATIO + "_count", {"scorer": "knorm"}
    )
    assert occupancy == len(results)


def test_metrics_of_one_pass_count_each_requests_scorer_and_budget():
    """A batched pass of requests under two scorers (per-request policies) and
    budgets, run early for a step that could not allocate: each scorer's counters hold
    its own requests' sums, the occupancy histogram one observation per request."""
    from prometheus_client import CollectorRegistry

    from sglang_evict.passes.state import PassResult

    registry = CollectorRegistry()
    recorder = EvictionMetrics.create("knorm", registry=registry)
    copies = torch.tensor([3, 0, 5, 2])
    rows = [  # (tokens before, after, pages freed, scorer, budget)
        (300, 256, 2, "knorm", 256),
        (200, 128, 4, "streaming", 128),
        (290, 256, 1, "knorm", 256),
        (100, 64, 2, "streaming", 64),
    ]
    results = [
        PassResult(f"r{i}", before, after, freed, "hole_fill", False, 0.001, copies, i, 10, s, b)
        for i, (before, after, freed, s, b) in enumerate(rows)
    ]
    recorder.record_batch(results, 0.001, pressure=True)
    for scorer in ("knorm", "streaming"):
        labels = {"strategy": "hole_fill", "scorer": scorer}
        mine = [r for r in rows if r[3] == scorer]
        for name in (metric_names.PASSES_TOTAL, metric_names.PRESSURE_PASSES_TOTAL):
            assert registry.get_sample_value(name, labels) == len(mine)
        evicted = registry.get_sample_value(metric_names.TOKENS_EVICTED_TOTAL, labels)
        assert evicted == sum(before - after for before, after, *_ in mine)
        freed = registry.get_sample_value(metric_names.PAGES_FREED_TOTAL, labels)
        assert freed == sum(r[2] for r in mine)
        occupancy = metric_names.BUDGET_OCCUPANCY_RATIO
        assert registry.get_sample_value(occupancy + "_count", {"scorer": scorer}) == 2
        assert registry.get_sample_value(occupancy + "_sum", {"scorer": scorer}) == pytest.approx(
            sum(before / budget for before, _, _, _, budget in mine)
        )
    server = {"strategy": "hole_fill", "scorer": "knorm"}  # the batch's, under the server's
    assert registry.get_sample_value(metric_names.SLOT_COPIES_TOTAL, server) == 10
    assert registry.get_sample_value(metric_names.BYTES_MOVED_TOTAL, server) == 2 * 10 * 10
    assert registry.get_sample_value(metric_names.PASS_DURATION_SECONDS + "_count", server) == 1


def test_metric_names_never_reuse_sglangs_namespace():
    names = [v for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str)]
    assert len(names) == 21 and all(name.startswith("sglang_evict:") for name in names)


def test_decode_hook_replaces_batch_lengths_keeping_their_dtypes():
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_evict.srt.hooks import compact_decode_batch

    config = EvictionConfig(
        kv_budget_tokens=64, cadence_tokens=16, window_tokens=16, scorer="knorm", page_size=16
    )
    engine = Engine(page_size=16, config=config)
    reqs = [engine.add_request("a", list(range(40))), engine.add_request("b", [1, 2, 3])]
    for step in range(40):
        engine.decode_batch(reqs, [step, step])
    before = [req_kv(r).kv_committed_len for r in reqs]  # a is at its trigger, b is not
    batch = ScheduleBatch.init_new(
        reqs,
        engine.driver.req_to_token_pool,
        engine.allocator,
        engine.cache,
        SimpleNamespace(vocab_size=1 << 20, is_encoder_decoder=False),
        enable_overlap=False,
        spec_algorithm=SpeculativeAlgorithm.NONE,
    )
    batch.seq_lens = torch.tensor(before, dtype=torch.int64)
    batch.seq_lens_cpu = torch.tensor(before, dtype=torch.int64)
    batch.orig_seq_lens = old_orig = torch.tensor(before, dtype=torch.int32)
    (result,) = compact_decode_batch(engine.cache.evictor, batch)
    assert batch.seq_lens.tolist() == [result.tokens_after, before[1]]
    assert batch.seq_lens_cpu.tolist() == batch.seq_lens.tolist()
    assert batch.orig_seq_lens.dtype == torch.int32 and batch.orig_seq_lens is not old_orig
    assert old_orig.tolist() == before  # the in-flight forward's tensor is untouched


@pytest.mark.parametrize(
    "attribute,value,flag",
    [("enable_hisparse", True, "--enable-hisparse"), ("dcp_size", 2, "--dcp-size > 1")],
)
def test_sglang_0523_only_paths_are_refused_by_name(attribute, value, flag):
    from types import SimpleNamespace

    from sglang_evict.srt.server_args import startup_problems

    config = EvictionConfig(kv_budget_tokens=256, scorer="streaming")
    (problem,) = startup_problems(SimpleNamespace(**{attribute: value}), config)
    assert problem.startswith(f"{flag} is not supported with sglang-evict yet")
    assert problem.endswith("remove it")
    assert startup_problems(SimpleNamespace(**{attribute: None}), config) == []


def test_beam_search_requests_are_refused_naming_the_field():
    from types import SimpleNamespace

    from sglang_evict.request_policy import RequestPolicyError
    from sglang_evict.srt.request_policy import _after_validate_one_request
    from sglang_evict.srt.server_args import BACKEND_NAME

    manager = SimpleNamespace(server_args=SimpleNamespace(radix_cache_backend=BACKEND_NAME))
    beam = SimpleNamespace(sampling_params={"max_new_tokens": 8, "beam_width": 4})
    with pytest.raises(RequestPolicyError, match="beam_width=4 is not supported") as refused:
        _after_validate_one_request(None, manager, beam)
    assert refused.value.field == "beam_width"
    plain = SimpleNamespace(sampling_params={"max_new_tokens": 8, "beam_width": 1})
    assert _after_validate_one_request("ok", manager, plain) == "ok"
