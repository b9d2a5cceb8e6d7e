"""Frontend programs (``sglang.lang``, the installed interpreter) send each gen's
eviction overrides as ``custom_params["sglang_evict"]``: checked here against a local
HTTP server that records what the program posts (the served engine runs the same
programs in ``tests/test_engine_policy.py``)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
import sglang as sgl

from sglang_evict.srt.frontend import EvictingEndpoint, gen


class _Recorder(BaseHTTPRequestHandler):
    posted: ClassVar[list[dict]] = []

    def log_message(self, *args) -> None:  # quiet
        pass

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._reply({"model_path": "recorder"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.posted.append(body)
        self._reply({"text": " ok", "meta_info": {"prompt_tokens": 1}})


@pytest.fixture
def recorder():
    _Recorder.posted = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Recorder.posted
    server.shutdown()
    server.server_close()


def _policy_of(body: dict):
    return (body["sampling_params"].get("custom_params") or {}).get("sglang_evict")


def test_each_gen_sends_its_own_overrides_over_the_endpoints_defaults(recorder):
    url, posted = recorder

    @sgl.function
    def program(s):
        s += "Question:"
        s += gen("think", max_tokens=8, kv_budget_tokens=64, scorer="knorm")
        s += gen("plain", max_tokens=4)
        s += gen("whole", max_tokens=4, enabled=False, stop_token_ids=[7])

    endpoint = EvictingEndpoint(url, kv_policy={"cadence_tokens": 8})
    state = program.run(backend=endpoint, stop_token_ids=[3])
    assert state.error() is None
    generated = [body for body in posted if body["sampling_params"]["max_new_tokens"] > 0]
    assert [_policy_of(body) for body in generated] == [
        {"cadence_tokens": 8, "kv_budget_tokens": 64, "scorer": "knorm"},
        {"cadence_tokens": 8},
        {"cadence_tokens": 8, "enabled": False},
    ]
    # The program's own stop ids where a gen set none; a gen's own where it did.
    assert [body["sampling_params"]["stop_token_ids"] for body in generated] == [[3], [3], [7]]


def test_fork_branches_carry_their_own_policies_concurrently(recorder):
    url, posted = recorder

    @sgl.function
    def vote(s):
        s += "Shared prefix."
        forks = s.fork(3)
        for i, branch in enumerate(forks):
            branch += f" Path {i}:"
            branch += gen("answer", max_tokens=4, kv_budget_tokens=40 + i)
        forks.join()

    state = vote.run(backend=EvictingEndpoint(url))
    assert state.error() is None
    by_text = {
        body["text"]: _policy_of(body)
        for body in posted
        if body["sampling_params"]["max_new_tokens"] > 0
    }
    assert by_text == {f"Shared prefix. Path {i}:": {"kv_budget_tokens": 40 + i} for i in range(3)}


def test_plain_endpoint_programs_send_no_custom_params(recorder):
    url, posted = recorder

    @sgl.function
    def program(s):
        s += "Hi"
        s += sgl.gen("a", max_tokens=4)

    assert program.run(backend=EvictingEndpoint(url)).error() is None
    assert all("custom_params" not in body["sampling_params"] for body in posted)


def test_endpoint_refuses_an_unknown_policy_field(recorder):
    url, _ = recorder
    with pytest.raises(ValueError, match=r"kv_policy has no field\(s\) \['budget'\]"):
        EvictingEndpoint(url, kv_policy={"budget": 64})
