"""Evicting replicas behind SGLang's router, for real on one machine: two ``sglang-evict
serve`` servers on CPU (the project's small model) and ``sglang-evict router`` (SGLang's
router from its PyPI package, cache-aware) in front of them.

Conversations and requests sharing a system prompt land on the replica holding their
prefix (SGLang's ``cached_tokens`` on each follow-up equals one server's), each
replica's ``/metrics`` counts its own passes, a per-request policy reaches the worker
through the router's OpenAI routes (and a bad one is the worker's 400 at the router's
client), and a replica SIGKILLed under a load of long generations ends every request
(completed on the other, or an error the client sees; none hangs) while the surviving
replica's idle check passes afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.engine_harness import assert_clean_after, prometheus_samples, wait_until
from tests.router_harness import RouterProcess, cached_tokens, start_replicas

# Its own xdist group: it starts (and kills) replicas of its own, beside the shared
# engines.
pytestmark = [pytest.mark.engine, pytest.mark.engine_group("router")]

CONVERSATIONS = 4
TURNS = 3
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def fleet(engine_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("router")
    replicas = start_replicas(engine_model, log_dir)
    router = None
    try:
        router = RouterProcess([r.url for r in replicas], log_dir / "router.log").start()
        yield replicas, router
    finally:
        if router is not None:
            router.stop()
        for replica in replicas:
            replica.stop()


def flush(replicas) -> None:
    for replica in replicas:
        assert wait_until(lambda r=replica: r.get("/flush_cache").status_code == 200, 60)


# Leading words that share no first token: conversations share no prefix at all (past a
# BOS token), so a follow-up finds its prefix only on the replica that served its turns.
LEADS = ("Apples", "Bridges", "Comets", "Deserts", "Engines", "Forests", "Glaciers", "Harbors")


def system_prompt(topic: int) -> str:
    """A system prompt of its own per topic."""
    lead = LEADS[topic % len(LEADS)]
    return f"{lead} {topic}. " + " ".join(f"rule {topic}.{i} holds;" for i in range(24))


def generate(url: str, text: str) -> dict:
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0},
    }
    response = requests.post(url + "/generate", json=body, timeout=600)
    response.raise_for_status()
    return response.json()


def converse(url: str) -> list[list[int]]:
    """Every conversation, turn after turn (each turn's text: the last turn's text, its
    answer and a new question); ``cached_tokens`` of each turn."""
    cached = []
    for topic in range(CONVERSATIONS):
        text, seen = system_prompt(topic), []
        for turn in range(TURNS):
            text += f" Question {turn}: what follows?"
            reply = generate(url, text)
            seen.append(cached_tokens(reply))
            text += reply["text"]
        cached.append(seen)
    return cached


def share_a_system_prompt(url: str) -> list[int]:
    prefix = system_prompt(99)
    return [cached_tokens(generate(url, f"{prefix} Question {q}?")) for q in range(4)]


def test_follow_ups_land_on_the_replica_holding_their_prefix(fleet):
    replicas, router = fleet
    flush(replicas)
    through_router = converse(router.url)
    shared_through_router = share_a_system_prompt(router.url)
    flush(replicas)
    one_server = converse(replicas[0].url)
    shared_one_server = share_a_system_prompt(replicas[0].url)
    print(
        f"\nrouter: cached tokens per turn {through_router}, sharing a system prompt "
        f"{shared_through_router}; one server: {one_server}, {shared_one_server}"
    )
    # Follow-ups (a first turn may match a BOS token another request left on its
    # replica: not a prefix of the conversation).
    assert [turns[1:] for turns in through_router] == [turns[1:] for turns in one_server]
    assert shared_through_router[1:] == shared_one_server[1:]
    # Follow-ups did find a prefix (the comparison is not between two misses).
    assert all(min(turns[1:]) > turns[0] for turns in one_server)
    assert min(shared_one_server[1:]) > shared_one_server[0]


def test_each_replica_counts_its_own_passes(fleet):
    replicas, router = fleet
    before = [replica.plugin_state()["passes"] for replica in replicas]
    texts = [f"{LEADS[i]} story {i}: tell it." for i in range(6)]
    with ThreadPoolExecutor(len(texts)) as pool:
        replies = list(pool.map(lambda t: long_generation(router.url, t, 96), texts))
    assert all(reply.status_code == 200 for reply in replies)
    states = [replica.plugin_state() for replica in replicas]
    gained = [state["passes"] - b for state, b in zip(states, before, strict=True)]
    print(f"\npasses per replica over 6 routed requests: {gained}")
    assert all(g > 0 for g in gained), "the router sent every request to one replica"
    for replica, state in zip(replicas, states, strict=True):
        samples = prometheus_samples(replica.get("/metrics").text)
        total = sum(v for k, v in samples.items() if k.startswith("sglang_evict:passes_total"))
        assert total == state["passes"]  # its own passes, not the fleet's


def long_generation(url: str, text: str, new_tokens: int, timeout_s: float = 600):
    body = {
        "model": "default",
        "prompt": text,
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return requests.post(url + "/v1/completions", json=body, timeout=timeout_s)


def test_per_request_policy_reaches_the_worker_through_the_router(fleet):
    replicas, router = fleet

    def passes() -> int:
        return sum(replica.plugin_state()["passes"] for replica in replicas)

    def completion(custom_params: dict | None):
        body = {
            "model": "default",
            "prompt": "Harbors: tell a long story.",
            "max_tokens": 120,
            "temperature": 0,
            "ignore_eos": True,
        }
        if custom_params is not None:
            body["custom_params"] = {"sglang_evict": custom_params}
        return requests.post(router.url + "/v1/completions", json=body, timeout=600)

    start = passes()
    assert completion(None).status_code == 200
    default_passes = passes() - start
    start = passes()
    assert completion({"kv_budget_tokens": 4096}).status_code == 200
    above_length_passes = passes() - start
    assert default_passes > 0 and above_length_passes == 0
    bad = completion({"kv_budget_tokens": 20})
    assert bad.status_code == 400, bad.text
    assert "kv_budget_tokens" in bad.text and "allowed: [21, 4096]" in bad.text


def test_generate_route_through_the_router_drops_custom_params(fleet):
    """sglang-router 0.3.2 re-serialises ``/generate``'s sampling parameters and drops
    ``custom_params``: a request's policy never reaches the worker that way (documented in
    docs/serving.md; the OpenAI routes carry it). When a router release keeps it, this
    test fails and the docs change."""
    _, router = fleet
    body = {
        "text": "Hello",
        "sampling_params": {
            "max_new_tokens": 4,
            "custom_params": {"sglang_evict": {"kv_budget_tokens": 64}},
        },
    }
    reply = requests.post(router.url + "/generate", json=body, timeout=600).json()
    reports = [r for r in reply["meta_info"]["sglang_evict"] if r]
    assert reports and reports[-1]["kv_budget_tokens"] != 64


def test_a_replica_killed_under_load_ends_every_request_and_the_other_serves_on(fleet):
    replicas, router = fleet
    doomed, survivor = replicas
    mark = survivor.mark()
    texts = [f"{LEADS[i]} saga {i}: tell it." for i in range(8)]
    outcomes: list[str] = []

    def one(text: str) -> str:
        try:
            reply = long_generation(router.url, text, 192, timeout_s=300)
        except requests.RequestException as error:
            return f"error {type(error).__name__}"
        return "completed" if reply.status_code == 200 else f"status {reply.status_code}"

    with ThreadPoolExecutor(len(texts)) as pool:
        futures = [pool.submit(one, text) for text in texts]
        assert wait_until(lambda: doomed.plugin_state()["tracked_requests"] > 0, 120)
        os.killpg(doomed.process.pid, signal.SIGKILL)  # server, scheduler, detokenizer
        started = time.monotonic()
        outcomes = [future.result(timeout=400) for future in futures]
    print(f"\noutcomes with one replica killed: {outcomes} ({time.monotonic() - started:.0f} s)")
    assert len(outcomes) == len(texts)  # none hung
    assert all(o == "completed" or o.startswith(("status", "error")) for o in outcomes)
    assert "completed" in outcomes  # the survivor's share completed
    # The router stops sending to the dead replica: new requests all complete.
    assert wait_until(lambda: doomed.url not in router.healthy_workers(), 60)
    after = [long_generation(router.url, f"{LEADS[i]} coda {i}.", 16) for i in range(4)]
    assert [reply.status_code for reply in after] == [200] * 4
    assert_clean_after(survivor, mark)


def test_router_command_refuses_an_unreachable_worker_and_one_without_the_plugin(fleet):
    replicas, router = fleet
    alive = next(replica for replica in replicas if replica.alive)
    refused = subprocess.run(
        [sys.executable, "-m", "sglang_evict.cli.main", "router", "--worker-urls", alive.url,
         "http://127.0.0.1:9", "--wait-s", "2", "--dry-run"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.count("\n") == 1
    assert "worker http://127.0.0.1:9 did not answer /get_server_info within 2 s" in refused.stderr
    checked = subprocess.run(
        [sys.executable, "-m", "sglang_evict.cli.main", "router", "--worker-urls", alive.url,
         "--dry-run", "--prometheus-port", "29111"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    assert "sglang_router.launch_router --worker-urls " + alive.url in checked.stdout
    assert checked.stdout.rstrip().endswith("--prometheus-port 29111")
    # A server that answers /get_server_info without the plugin's state (here the router
    # itself, a plausible mistake; plain SGLang answers the same way): refused by name.
    plain = subprocess.run(
        [sys.executable, "-m", "sglang_evict.cli.main", "router", "--worker-urls", alive.url,
         router.url, "--dry-run"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert plain.returncode == 2, plain.stderr
    assert f"worker {router.url} answers /get_server_info without the eviction plugin's state" in (
        plain.stderr
    )
    assert "start it with `sglang-evict serve`" in plain.stderr and not plain.stdout
