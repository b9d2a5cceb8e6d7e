"""Per-request policy, frontend programs and fork on SGLang's real HTTP server
(``sglang-evict serve`` on CPU, the session's shared ``POLICY_SERVER``): requests evict
under their own budgets, refused values are 400s that change nothing, forked branches
leave their shared prefix where it is, and the programs in ``examples/`` run."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_evict.models.engine_model import ensure_engine_model
from sglang_evict.request_policy import report_of
from sglang_evict.srt.engine_runner import (
    REQUEST_LINE_PREFIX,
    parse_decode_steps,
    parse_pass_lines,
)
from sglang_evict.srt.introspection import prefix_entries
from tests.engine_harness import (
    CADENCE,
    POLICY_SERVER,
    EngineSpec,
    greedy,
    policy_fields,
    reference_outputs,
)
from tests.test_request_policy import BAD_VALUES

# Every test here runs on each supported SGLang release (a surface that differs).
pytestmark = [pytest.mark.engine, pytest.mark.release_smoke]

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are a helpful assistant. Answer the question step by step."
# The server's limits (POLICY_SERVER), as the CPU reference loop must run them.
SERVER_POLICY = policy_fields(
    request_max_budget_tokens=4096, request_max_cadence_tokens=64, request_allow_disable=True
)


def evict(**fields) -> dict:
    return {"sglang_evict": fields}


@pytest.fixture(scope="module")
def server(engines):
    return engines.served(POLICY_SERVER)


def generate(server, input_ids, new_tokens, custom_params=None, **extra) -> dict:
    params = greedy(new_tokens, **({"custom_params": custom_params} if custom_params else {}))
    return server.post("/generate", {"input_ids": input_ids, "sampling_params": params, **extra})


def test_concurrent_requests_hold_kv_bounded_by_their_own_budgets(server, tokenizer):
    prompt = tokenizer("Tell me a story.")["input_ids"]  # + window: below every budget
    new_tokens = 160
    policies = {
        "small": {"kv_budget_tokens": 32},
        "large": {"kv_budget_tokens": 96, "cadence_tokens": 32},
        "off": {"enabled": False},
    }
    rids = {name: f"{name}-{uuid.uuid4().hex}" for name in policies}
    mark = server.log_size()
    with ThreadPoolExecutor(len(policies)) as pool:
        futures = {
            name: pool.submit(generate, server, prompt, new_tokens, evict(**fields), rid=rids[name])
            for name, fields in policies.items()
        }
        outputs = {name: future.result() for name, future in futures.items()}
    steps = parse_decode_steps(_log_since(server, mark))
    assert max(step.running_requests for step in steps) == 3  # they ran side by side

    passes: dict[str, list] = {name: [] for name in policies}
    names = {rid: name for name, rid in rids.items()}
    for record in server.pass_records(mark):
        for entry in record["requests"]:
            passes[names[entry["rid"]]].append(entry)
    for name, budget, cadence in (("small", 32, CADENCE), ("large", 96, 32)):
        held = {(entry["tokens_before"], entry["tokens_after"]) for entry in passes[name]}
        assert held == {(budget + cadence, budget)}, name
        report = report_of(outputs[name]["meta_info"])
        assert report["kv_budget_tokens"] == budget and report["cadence_tokens"] == cadence
        assert report["passes"] == len(passes[name]) > 0
        assert report["peak_kv_tokens"] == budget + cadence
        assert report["tokens_evicted"] == sum(
            e["tokens_before"] - e["tokens_after"] for e in passes[name]
        )
    assert passes["off"] == []  # eviction off: it grew to its whole length
    logged = parse_pass_lines(_log_since(server, mark), REQUEST_LINE_PREFIX)
    by_rid = {line.pop("rid"): line for line in logged}
    for name, rid in rids.items():  # the log line clients without meta_info read
        assert by_rid[rid] == report_of(outputs[name]["meta_info"]), name
    report = report_of(outputs["off"]["meta_info"])
    assert report["enabled"] is False and report["passes"] == 0
    assert report["peak_kv_tokens"] >= len(prompt) + new_tokens - 1


def test_budget_above_every_length_generates_what_plain_sglang_generates(
    server, engines, tokenizer
):
    prompts = [tokenizer(f"{SYSTEM} Question {i}: why?")["input_ids"] for i in range(3)]
    new_tokens = 120
    mark = server.log_size()
    plugin = generate(server, prompts, new_tokens, evict(kv_budget_tokens=4096))
    assert server.pass_records(mark) == []
    assert all(report_of(out["meta_info"])["passes"] == 0 for out in plugin)
    plain = engines.get(EngineSpec.plain(1)).generate(prompts, greedy(new_tokens))
    assert [o["output_ids"] for o in plugin] == [o["output_ids"] for o in plain]


@pytest.mark.parametrize(("overrides", "field", "words"), BAD_VALUES)
def test_bad_per_request_value_is_a_400_naming_the_field(server, overrides, field, words):
    body = {
        "text": "Hello",
        "sampling_params": greedy(8, custom_params={"sglang_evict": overrides}),
    }
    response = server.post_raw("/generate", body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert words in message and field in message


def test_refused_requests_change_nothing_and_others_are_served(server, tokenizer):
    """Every refused kind, on /generate and the OpenAI route, while another request
    runs: that one's output is what it is alone, and SGLang's pool accounting is what
    it was before the refused ones came."""
    prompt = tokenizer(f"{SYSTEM} Tell me a story.")["input_ids"]
    alone = generate(server, prompt, 96)["output_ids"]  # its prefix is now cached
    pool_before = server.plugin_state()["pool"]
    mark = server.log_size()
    model = str(ensure_engine_model())
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(generate, server, prompt, 96)
        for case in BAD_VALUES:
            overrides = case.values[0]
            custom = {"sglang_evict": overrides}
            refused = server.post_raw(
                "/generate", {"text": "Hi", "sampling_params": greedy(8, custom_params=custom)}
            )
            openai = server.post_raw(
                "/v1/completions",
                {"model": model, "prompt": "Hi", "max_tokens": 8, "custom_params": custom},
            )
            assert (refused.status_code, openai.status_code) == (400, 400), case.id
            assert "custom_params.sglang_evict" in openai.json()["message"], case.id
        assert running.result()["output_ids"] == alone
    assert server.plugin_state()["pool"] == pool_before
    rids = {e["rid"] for record in server.pass_records(mark) for e in record["requests"]}
    assert len(rids) == 1  # only the running request ever had a pass
    accepted = server.post_raw(
        "/v1/completions",
        {"model": model, "prompt": "Hi", "max_tokens": 8, "custom_params": evict(scorer="knorm")},
    )
    assert accepted.status_code == 200, accepted.text


def test_forked_branches_evict_their_own_tokens_and_leave_the_shared_prefix(
    server, tokenizer, reference_model
):
    """``s.fork(3)`` with a different policy per branch: the prefix's slots and K/V are
    the same bytes before and after, every branch generates what the CPU reference loop
    generates under the same policies, and a later request matches the prefix."""
    import sglang as sgl

    from sglang_evict.srt.frontend import EvictingEndpoint, gen

    branch_policies = [
        {"kv_budget_tokens": 40, "cadence_tokens": 8},
        {"scorer": "knorm"},
        {},
    ]
    new_tokens = 96

    @sgl.function
    def vote(s):
        s += SYSTEM
        branches = s.fork(len(branch_policies))
        for i, branch in enumerate(branches):
            branch += f" Path {i}:"
            branch += gen(
                "answer",
                max_tokens=new_tokens,
                temperature=0,
                ignore_eos=True,
                return_logprob=True,
                **branch_policies[i],
            )
        s.set_var("meta", [branch.get_meta_info("answer") for branch in branches])
        branches.join()

    prefix = tokenizer(SYSTEM)["input_ids"]
    server.post("/generate", {"text": SYSTEM, "sampling_params": {"max_new_tokens": 0}})
    before = prefix_entries(server.plugin_state()["radix_tree"], prefix)
    assert len(before) == len(prefix)  # the whole prefix is cached

    state = vote.run(backend=EvictingEndpoint(server.url))
    assert state.error() is None
    metas = state["meta"]
    assert prefix_entries(server.plugin_state()["radix_tree"], prefix) == before

    prompts = [tokenizer(f"{SYSTEM} Path {i}:")["input_ids"] for i in range(len(metas))]
    assert [meta["prompt_tokens"] for meta in metas] == [len(p) for p in prompts]
    assert all(meta["cached_tokens"] >= len(prefix) for meta in metas)  # shared
    outputs = [[entry[1] for entry in meta["output_token_logprobs"]] for meta in metas]
    expected, result = reference_outputs(
        reference_model,
        prompts,
        new_tokens,
        page_size=1,
        policy=SERVER_POLICY,
        custom_params=[evict(**fields) for fields in branch_policies],
    )
    assert outputs == expected
    for i, meta in enumerate(metas):
        report = report_of(meta)
        reference_passes = [p for rid, _, p in result.passes if rid == f"r{i}"]
        assert report["passes"] == len(reference_passes) > 0, i
        assert report["tokens_evicted"] == sum(p.tokens_evicted for p in reference_passes)

    later = tokenizer(f"{SYSTEM} Later: one more question.")["input_ids"]
    assert later[: len(prefix)] == prefix
    assert generate(server, later, 4)["meta_info"]["cached_tokens"] >= len(prefix)


@pytest.mark.parametrize(
    ("example", "args"),
    [
        ("reasoning_vote.py", ["--paths", "3", "--think-tokens", "160", "--budget", "128"]),
        ("protected_chat.py", ["--reply-tokens", "96", "--budget", "96"]),
    ],
)
def test_example_program_runs_to_completion_against_the_server(server, example, args):
    paths = [str(ROOT), str(ROOT / "kernels"), os.environ.get("PYTHONPATH", "")]
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example), "--url", server.url, *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},  # this checkout's code
    )
    assert done.returncode == 0, done.stdout + done.stderr
    print(done.stdout)  # the program's own account, shown with -s / -rP
    summary = json.loads(done.stdout.split("summary ", 1)[1])
    if example == "reasoning_vote.py":
        assert len(summary["answers"]) == 3 and summary["winner"] in summary["answers"]
        assert all(r["passes"] > 0 and r["kv_budget_tokens"] == 128 for r in summary["reports"])
    else:
        turns = summary["turns"]
        assert all(turn["eviction"]["passes"] > 0 for turn in turns)
        for earlier, later in itertools.pairwise(turns):  # each turn reuses the one before
            assert later["cached_tokens"] >= earlier["prompt_tokens"]


# --- helpers ---------------------------------------------------------------------------


def _log_since(server, mark: int) -> str:
    server.log_size()
    with open(server.log_path, "rb") as log:
        log.seek(mark)
        return log.read().decode(errors="replace")
