"""Generation through SGLang's memory classes with the compactor as a real sidecar:
SIGKILLs at random points of passes, and the trace of a pass across both processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from sglang_evict.models.reference_loop import GenerationRequest, generate
from sglang_evict.srt.cpu_driver import MemoryDriver
from tests.compactor_process import CompactorProcess
from tests.fault_driver import PAGE, fault_model, make_driver


@pytest.fixture(scope="module")
def model():
    return fault_model()


def requests(num_requests: int, new_tokens: int) -> list[GenerationRequest]:
    generator = torch.Generator().manual_seed(5)
    shared = torch.randint(256, (8,), generator=generator).tolist()  # a shared prefix
    return [
        GenerationRequest(
            f"r{i}",
            shared + torch.randint(256, (16,), generator=generator).tolist(),
            new_tokens,
            arrival_step=3 * i,
        )
        for i in range(num_requests)
    ]


def assert_nothing_leaked(driver: MemoryDriver) -> None:
    assert driver.cache.protected_size() == 0
    assert driver.free_tokens() + driver.cache.evictable_size() == driver.num_tokens
    driver.cache.check_invariants()


def test_compactor_sigkilled_at_random_points_of_passes_corrupts_and_leaks_nothing(tmp_path, model):
    from tests.sglang_harness import sglang_checker

    work = requests(4, 120)
    reference = generate(make_driver(model), model, work)
    process = CompactorProcess(tmp_path, "--supervise", "--fault-injection", "11:0.3").start()
    driver = make_driver(model, compactor="grpc", compactor_socket=str(process.socket))
    compactor = driver.evictor.compactor
    compactor.retry_interval_s = 0.0  # probe the restarted sidecar at the next pass

    def on_step(*_):
        sglang_checker(driver).self_check_during_busy()
        if not compactor.sidecar_up:  # killed: continue once the supervisor restarted it
            process.wait_healthy()

    result = generate(driver, model, work, on_step=on_step)
    process.stop()
    kills = sum(e["msg"] == "compactor process died; restarting" for e in process.log_entries())
    print(
        f"\n{kills} SIGKILLs; passes: {compactor.sidecar_passes} by the sidecar, "
        f"{compactor.fallback_passes} completed in-process"
    )
    assert kills >= 25, f"only {kills} SIGKILLs landed; raise the pass count"
    assert compactor.sidecar_passes > 0 and compactor.fallback_passes >= kills
    # Zero corrupted requests: every output equals the no-fault run's.
    assert result.outputs == reference.outputs
    assert [(r, s, p.tokens_after) for r, s, p in result.passes] == [
        (r, s, p.tokens_after) for r, s, p in reference.passes
    ]
    assert_nothing_leaked(driver)


def _console_spans(text: str) -> list[dict]:
    decoder, spans, index = json.JSONDecoder(), [], 0
    while True:
        index = text.find("{", index)
        if index < 0:
            return spans
        span, index = decoder.raw_decode(text, index)
        spans.append(span)


def test_a_pass_is_one_trace_across_scheduler_and_compactor(tmp_path, model, redis_server):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # the test process stands in for SGLang's

    process = CompactorProcess(
        tmp_path,
        env={
            "SGLANG_EVICT_REDIS_URL": redis_server.url,
            "OTEL_TRACES_EXPORTER": "console",
            "OTEL_SERVICE_NAME": "compactor-under-test",
        },
    ).start()
    driver = make_driver(
        model,
        compactor="grpc",
        compactor_socket=str(process.socket),
        lease_store="redis",
        redis_url=redis_server.url,
    )
    result = generate(driver, model, requests(1, 40))
    assert process.stop() == 0  # flushes the compactor's spans
    assert driver.evictor.compactor.sidecar_passes == len(result.passes) > 0

    local = exporter.get_finished_spans()
    remote = _console_spans(process.stdout.read_text())
    assert remote, "the compactor exported no spans"

    def hex_id(value: int, width: int) -> str:
        return f"0x{value:0{width}x}"

    passes = [s for s in local if s.name == "compaction.pass"]
    assert len(passes) == len(result.passes)
    first = passes[0]
    attributes = dict(first.attributes)
    assert attributes["compaction.outcome"] == "committed"
    assert attributes["compaction.fencing_token"] > 0
    assert attributes["compaction.tokens_after"] < attributes["compaction.tokens_before"]
    children = {s.name: s for s in local if s.parent and s.parent.span_id == first.context.span_id}
    assert {"compaction.score", "compaction.plan", "compaction.rpc", "compaction.commit"} <= set(
        children
    )
    rpc = children["compaction.rpc"]
    client_calls = [s for s in local if s.parent and s.parent.span_id == rpc.context.span_id]
    # The first pass registers the pool, then compacts.
    assert [s.name.rsplit("/", 1)[1] for s in client_calls] == ["RegisterPool", "Compact"]
    client_calls = client_calls[1:]
    trace_id = hex_id(first.context.trace_id, 32)
    in_trace = [s for s in remote if s["context"]["trace_id"] == trace_id]
    server = [s for s in in_trace if s["parent_id"] == hex_id(client_calls[0].context.span_id, 16)]
    assert [s["name"] for s in server] == ["/sglang_evict.compactor.v1.Compactor/Compact"]
    compact = [s for s in in_trace if s["parent_id"] == server[0]["context"]["span_id"]]
    assert [s["name"] for s in compact] == ["compactor.compact"]
    steps = {s["name"] for s in in_trace if s["parent_id"] == compact[0]["context"]["span_id"]}
    assert steps == {"compactor.validate", "compactor.lease_check", "compactor.kernel"}
    assert all(
        s["resource"]["attributes"]["service.name"] == "compactor-under-test" for s in server
    )


def test_spans_cost_nothing_until_a_tracer_provider_is_installed_then_record():
    """In a fresh process (a tracer provider is installed once per process): before
    one is installed, a pass's spans are not OpenTelemetry's (theirs cost the host
    ~10-20 us each); after, the next pass's spans are recorded with their attributes."""
    script = textwrap.dedent(
        """
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from compactor_service import tracing

        with tracing.tracer().start_as_current_span(tracing.SPAN_PASS) as span:
            span.set_attribute(tracing.ATTR_REQUESTS, 1)
            assert not isinstance(span, trace.Span)  # OpenTelemetry's no-op is one
            assert not trace.get_current_span().is_recording()
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        with tracing.tracer().start_as_current_span(tracing.SPAN_PASS) as span:
            span.set_attribute(tracing.ATTR_REQUESTS, 2)
            with tracing.tracer().start_as_current_span(tracing.SPAN_SCORE):
                pass
        print([(s.name, dict(s.attributes)) for s in exporter.get_finished_spans()])
        """
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(
        [("compaction.score", {}), ("compaction.pass", {"compaction.requests": 2})]
    )


def test_redis_restart_mid_run_pauses_compaction_and_serving_goes_on(tmp_path, model):
    """Passes take their lease from Redis and the in-process compactor checks it there:
    while Redis is down no pass commits (nothing moves without a valid lease), every
    request still finishes, and compaction resumes once Redis is back."""
    from tests.redis_server import RedisServer

    redis = RedisServer(tmp_path).start()
    driver = make_driver(model, lease_store="redis", redis_url=redis.url)
    # Retry the store at every step (default: pause 1 s after a failure), so that the
    # steps after the restart are not all inside a pause on a fast machine.
    driver.evictor.lease.retry_interval_s = 0.0
    outage = range(30, 45)  # decode steps without Redis
    failures_during_outage = []
    original = driver.prepare_decode

    def prepare_decode(reqs):
        slots, positions, passes = original(reqs)
        if step[0] in outage:
            failures_during_outage.append(sum(p is not None for p in passes))
        return slots, positions, passes

    step = [0]

    def on_step(at, _result):
        step[0] = at + 1
        if step[0] == outage.start:
            redis.stop()
        if step[0] == outage.stop:
            redis.start()

    driver.prepare_decode = prepare_decode
    work = requests(2, 100)
    try:
        result = generate(driver, model, work, on_step=on_step)
    finally:
        redis.stop()
    steps = [s for _, s, _ in result.passes]
    assert len(result.outputs) == 2
    assert failures_during_outage and sum(failures_during_outage) == 0  # no commit
    assert any(s < outage.start for s in steps) and any(s >= outage.stop for s in steps)
    assert not any(outage.start + 1 <= s < outage.stop for s in steps)
    assert_nothing_leaked(driver)


def test_shared_prefix_pages_are_pinned_while_locked_and_the_compactor_refuses_them(model):
    """Radix nodes locked by running requests pin their pages in the lease store under
    the scheduler's holder name; a pass touching them is refused before any byte moves,
    whatever holder it names; finishing the requests unpins everything."""
    from compactor_service.compactor import LeaseClaim, LeaseRefused, check_leases

    driver = make_driver(model)  # lease_store="inprocess" by default
    manager = driver.evictor
    store = manager.leases
    prompt = list(range(1, 25))  # 6 pages of 4
    first, _, _ = driver.admit("a", prompt)
    driver.prefill_done(first)
    second, prefix_len, _ = driver.admit("b", [*prompt, 30, 31, 32, 33])
    driver.prefill_done(second)
    assert prefix_len == 24
    shared_slots = driver.row(second)[:prefix_len].to(torch.int64)
    shared_pages = sorted(set((shared_slots // PAGE).tolist()))
    other = "scheduler-other"
    assert store.pinned_by_others(shared_pages, other) == shared_pages
    assert store.pinned_by_others(shared_pages, manager.lease_holder) == []
    lease = store.acquire("pass-of-other", other, 1000)
    for holder in (other, manager.lease_holder):
        claim = LeaseClaim("pass-of-other", lease.token, holder)
        with pytest.raises(LeaseRefused, match="are pinned"):
            check_leases(store, claim, shared_slots[:1], torch.tensor([1000]), PAGE)
    for req in (first, second):
        req.output_ids.append(0)
        driver.finish(req)
    assert store.pinned(shared_pages) == []
    assert manager.lease.pin_failures == 0
    assert_nothing_leaked(driver)


def test_an_unreachable_lease_store_pauses_passes_instead_of_being_called_every_step(model):
    driver = make_driver(model, lease_store="redis", redis_url="redis://127.0.0.1:1/0")
    manager = driver.evictor
    manager.lease.retry_interval_s = 3600.0
    calls = []
    acquire = manager.leases.acquire

    def counting_acquire(*args):
        calls.append(args)
        return acquire(*args)

    manager.leases.acquire = counting_acquire
    result = generate(driver, model, requests(1, 60))
    assert result.passes == [] and len(result.outputs) == 1  # served, nothing compacted
    assert len(calls) == 1  # the first failure paused every later pass
    assert_nothing_leaked(driver)
