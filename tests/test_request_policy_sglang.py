"""Per-request policy through SGLang's real classes on CPU (``MemoryDriver``): requests
of one decode batch evict under their own budgets, cadences and scorers; the scheduler's
and the tokenizer manager's checks; the report a finished request carries; and the KV
bound an admission policy can reserve."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.managers.schedule_batch import FINISH_ABORT

from sglang_evict.request_policy import (
    REPORT_KEY,
    RequestPolicyError,
    bounded_kv_tokens,
    report_of,
)
from sglang_evict.srt.introspection import prefix_entries, tree_digest
from sglang_evict.srt.request_policy import (
    CARRIED_ATTR,
    POLICY_ATTR,
    _after_validate_one_request,
    _before_add_request_to_queue,
    _entrance,
    request_scorers,
)
from sglang_evict.srt.server_args import BACKEND_NAME, CONFIG_ENV
from sglang_evict.srt.versioned import req_kv
from tests.sglang_harness import Engine
from tests.test_request_policy import server


def policy(**fields) -> dict:
    return {"sglang_evict": fields}


def run(engine: Engine, reqs: list, steps: int) -> dict[str, int]:
    """Decode ``reqs`` as one batch for ``steps`` steps, checking every invariant after
    each; returns each request's most KV slots held (``kv_allocated_len``)."""
    peak = {req.rid: req_kv(req).kv_allocated_len for req in reqs}
    for step in range(steps):
        engine.decode_batch(reqs, [1000 + step] * len(reqs))
        engine.check()
        for req in reqs:
            peak[req.rid] = max(peak[req.rid], req_kv(req).kv_allocated_len)
    return peak


@pytest.mark.parametrize("page_size", [1, 16])
def test_requests_of_one_batch_evict_under_their_own_budgets_and_cadences(page_size):
    engine = Engine(page_size=page_size, config=server(page_size))
    prompt = list(range(10, 18))  # prompt + window = 24 protected: below every budget
    reqs = [
        engine.add_request("default", prompt),
        engine.add_request("small", prompt, custom_params=policy(kv_budget_tokens=32)),
        engine.add_request(
            "large", prompt, custom_params=policy(kv_budget_tokens=96, cadence_tokens=32)
        ),
        engine.add_request("off", prompt, custom_params=policy(enabled=False)),
    ]
    run(engine, reqs, 300)
    own = {"default": (48, 16), "small": (32, 16), "large": (96, 32)}
    passes: dict[str, list] = {}
    for rid, result in engine.pass_log:
        passes.setdefault(rid, []).append(result)
    assert set(passes) == set(own)  # the request with eviction off never had a pass
    for rid, (budget, cadence) in own.items():
        assert {(r.tokens_before, r.tokens_after) for r in passes[rid]} == {
            (budget + cadence, budget)
        }, rid
        assert {r.budget_tokens for r in passes[rid]} == {budget}
    assert req_kv(reqs[3]).kv_committed_len == len(prompt) + 300  # grows: nothing evicted


def test_requests_of_one_pass_ranked_by_different_scorers_keep_what_each_alone_keeps():
    """The pass groups its rows by scorer; each request's survivors equal those of the
    same request decoded alone under that scorer."""
    prompt = list(range(10, 30))
    chosen = {"a": "knorm", "b": "streaming", "c": "random", "d": "knorm"}

    def survivors(rids):
        engine = Engine(page_size=16, config=server(16))
        reqs = [
            engine.add_request(rid, prompt, custom_params=policy(scorer=chosen[rid]))
            for rid in rids
        ]
        for step in range(120):  # token ids differ per request: different keys
            engine.decode_batch(reqs, [1000 + 7 * step + i for i in range(len(reqs))])
            engine.check()
        assert {r.scorer for rid, r in engine.pass_log} == {chosen[rid] for rid in rids}
        return {req.rid: sorted(engine.driver.positions(req).tolist()) for req in reqs}

    together = survivors(list(chosen))
    for rid in chosen:
        assert together[rid] == survivors([rid])[rid], rid


def test_schedulers_check_aborts_a_refused_request_before_any_state():
    engine = Engine(page_size=1, config=server())
    scheduler = SimpleNamespace(tree_cache=engine.cache)
    good = _queued_req("good", {"kv_budget_tokens": 64})
    bad = _queued_req("bad", {"kv_budget_tokens": 4097})
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=0):  # a scheduler's rank (its abort logs on rank 0)
        for req in (good, bad):
            _before_add_request_to_queue(scheduler, req)
    assert getattr(good, POLICY_ATTR).kv_budget_tokens == 64 and good.to_finish is None
    assert not hasattr(bad, POLICY_ATTR)
    assert isinstance(bad.to_finish, FINISH_ABORT)
    finish = bad.to_finish.to_json()
    assert finish["status_code"] == 400
    assert "custom_params.sglang_evict.kv_budget_tokens=4097" in finish["message"]
    assert "allowed: [21, 4096]" in finish["message"]
    assert not engine.cache.evictor.states


def test_retracted_request_keeps_its_policy_without_a_second_check():
    engine = Engine(page_size=1, config=server())
    req = _queued_req("r", {"kv_budget_tokens": 64})
    scheduler = SimpleNamespace(tree_cache=engine.cache)
    _before_add_request_to_queue(scheduler, req)
    attached = getattr(req, POLICY_ATTR)
    req.sampling_params.custom_params = policy(kv_budget_tokens=10**6)
    _before_add_request_to_queue(scheduler, req, is_retracted=True)
    assert getattr(req, POLICY_ATTR) is attached and req.to_finish is None


def _queued_req(rid: str, overrides: dict):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=16, custom_params=policy(**overrides))
    return Req(rid, "", [1, 2, 3], params)


@pytest.fixture
def entrance(monkeypatch):
    """The tokenizer manager's view of a server started by ``sglang-evict serve``."""
    monkeypatch.setenv(CONFIG_ENV, server().to_json())
    _entrance.cache_clear()
    yield SimpleNamespace(
        server_args=SimpleNamespace(radix_cache_backend=BACKEND_NAME, page_size=1, tp_size=1)
    )
    _entrance.cache_clear()


def test_entrance_check_raises_the_message_the_client_gets_as_a_400(entrance):
    good = SimpleNamespace(sampling_params={"custom_params": policy(scorer="knorm")})
    _after_validate_one_request(None, entrance, good, [1, 2, 3])
    bad = SimpleNamespace(sampling_params={"custom_params": policy(cadence_tokens=0)})
    with pytest.raises(RequestPolicyError, match=r"cadence_tokens=0 is out of range"):
        _after_validate_one_request(None, entrance, bad, [1, 2, 3])
    assert isinstance(RequestPolicyError("f", "m"), ValueError)  # SGLang's 400 path


def test_entrance_ignores_custom_params_on_a_server_without_the_plugin(entrance):
    entrance.server_args.radix_cache_backend = None
    bad = SimpleNamespace(sampling_params={"custom_params": policy(cadence_tokens=0)})
    _after_validate_one_request(None, entrance, bad, [1, 2, 3])


def test_finished_request_carries_its_report_at_its_last_output_token():
    engine = Engine(page_size=1, config=server())
    req = engine.add_request("r", list(range(10, 18)), custom_params=policy(kv_budget_tokens=32))
    peak = run(engine, [req], 100)["r"]
    engine.finish(req)
    values = req.customized_info[REPORT_KEY]
    assert len(values) == len(req.output_ids) == 100
    assert values[:-1] == [None] * 99
    report = report_of({REPORT_KEY: values})
    results = [r for _, r in engine.pass_log]
    held = report.pop("kv_tokens_held")  # what it held as it ended: its budget and more
    assert 32 <= held <= peak
    assert report == {
        "enabled": True,
        "kv_budget_tokens": 32,
        "cadence_tokens": 16,
        "scorer": "streaming",
        "passes": len(results),
        "tokens_evicted": sum(r.tokens_evicted for r in results),
        "peak_kv_tokens": peak,
        "passes_failed": 0,
        "retractions": 0,
    }
    assert report["passes"] > 0 and peak == 32 + 16
    json.dumps(report)  # travels to the client as JSON


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(
    ("prompt_len", "overrides"),
    [
        (20, {}),
        (20, {"kv_budget_tokens": 24, "cadence_tokens": 1}),
        (20, {"kv_budget_tokens": 100, "cadence_tokens": 64}),
        (70, {"kv_budget_tokens": 24}),  # the protected prompt exceeds the budget
        (20, {"enabled": False}),
    ],
)
def test_bounded_kv_is_never_exceeded_and_is_reached(page_size, prompt_len, overrides):
    """The bound admission can reserve: the most KV a request holds never exceeds it,
    and a long enough request reaches it (in whole pages)."""
    config = server(page_size)
    engine = Engine(page_size=page_size, config=config)
    req = engine.add_request("r", list(range(prompt_len)), custom_params=policy(**overrides))
    new_tokens = 260
    peak = run(engine, [req], new_tokens)["r"]
    bound = bounded_kv_tokens(
        getattr(req, POLICY_ATTR), config, prompt_len=prompt_len, max_new_tokens=new_tokens
    )
    held_pages = -(-peak // page_size) * page_size
    assert held_pages == bound


def test_request_scorers_follow_what_the_server_runs():
    assert request_scorers(server()) == ("streaming", "knorm", "random")
    assert request_scorers(server(scorer="knorm")) == ("knorm", "streaming", "random")
    # Under tensor parallelism only scorers every rank agrees on without a reduction.
    assert request_scorers(server(scorer="knorm"), tp_size=2) == ("knorm", "streaming", "random")
    assert request_scorers(server(), tp_size=2) == ("streaming", "random")


def test_policy_reaches_the_pass_counts_of_a_long_protected_prompt():
    """A request whose protected prompt exceeds its budget still runs at most one pass
    per cadence tokens, its own cadence."""
    engine = Engine(page_size=1, config=server())
    req = engine.add_request(
        "r", list(range(80)), custom_params=policy(kv_budget_tokens=24, cadence_tokens=8)
    )
    run(engine, [req], 64)
    results = [r for _, r in engine.pass_log]
    assert results and all(r.tokens_evicted == 8 and r.protected_over_budget for r in results)
    assert torch.tensor([r.tokens_after for r in results]).eq(80 + 16).all()


@pytest.mark.parametrize("page_size", [1, 16])
def test_fork_branches_evict_their_own_tails_and_leave_the_shared_prefix_byte_for_byte(
    page_size,
):
    """What ``s.fork(3)`` sends: the prefix alone (cached on finish), then one request
    per branch extending it, each under its own policy, decoded as one batch."""
    engine = Engine(page_size=page_size, config=server(page_size))
    prefix = list(range(100, 132))  # two pages of 16
    commit = engine.add_request("commit", prefix)
    engine.finish(commit)
    before = prefix_entries(tree_digest(engine.cache), prefix)
    assert len(before) == len(prefix)
    policies = [{"kv_budget_tokens": 64, "cadence_tokens": 8}, {"scorer": "knorm"}, {}]
    branches = [
        engine.add_request(f"b{i}", [*prefix, 200 + i], custom_params=policy(**fields))
        for i, fields in enumerate(policies)
    ]
    assert all(req_kv(b).cache_protected_len >= len(prefix) for b in branches)  # matched, shared
    run(engine, branches, 150)
    assert {rid for rid, _ in engine.pass_log} == {"b0", "b1", "b2"}
    assert prefix_entries(tree_digest(engine.cache), prefix) == before
    for branch in branches:
        engine.finish(branch)
        engine.check()
    assert prefix_entries(tree_digest(engine.cache), prefix) == before
    later = engine.match([*prefix, 300, 301])
    assert later.indices[: len(prefix)].tolist() == [slot for _, slot, _ in before]


def test_report_counts_the_passes_from_before_a_retraction():
    """A retracted request loses its eviction state (it is re-prefilled from its
    tokens); its report at finish still counts every pass since it was admitted."""
    engine = Engine(page_size=1, config=server())
    overrides = policy(kv_budget_tokens=32)
    req = engine.add_request("r", list(range(10, 18)), custom_params=overrides)
    run(engine, [req], 100)
    tokens = list(req.origin_input_ids) + list(req.output_ids)
    engine.driver.retract(req)
    assert req.customized_info is None  # no report for a request that goes on
    # SGLang queues the same Req again; the driver admits a new one from its tokens,
    # so the retracted Req's carried counts are handed over here.
    again = engine.add_request("r", tokens, custom_params=overrides)
    setattr(again, CARRIED_ATTR, getattr(req, CARRIED_ATTR))
    run(engine, [again], 60)
    engine.finish(again)
    results = [r for _, r in engine.pass_log]
    report = report_of({REPORT_KEY: again.customized_info[REPORT_KEY]})
    assert report["passes"] == len(results) > getattr(req, CARRIED_ATTR)[0] > 0
    assert report["tokens_evicted"] == sum(r.tokens_evicted for r in results)
    assert report["retractions"] == 1 and report["passes_failed"] == 0


def test_report_counts_the_passes_that_failed_and_the_request_is_forgotten_at_finish():
    """While another grant holds the pass lease every pass of the request fails (it
    keeps its KV and backs off); its report counts them, its later passes commit, and
    after it finishes the plugin holds nothing of it, the failures included."""
    engine = Engine(page_size=1, config=server())
    manager = engine.driver.evictor
    held = manager.leases.acquire(manager.lease.resource, "someone-else", 10**9)
    failing = engine.add_request("failing", list(range(10, 18)))
    never = engine.add_request(
        "never-evicts", list(range(20, 28)), custom_params=policy(enabled=False)
    )
    run(engine, [failing, never], 80)
    attempts = manager.failures.counts["lease-busy"]
    assert attempts >= 2 and engine.pass_log == []
    assert manager.num_tracked_requests() == 1  # the failing request: no state, its failures
    assert manager.leases.release(held)
    run(engine, [failing, never], 80)
    assert engine.pass_log  # committed once the lease was free
    for req in (failing, never):
        engine.finish(req)
    assert manager.num_tracked_requests() == 0
    report = report_of({REPORT_KEY: failing.customized_info[REPORT_KEY]})
    assert report["passes_failed"] == attempts and report["passes"] == len(engine.pass_log)
    assert report_of({REPORT_KEY: never.customized_info[REPORT_KEY]})["passes_failed"] == 0


def test_a_request_whose_every_pass_failed_is_forgotten_at_finish():
    """No pass ever committed, so it never had eviction state: its failures go too."""
    engine = Engine(page_size=1, config=server())
    manager = engine.driver.evictor
    assert manager.leases.acquire(manager.lease.resource, "someone-else", 10**9)
    req = engine.add_request("r", list(range(10, 18)))
    run(engine, [req], 80)
    assert manager.states.get("r") is None and manager.failures.failed_passes["r"] >= 2
    engine.finish(req)
    assert manager.num_tracked_requests() == 0
    assert report_of({REPORT_KEY: req.customized_info[REPORT_KEY]})["passes_failed"] >= 2
