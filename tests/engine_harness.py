"""SGLang's real engine as the test bed: engines started once per session and shared,
the CPU reference loop over the same checkpoint, and what the tests read off SGLang.

Engines run in host processes of their own (``sglang_evict.srt.engine_runner``); each
is keyed by what must be fixed at start (page size, plugin policy or plain SGLang,
overlap scheduler, pool size) and reused by every test that needs the same key. At most
``MAX_LIVE_ENGINES`` live at once (24 GiB); the least recently used is shut down
when another is needed. Tests read SGLang's own outputs (``output_ids``, ``meta_info``)
and counters (its decode log's ``#token`` / ``#running-req``, the allocator's free count
in the plugin's pass records, ``num_retractions``); the plugin's own report is used only
for what only it knows (requests it still tracks, passes, pages it says it freed).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from sglang_evict.config import EvictionConfig
from sglang_evict.srt.engine_runner import (
    EngineProcess,
    cpu_engine_kwargs,
    parse_pass_lines,
    server_flags,
)

# Idle engines sleep on their sockets (``sleep_on_idle``): one costs memory (about
# 1.3 GB of proportional set size over its three processes, its scheduler and
# detokenizer forked: measured 2026-12-02), not CPU, so the few every file shares stay up.
MAX_LIVE_ENGINES = 6
# Before an engine starts, this worker's idle engines (oldest first) are shut until the
# machine has this much memory available (an engine and a margin): both xdist workers
# hold engines, and the demo's, the benches' and the router's start beside them.
ENGINE_ROOM_BYTES = 5 * 2**30
# One OpenMP thread per engine: the suite runs in two xdist workers on two cores, and
# engines of both (and the demo's two) generate at once; OpenMP threads spinning
# against each other's slow every engine many times over.
ENGINE_THREADS = {"OMP_NUM_THREADS": "1"}

# The policy of the engine tests: small enough that a few hundred generated tokens run
# many passes (budget 48 + cadence 16: a pass every 16 tokens once a request holds 64).
BUDGET, CADENCE, WINDOW, SINKS = 48, 16, 16, 4
# Every pass of the engine tests outlasts its lease many times over (a pass takes
# milliseconds on this CPU): no pass may lose its lease to its own duration
# (``tests/test_engine_lease.py``; ``sglang_evict.passes.lease``).
LEASE_TTL_MS = 1
# The tier of the engine tests (bits apart): groups of 16, at most 4 per request, a
# quarter of the pool; with BUDGET and CADENCE a request of 100-140 new tokens fills its
# tier and then gives groups up. ``knorm``: its per-rank scores are all-reduced under TP.
ENGINE_TIER = dict(tier_group_tokens=16, tier_max_tokens=64, tier_pool_share=0.25, scorer="knorm")


def policy_fields(**overrides) -> dict:
    fields = dict(
        kv_budget_tokens=BUDGET,
        cadence_tokens=CADENCE,
        window_tokens=WINDOW,
        sink_tokens=SINKS,
        scorer="streaming",
        compaction="hole_fill",
        lease_ttl_ms=LEASE_TTL_MS,
    )
    fields.update(overrides)
    return fields


MAX_LABEL_CHARS = 160


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is started with; equal specs share one engine."""

    page_size: int = 1
    policy_json: str | None = None  # the plugin's policy (sorted JSON); None: plain SGLang
    overlap: bool = True
    max_total_tokens: int = 4096
    engine_json: str = "{}"  # further sglang.Engine arguments (sorted JSON)
    env_json: str = "{}"  # environment of the engine's processes (sorted JSON)

    @classmethod
    def plugin(
        cls,
        page_size=1,
        *,
        overlap=True,
        max_total_tokens=4096,
        engine_args=None,
        env=None,
        **policy,
    ):
        policy_json = json.dumps(policy_fields(**policy), sort_keys=True)
        extra = json.dumps(engine_args or {}, sort_keys=True)
        env_json = json.dumps(env or {}, sort_keys=True)
        return cls(page_size, policy_json, overlap, max_total_tokens, extra, env_json)

    @classmethod
    def plain(cls, page_size=1, *, overlap=True, max_total_tokens=4096, engine_args=None):
        extra = json.dumps(engine_args or {}, sort_keys=True)
        return cls(page_size, None, overlap, max_total_tokens, extra)

    def policy(self) -> dict | None:
        return None if self.policy_json is None else json.loads(self.policy_json)

    def label(self) -> str:
        kind = "plain"
        if self.policy_json is not None:
            policy = self.policy()
            kind = f"plugin-{policy['scorer']}-{policy['compaction']}-b{policy['kv_budget_tokens']}"
        overlap = "" if self.overlap else "-no-overlap"
        settings = {**json.loads(self.engine_json), **json.loads(self.env_json)}
        model = settings.pop("model_path", None)
        # Values may hold paths and separators (``cpu_tp_env``): a file name keeps none.
        extra = "".join(re.sub(r"[^\w.-]+", "_", f"-{k}{v}") for k, v in settings.items())
        if model is not None:
            extra += f"-model-{Path(model).name}"
        label = f"{kind}-page{self.page_size}{overlap}-pool{self.max_total_tokens}{extra}"
        if len(label) > MAX_LABEL_CHARS:  # a log file's name: the rest as a digest
            digest = hashlib.sha256(label.encode()).hexdigest()[:12]
            label = f"{label[: MAX_LABEL_CHARS - 13]}-{digest}"
        return label


def engine_process_of(spec: EngineSpec, model_path, log_path) -> EngineProcess:
    """The engine ``spec`` describes, not started (``model_path`` unless the spec names
    its own)."""
    extra = json.loads(spec.engine_json)
    kwargs = cpu_engine_kwargs(
        extra.pop("model_path", model_path),
        page_size=spec.page_size,
        max_total_tokens=spec.max_total_tokens,
        disable_overlap_schedule=not spec.overlap,
        **extra,
    )
    env = {**ENGINE_THREADS, **json.loads(spec.env_json)}
    return EngineProcess(kwargs, policy=spec.policy_json, env=env, log_path=log_path)


@dataclass(frozen=True)
class ServedSpec:
    """An HTTP server started with ``sglang-evict serve`` and these flags (and
    environment); equal specs share one server."""

    eviction_flags: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    def label(self) -> str:
        return "served" + "".join(self.eviction_flags).replace("--kv", "-")


# The served engine of the HTTP tests (per-request policy, frontend programs, /metrics):
# the engine tests' policy as server defaults, requests allowed up to a budget above
# every request of the tests (the pool's 4096 tokens), a cadence up to 64, eviction off;
# the radix-tree digest on (``SGLANG_EVICT_DEBUG_TREE``), read by the fork test.
POLICY_SERVER = ServedSpec(
    eviction_flags=(
        *("--kv-budget", str(BUDGET), "--kv-cadence", str(CADENCE)),
        *("--kv-window", str(WINDOW), "--kv-sink-tokens", str(SINKS), "--kv-scorer", "streaming"),
        *("--kv-lease-ttl-ms", str(LEASE_TTL_MS)),
        *("--kv-request-max-budget", "4096", "--kv-request-max-cadence", "64"),
        "--kv-request-allow-disable",
    ),
    env=(("SGLANG_EVICT_DEBUG_TREE", "1"),),
)


@dataclass
class EngineRegistry:
    model_path: Path
    log_dir: Path
    live: dict = field(default_factory=dict)  # spec -> EngineProcess, oldest first
    start_times_s: list = field(default_factory=list)  # (spec label, seconds)
    # (test, what, value): figures the engine tests saw, printed at the session's end.
    figures: list = field(default_factory=list)

    def report(self, test: str, what: str, value) -> None:
        self.figures.append((test, what, value))

    def _reuse(self, spec):
        engine = self.live.pop(spec, None)
        if engine is not None and engine.alive:
            self.live[spec] = engine  # most recently used last
            return engine
        while self.live and (
            len(self.live) >= MAX_LIVE_ENGINES
            or psutil.virtual_memory().available < ENGINE_ROOM_BYTES
        ):
            oldest = next(iter(self.live))
            self.live.pop(oldest).close()
        return None

    def served(self, spec: ServedSpec) -> ServedEngine:
        """The HTTP server of ``spec``, started on first use (``sglang-evict serve``)."""
        engine = self._reuse(spec)
        if engine is not None:
            return engine
        log = self.log_dir / f"{spec.label()}-{time.monotonic_ns()}.log"
        engine = ServedEngine(
            self.model_path, log, list(spec.eviction_flags), env=dict(spec.env)
        ).start()
        self.start_times_s.append((spec.label(), round(engine.start_s, 1)))
        self.live[spec] = engine
        return engine

    def get(self, spec: EngineSpec) -> EngineProcess:
        engine = self._reuse(spec)
        if engine is not None:
            return engine
        log_path = self.log_dir / f"{spec.label()}-{time.monotonic_ns()}.log"
        engine = engine_process_of(spec, self.model_path, log_path).start()
        self.start_times_s.append((spec.label(), round(engine.start_s, 1)))
        self.live[spec] = engine
        return engine

    def close_all(self) -> None:
        while self.live:
            _, engine = self.live.popitem()
            engine.close()


# --- the CPU reference loop over the same checkpoint ---------------------------------------


def load_reference_model(model_path: Path):
    """``PagedLlama`` over the engine's checkpoint, float32 like the engine."""
    from transformers import AutoModelForCausalLM

    from sglang_evict.models.reference_model import PagedLlama

    hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    return PagedLlama(hf)


def reference_outputs(
    model, prompts, new_tokens, *, page_size, policy: dict | None, custom_params=None
):
    """Greedy outputs of the CPU reference loop (SGLang's memory classes + the plugin)
    for ``prompts`` run as one batch, and the survivor sets each decode step attended;
    ``custom_params``: one per prompt (per-request policies)."""
    from sglang_evict.models.reference_loop import GenerationRequest, generate
    from sglang_evict.srt.cpu_driver import MemoryDriver

    config = None
    if policy is not None:
        config = EvictionConfig(**policy, page_size=page_size)
    driver = MemoryDriver.for_model(
        model,
        page_size=page_size,
        num_tokens=len(prompts) * (max(map(len, prompts)) + new_tokens + 2 * page_size) + 64,
        config=config,
        max_context=max(map(len, prompts)) + new_tokens + 8,
    )
    custom_params = custom_params or [None] * len(prompts)
    requests = [
        GenerationRequest(f"r{i}", p, new_tokens, custom_params=c)
        for i, (p, c) in enumerate(zip(prompts, custom_params, strict=True))
    ]
    result = generate(driver, model, requests)
    return [result.outputs[f"r{i}"] for i in range(len(prompts))], result


def masked_replay(model, prompts, new_tokens, *, page_size, attended):
    """The same requests on a full cache, each step attending only to ``attended``."""
    from sglang_evict.models.reference_loop import GenerationRequest, generate
    from sglang_evict.srt.cpu_driver import MemoryDriver

    driver = MemoryDriver.for_model(
        model,
        page_size=page_size,
        num_tokens=len(prompts) * (max(map(len, prompts)) + new_tokens + 2 * page_size) + 64,
        max_context=max(map(len, prompts)) + new_tokens + 8,
    )
    requests = [GenerationRequest(f"r{i}", p, new_tokens) for i, p in enumerate(prompts)]
    result = generate(driver, model, requests, attend_masks=attended)
    return [result.outputs[f"r{i}"] for i in range(len(prompts))]


SYSTEM_PROMPT = "You are a helpful assistant. Answer the question step by step."
QUESTIONS = (
    "Question: what is the capital of France?",
    "Question: how many pages does a request hold after a pass?",
    "Tell me a story about a server with a small cache.",
)


def shared_system_prompts(engine_model) -> list[list[int]]:
    """Three prompts sharing a system prompt (the radix cache's case), token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(engine_model))
    return [tokenizer(f"{SYSTEM_PROMPT} {q}")["input_ids"] for q in QUESTIONS]


def assert_same_tokens(engine_ids, expected, who: str = "engine") -> None:
    """Every prompt's tokens equal the reference's (and so does their count); a failure
    names the first token that differs."""
    for i, (got, want) in enumerate(zip(engine_ids, expected, strict=True)):
        first = next((t for t, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        assert got == want, f"prompt {i}: {who} and reference differ from token {first}"


def greedy(new_tokens: int, **extra) -> dict:
    return {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True, **extra}


def assert_clean_after(engine, mark) -> None:
    """SGLang's idle check ran after the request ended (and passed), and the plugin
    released every request's state."""
    before = engine.plugin_state()["idle_checks"]
    state = wait_until(
        lambda: (s := engine.plugin_state())["idle_checks"] > before and s, timeout_s=60
    )
    assert state, "the scheduler never became idle"
    assert state["tracked_requests"] == 0
    log = engine.log_since(mark)
    assert "memory leak detected" not in log and "Traceback" not in log
    assert engine.alive


def wait_until(predicate, timeout_s: float = 30.0, interval_s: float = 0.2):
    """Poll ``predicate`` until it returns a truthy value (returned) or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def engine_log_dir(tmp_path_factory) -> Path:
    """Where engine logs go: kept after the run in CI (``SGLANG_EVICT_ENGINE_LOGS``)."""
    configured = os.environ.get("SGLANG_EVICT_ENGINE_LOGS")
    if configured:
        path = Path(configured)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("engine-logs")


# --- the HTTP server, started the way a user starts it --------------------------------------


class ServedEngine:
    """``sglang-evict serve ...`` (which execs SGLang's HTTP server) on CPU, its output in
    a log file; requests go through HTTP like a client's."""

    def __init__(
        self,
        model_path: Path,
        log_path: Path,
        eviction_flags: list[str],
        env: dict | None = None,
        engine_overrides: dict | None = None,
    ) -> None:
        self.extra_env = dict(env or {})
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.command = [
            "sglang-evict",
            "serve",
            *eviction_flags,
            *server_flags(cpu_engine_kwargs(model_path, **(engine_overrides or {}))),
            "--enable-metrics",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.process = None

    def start(self, timeout_s: float = 600) -> ServedEngine:
        import subprocess

        env = {**os.environ, "SGLANG_EVICT_LOG_PASSES": "1", **ENGINE_THREADS, **self.extra_env}
        self._log = open(self.log_path, "ab")  # closed in stop()
        started = time.monotonic()
        self.process = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        ready = wait_until(self._healthy, timeout_s=timeout_s, interval_s=1.0)
        if not ready:
            self.stop()
            tail = self.log_path.read_text(errors="replace").splitlines()[-30:]
            raise RuntimeError("sglang-evict serve did not become healthy:\n" + "\n".join(tail))
        self.start_s = time.monotonic() - started
        return self

    def _healthy(self) -> bool:
        if self.process.poll() is not None:
            return True  # exited: reported by start()
        try:
            return self.get("/health", timeout_s=5).status_code == 200
        except OSError:
            return False

    def get(self, path: str, timeout_s: float = 60):
        import requests

        return requests.get(self.url + path, timeout=timeout_s)

    def post(self, path: str, body: dict, timeout_s: float = 600):
        response = self.post_raw(path, body, timeout_s)
        response.raise_for_status()
        return response.json()

    def post_raw(self, path: str, body: dict, timeout_s: float = 600):
        """The HTTP response, whatever its status."""
        import requests

        return requests.post(self.url + path, json=body, timeout=timeout_s)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def close(self) -> None:
        self.stop()

    def plugin_state(self) -> dict:
        """What the plugin reports in ``/get_server_info`` (``internal_states[0]``)."""
        return self.get("/get_server_info").json()["internal_states"][0]["sglang_evict"]

    def mark(self) -> int:
        """A position in the log (``assert_clean_after`` reads what came after)."""
        return self.log_size()

    def log_since(self, mark: int = 0) -> str:
        self.get("/get_server_info")
        with open(self.log_path, "rb") as log:
            log.seek(mark)
            return log.read().decode(errors="replace")

    def log_size(self) -> int:
        """A position in the log (after a ``/get_server_info`` round trip: every batch
        the scheduler finished is logged by then)."""
        self.get("/get_server_info")
        return self.log_path.stat().st_size

    def pass_records(self, since: int = 0) -> list[dict]:
        self.get("/get_server_info")
        with open(self.log_path, "rb") as log:
            log.seek(since)
            return parse_pass_lines(log.read().decode(errors="replace"))

    def stop(self) -> None:
        stop_process_group(self.process, grace_s=60)
        self._log.close()


def stop_process_group(process, grace_s: float) -> None:
    """SIGTERM to ``process``'s group (a server with its children), SIGKILL after
    ``grace_s``; nothing when it has already exited (or never started)."""
    import signal
    import subprocess

    if process is not None and process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def prometheus_samples(text: str, prefix: str = "sglang_evict:") -> dict[str, float]:
    """``{name{labels}: value}`` of the samples whose name starts with ``prefix``."""
    samples = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def assert_radix_hits_in_whole_pages(engine, prompts, page_size: int, new_tokens: int) -> None:
    """After a flush, requests after the first match its prompt's shared prefix, in
    whole pages (SGLang's radix cache at ``page_size``), with eviction on."""
    assert engine.flush_cache()
    first = engine.generate(prompts[0], greedy(new_tokens))
    rest = engine.generate(prompts[1:], greedy(new_tokens))
    cached = [o["meta_info"]["cached_tokens"] for o in [first, *rest]]

    def shared(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))

    expected = [0] + [shared(prompts[0], p) // page_size * page_size for p in prompts[1:]]
    assert cached == expected and max(expected) > 0


def assert_abort_and_retraction_leave_it_clean(
    engine, tokenizer, *, after_chunks: int, requests: int, new_tokens: int
) -> None:
    """An abort mid-generation, then ``requests`` requests of ``new_tokens`` in a pool
    too small for them (SGLang retracts at least one); every request ends, and the
    plugin holds nothing when idle."""
    mark = engine.mark()
    prompt = tokenizer("Tell me a story about a server with a small cache.")["input_ids"]
    out = engine.generate_then_abort(prompt, greedy(2000), after_chunks=after_chunks)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    prompts = [tokenizer(f"Request {i}: tell me a story.")["input_ids"] for i in range(requests)]
    sampling = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "temperature": 0}
    outputs = engine.generate(prompts, sampling)
    assert all(len(o["output_ids"]) == new_tokens for o in outputs)
    assert sum(o["meta_info"]["num_retractions"] for o in outputs) >= 1
    assert_clean_after(engine, mark)
