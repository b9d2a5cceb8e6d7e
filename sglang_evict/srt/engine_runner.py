"""SGLang's real engine (``sglang.Engine``) in a child process of its own, and what it
logs: the test bed of the engine tests and the engine of ``sglang-evict demo``.

Why a child process: ``Engine.shutdown()`` kills every child process of the process that
created the engine (``kill_process_tree(os.getpid(), include_parent=False)``), which in a
test session would take a redis-server, a compactor or a second engine with it. Here
each engine lives in its own host process (``python -m sglang_evict.srt.engine_runner``);
the parent talks to it over a local socket and reads its log (SGLang's scheduler writes
``Decode batch, #running-req: N, #token: T, ...`` every ``decode_log_interval`` steps,
set to 1 here, so the KV it holds is read off SGLang's own accounting at every step).

    with EngineProcess(engine_kwargs, policy=config, log_path=path) as engine:
        outputs = engine.generate([[1, 5, 6]], {"max_new_tokens": 64, "temperature": 0})
        for step in engine.decode_steps():
            ...  # DecodeStep(running_requests, tokens_held)

On a machine without a GPU use ``cpu_engine_kwargs`` (docs/development.md, "SGLang's
real engine on CPU").
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener
from pathlib import Path

from sglang_evict.srt.server_args import BACKEND_NAME, CONFIG_ENV

DECODE_LINE = re.compile(
    r"Decode batch[^#]*#running-req: (\d+), #token: (\d+)(?:[^\n]*?#queue-req: (\d+))?"
)
PASS_LINE_PREFIX = "sglang-evict pass "
REQUEST_LINE_PREFIX = "sglang-evict request "  # introspection.REQUEST_LINE_PREFIX
_AUTHKEY_ENV = "SGLANG_EVICT_ENGINE_RUNNER_KEY"
START_TIMEOUT_S = 600.0
# SGLang picks its torch.distributed port free, then binds it in another process: an
# engine starting beside another (parallel tests, side-by-side benches) can lose that
# race and die with this in its log. Such a start is relaunched once, on new ports.
PORT_CLASH = "EADDRINUSE"


def cpu_engine_kwargs(model_path: str | os.PathLike, **overrides) -> dict:
    """``sglang.Engine`` arguments that start SGLang 0.5.17's engine on a CPU-only
    machine (why each is needed: docs/development.md, "SGLang's real engine on CPU"; CUDA graphs
    are off because SGLang turns them off for ``torch_native``)."""
    kwargs = dict(
        model_path=str(model_path),
        device="cpu",
        model_impl="transformers",  # SGLang's native Llama needs vllm's CPU ops
        attention_backend="torch_native",  # the CPU default (intel_amx) needs AMX
        dtype="float32",
        max_total_tokens=4096,
        sampling_backend="pytorch",
        grammar_backend="none",
        random_seed=0,
        decode_log_interval=1,
        log_level="info",
        # An idle scheduler blocks on its sockets instead of polling them: on a 2-core
        # machine a spinning idle engine takes a core from the one generating.
        sleep_on_idle=True,
    )
    kwargs.update(overrides)
    return kwargs


# SGLang on CPU builds its tensor-parallel groups with PyNccl whenever an NCCL library
# loads (torch's CUDA wheels bring one) and then asks for a CUDA device; pointing
# SGLANG_NCCL_SO_PATH at no library makes it fall back to gloo, as on a machine without
# NCCL. Checked on SGLang 0.5.17 and 0.5.23.
NO_NCCL_LIBRARY = "/nonexistent/libnccl.so.2"


def cpu_tp_env(tp_size: int, cores: list[int] | None = None) -> dict[str, str]:
    """Environment for ``tp_size`` ranks of SGLang's engine on CPU (``tp_size`` in
    ``cpu_engine_kwargs``): gloo instead of NCCL, and the cores each rank may use
    (SGLang asks for them when there are more ranks than NUMA nodes), split evenly over
    the cores this process may run on (ranks share a core when there are fewer)."""
    if tp_size < 2:
        return {}
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(cores) >= tp_size:
        per_rank = len(cores) // tp_size
        shares = [cores[r * per_rank : (r + 1) * per_rank] for r in range(tp_size)]
    else:
        shares = [[cores[r % len(cores)]] for r in range(tp_size)]
    bind = "|".join(_core_list(share) for share in shares)
    return {"SGLANG_NCCL_SO_PATH": NO_NCCL_LIBRARY, "SGLANG_CPU_OMP_THREADS_BIND": bind}


def _core_list(cores: list[int]) -> str:
    """SGLang's spelling of a rank's cores: ``3``, ``0-15``, or ``0,2,5``."""
    if len(cores) > 1 and cores[-1] - cores[0] == len(cores) - 1:
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def server_flags(engine_kwargs: dict) -> list[str]:
    """The ``sglang.launch_server`` flags equivalent to ``sglang.Engine`` arguments."""
    flags = []
    for key, value in engine_kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


@dataclass(frozen=True)
class DecodeStep:
    """One ``Decode batch`` log line of SGLang's scheduler."""

    running_requests: int
    tokens_held: int  # KV tokens in use: running requests' slots + locked radix nodes
    queued_requests: int = 0  # waiting for admission (#queue-req)


def parse_decode_steps(log: str) -> list[DecodeStep]:
    return [DecodeStep(int(n), int(t), int(q or 0)) for n, t, q in DECODE_LINE.findall(log)]


def parse_pass_lines(log: str, prefix: str = PASS_LINE_PREFIX) -> list[dict]:
    """The plugin's per-pass log records (``SGLANG_EVICT_LOG_PASSES=1``), as dicts;
    ``prefix=REQUEST_LINE_PREFIX``: its per-request records."""
    records = []
    for line in log.splitlines():
        at = line.find(prefix)
        if at >= 0:
            records.append(json.loads(line[at + len(prefix) :]))
    return records


class EngineError(RuntimeError):
    """The engine process failed to start or died; the message ends with its log's tail."""


class EngineProcess:
    """One ``sglang.Engine`` in a host process; ``policy`` None starts plain SGLang."""

    def __init__(
        self,
        engine_kwargs: dict,
        *,
        policy=None,  # EvictionConfig, a dict of its fields, their JSON, or None
        log_path: str | os.PathLike | None = None,
        env: dict | None = None,
    ) -> None:
        self.engine_kwargs = dict(engine_kwargs)
        if policy is not None:
            self.engine_kwargs["radix_cache_backend"] = BACKEND_NAME
        self.policy_json = None if policy is None else _policy_json(policy)
        if log_path is None:
            log_path = tempfile.mkstemp(prefix="sglang-engine-", suffix=".log")[1]
        self.log_path = Path(log_path)
        self.extra_env = dict(env or {})
        self.process: subprocess.Popen | None = None
        self.connection = None
        self.start_s: float | None = None

    # --- lifecycle -----------------------------------------------------------------

    def start(self) -> EngineProcess:
        self.launch()
        return self.wait_ready()

    def environment(self, base) -> dict[str, str]:
        """The engine process's environment over ``base``: the extra variables, and the
        policy in ``CONFIG_ENV`` (none inherited from ``base``)."""
        env = {**base, **self.extra_env}
        env.pop(CONFIG_ENV, None)
        if self.policy_json is not None:
            env[CONFIG_ENV] = self.policy_json
        env.setdefault("SGLANG_EVICT_LOG_PASSES", "1")
        return env

    def launch(self) -> None:
        """Start the host process without waiting (``wait_ready`` waits): two engines
        launched before either is waited for start side by side."""
        directory = tempfile.mkdtemp(prefix="sglang-engine-")
        self._socket_path = os.path.join(directory, "engine.sock")
        self._authkey = secrets.token_bytes(16)
        self._listener = Listener(self._socket_path, family="AF_UNIX", authkey=self._authkey)
        env = {**self.environment(os.environ), _AUTHKEY_ENV: self._authkey.hex()}
        self._log_file = open(self.log_path, "ab")  # closed in close()
        self._launched_at = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sglang_evict.srt.engine_runner", self._socket_path],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        self._payload = json.dumps(self.engine_kwargs)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> EngineProcess:
        """Wait for the launched engine; a start that lost a port race is relaunched
        once (``PORT_CLASH``)."""
        try:
            return self._wait_ready_once(timeout_s)
        except EngineError as error:
            if PORT_CLASH not in str(error):
                raise
        self.launch()
        self._log_file.write(b"sglang-evict: engine start retried after a port clash\n")
        self._log_file.flush()
        return self._wait_ready_once(timeout_s)

    def _wait_ready_once(self, timeout_s: float) -> EngineProcess:
        self._listener._listener._socket.settimeout(timeout_s)
        try:
            self.connection = self._listener.accept()
        except OSError as error:  # TimeoutError included
            self.close()
            raise EngineError(f"engine host did not connect ({error}){self._tail()}") from None
        self.connection.send(self._payload)
        if not self.connection.poll(timeout_s):
            self.close()
            raise EngineError(f"engine did not start within {timeout_s:.0f} s{self._tail()}")
        try:
            reply = self._receive()
        except (OSError, EOFError) as error:  # the host process died while starting
            tail = self._tail()
            self.close()
            raise EngineError(f"engine process died while starting ({error}){tail}") from None
        if reply.get("error"):
            self.close()
            raise EngineError(f"engine failed to start: {reply['error']}{self._tail()}")
        self.start_s = time.monotonic() - self._launched_at
        return self

    def close(self) -> None:
        """Shut the engine down (its own ``shutdown``), then the host process."""
        if self.connection is not None:
            try:
                self.connection.send({"op": "shutdown"})
                self.connection.poll(120)
            except (OSError, EOFError):
                pass
            self.connection.close()
            self.connection = None
        if self.process is not None and self.process.poll() is None:
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait(timeout=30)
        if getattr(self, "_listener", None) is not None:
            self._listener.close()
            self._listener = None
        if getattr(self, "_log_file", None) is not None:
            self._log_file.close()
            self._log_file = None

    def kill(self) -> None:
        """Stop the engine at once (its whole process group), without its shutdown: for
        an interrupted caller whose requests may still be running on it."""
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, 9)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=30)
        if self.connection is not None:
            self.connection.close()
            self.connection = None
        self.close()

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # --- requests --------------------------------------------------------------------

    def generate(self, input_ids, sampling_params, **kwargs) -> list[dict]:
        """``Engine.generate`` over a batch of token-id prompts; one dict per prompt with
        ``output_ids`` and ``meta_info`` (SGLang's own)."""
        single = bool(input_ids) and isinstance(input_ids[0], int)
        reply = self.call(
            "generate",
            input_ids=[input_ids] if single else input_ids,
            sampling_params=sampling_params,
            **kwargs,
        )
        return reply[0] if single else reply

    def generate_then_abort(
        self, input_ids: list[int], sampling_params: dict, *, after_chunks: int
    ) -> dict:
        """Stream one request and abort it (``abort_request``) after ``after_chunks``
        streamed chunks; returns the final output dict."""
        return self.call(
            "generate_then_abort",
            input_ids=input_ids,
            sampling_params=sampling_params,
            after_chunks=after_chunks,
        )

    def flush_cache(self) -> bool:
        """SGLang's ``flush_cache``: empties the radix cache (only when idle)."""
        return self.call("flush_cache")

    def server_info(self) -> dict:
        return self.call("server_info")

    def plugin_state(self) -> dict | None:
        """What the plugin reports in SGLang's ``get_server_info`` internal states."""
        states = self.server_info().get("internal_states") or [{}]
        return states[0].get("sglang_evict")

    def call(self, op: str, **kwargs):
        if self.connection is None:
            raise EngineError("engine is not running")
        try:
            self.connection.send({"op": op, **kwargs})
            reply = self._receive()
        except (OSError, EOFError) as error:
            raise EngineError(
                f"engine process died during {op!r} ({error}){self._tail()}"
            ) from None
        if "error" in reply:
            raise EngineError(f"{op} failed in the engine: {reply['error']}")
        return reply["result"]

    def _receive(self) -> dict:
        while not self.connection.poll(1.0):
            if not self.alive:
                raise EOFError(f"exit status {self.process.returncode}")
        return self.connection.recv()

    # --- the log -----------------------------------------------------------------------

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def mark(self) -> int:
        """A position in the log; ``decode_steps(since=mark)`` reads what came after.
        A ``server_info`` round trip first: the scheduler handles it after logging every
        batch it has finished, so nothing already generated is still unwritten."""
        self.server_info()
        return self.log_path.stat().st_size

    def log_since(self, mark: int = 0) -> str:
        self.server_info()
        with open(self.log_path, "rb") as log:
            log.seek(mark)
            return log.read().decode(errors="replace")

    def decode_steps(self, since: int = 0) -> list[DecodeStep]:
        return parse_decode_steps(self.log_since(since))

    def pass_records(self, since: int = 0) -> list[dict]:
        return parse_pass_lines(self.log_since(since))

    def _tail(self, num_lines: int = 40) -> str:
        try:
            lines = self.log_text().splitlines()[-num_lines:]
        except OSError:
            return ""
        return "\n--- engine log (last lines) ---\n" + "\n".join(lines)


def _policy_json(policy) -> str:
    """The policy as the engine's environment carries it: an ``EvictionConfig``, a dict
    of its fields or their JSON."""
    if isinstance(policy, str):
        return policy
    if isinstance(policy, dict):
        return json.dumps(policy, sort_keys=True)
    return policy.to_json()


# --- the host process ---------------------------------------------------------------------


def _host_main(socket_path: str) -> int:
    authkey = bytes.fromhex(os.environ.pop(_AUTHKEY_ENV))
    connection = Client(socket_path, family="AF_UNIX", authkey=authkey)
    engine_kwargs = json.loads(connection.recv())
    try:
        import sglang

        engine = sglang.Engine(**engine_kwargs)
    except BaseException as error:  # reported to the parent, then exit
        connection.send({"error": f"{type(error).__name__}: {error}"})
        return 1
    connection.send({"result": "ready"})
    try:
        while True:
            try:
                request = connection.recv()
            except EOFError:
                break
            op = request.pop("op")
            if op == "shutdown":
                break
            try:
                result = _HANDLERS[op](engine, **request)
            except Exception as error:  # the request failed; the engine serves on
                connection.send({"error": f"{type(error).__name__}: {error}"})
            else:
                connection.send({"result": result})
    finally:
        engine.shutdown()
        try:
            connection.send({"result": "stopped"})
        except OSError:
            pass
    return 0


def _generate(engine, *, input_ids, sampling_params, **kwargs):
    outputs = engine.generate(input_ids=input_ids, sampling_params=sampling_params, **kwargs)
    return outputs if isinstance(outputs, list) else [outputs]


def _generate_then_abort(engine, *, input_ids, sampling_params, after_chunks):
    import uuid

    rid = uuid.uuid4().hex
    last = None
    for index, chunk in enumerate(
        engine.generate(input_ids=input_ids, sampling_params=sampling_params, stream=True, rid=rid)
    ):
        last = chunk
        if index + 1 == after_chunks:
            engine.tokenizer_manager.abort_request(rid=rid)
    return last


def _server_info(engine):
    return engine.get_server_info()


def _flush_cache(engine):
    return bool(getattr(engine.flush_cache(), "success", True))


_HANDLERS = {
    "generate": _generate,
    "generate_then_abort": _generate_then_abort,
    "server_info": _server_info,
    "flush_cache": _flush_cache,
}


if __name__ == "__main__":
    sys.exit(_host_main(sys.argv[1]))
