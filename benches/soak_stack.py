"""What the soak starts and watches (``benches/soak.py``): Redis, the supervised
sidecar, the replicas and the router; ``/metrics``, RSS, SGLang's idle check; faults;
the replay of greedy requests."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from soak_load import Phase, Settings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the test harness's server, router, sidecar, Redis


# --- the servers ---------------------------------------------------------------------------


class Stack:
    """What the soak starts: Redis and the supervised sidecar (``--faults``), the
    replicas, the router (``--replicas 2``); ``close`` stops each by its PID."""

    def __init__(self, s: Settings, workdir: Path) -> None:
        self.s, self.workdir = s, workdir
        self.redis = self.sidecar = self.router = self.short_dir = None
        self.replicas: list = []

    def start(self) -> str:
        from tests.engine_harness import ServedEngine

        s = self.s
        model = self._model_path()
        flags = [
            *("--kv-budget", str(s.budget_tokens), "--kv-cadence", str(s.cadence_tokens)),
            *("--kv-window", str(s.window_tokens), "--kv-sink-tokens", "4"),
        ]
        if s.tier_bits is not None:
            flags += [
                *("--kv-tier-bits", str(s.tier_bits)),
                *("--kv-tier-group", str(s.tier_group_tokens)),
                *("--kv-tier-tokens", str(s.tier_tokens)),
            ]
        env = {}
        if s.faults:
            from compactor_service.secrets import REDIS_URL_ENV
            from tests.compactor_process import CompactorProcess
            from tests.redis_server import RedisServer

            self.redis = (
                RedisServer(self.workdir / "redis").start()
                if _mkdir(self.workdir / "redis")
                else None
            )
            # The sidecar compacts (and, with the tier, demotes) under SIGKILLs.
            pools = self.workdir / "pools"
            # A Unix socket's path holds at most 107 bytes: the sidecar's folder is short.
            self.short_dir = Path(tempfile.mkdtemp(prefix="soak-"))
            self.sidecar = CompactorProcess(
                self.short_dir, "--supervise", pool_dir=str(pools)
            ).start()
            flags += [
                "--kv-compactor",
                "grpc",
                "--kv-compactor-socket",
                str(self.sidecar.socket),
                "--kv-compactor-pool-dir",
                str(pools),
            ]
            flags += ["--kv-lease-store", "redis"]
            env[REDIS_URL_ENV] = self.redis.url
        pool_tokens = s.pool_tokens
        if s.tier_bits is not None:
            # The tier's arena is carved from the pool SGLang sizes: a larger pool leaves
            # the full-precision part (and the longest prompt SGLang accepts) as without.
            from sglang_evict.config import EvictionConfig

            share = EvictionConfig.__dataclass_fields__["tier_pool_share"].default
            pool_tokens = round(s.pool_tokens / (1 - share))
        engine = {"max_total_tokens": pool_tokens, "page_size": s.page_size}
        if s.model == "tiny":  # the project's tiny model has no chat template of its own
            engine["chat_template"] = "chatml"
        for i in range(s.replicas):
            replica = ServedEngine(
                model, self.workdir / f"replica-{i}.log", flags, env=env, engine_overrides=engine
            )
            self.replicas.append(replica.start())
        if s.replicas == 1:
            return self.replicas[0].url
        from tests.router_harness import RouterProcess

        urls = [r.url for r in self.replicas]
        self.router = RouterProcess(urls, self.workdir / "router.log").start()
        return self.router.url

    def _model_path(self) -> Path:
        if self.s.model == "smollm2":
            from sglang_evict.models.real_model import ensure_real_model

            return ensure_real_model()
        from sglang_evict.models.engine_model import ensure_engine_model

        # The tier's kernels take head dims 64 and 128: the tiny model's variant with 64.
        return ensure_engine_model(variant="base" if self.s.tier_bits is None else "head_dim64")

    def rss_bytes(self) -> int:
        import psutil

        total = 0
        for replica in self.replicas:
            if not replica.alive:
                continue
            try:
                root = psutil.Process(replica.process.pid)
                total += sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
            except psutil.Error:
                pass
        return total

    def kill_sidecar_server(self) -> str:
        """SIGKILL the sidecar's server (its supervisor restarts it)."""
        import psutil

        children = psutil.Process(self.sidecar.process.pid).children(recursive=True)
        for child in children:
            child.send_signal(signal.SIGKILL)
        return f"SIGKILL compactor server {[c.pid for c in children]}"

    def restart_redis(self) -> str:
        self.redis.stop()
        time.sleep(1.0)
        self.redis.start()
        return f"restarted redis on port {self.redis.port}"

    def close(self) -> None:
        for part in (self.router, *self.replicas, self.sidecar, self.redis):
            if part is not None:
                try:
                    part.stop()
                except Exception as error:  # keep stopping the others
                    print(f"soak: stopping {type(part).__name__}: {error}", file=sys.stderr)
        if self.short_dir is not None:  # the sidecar's log goes with the others first
            for log in self.short_dir.glob("compactor.*"):
                shutil.copy(log, self.workdir / log.name)
            shutil.rmtree(self.short_dir, ignore_errors=True)


def _mkdir(path: Path) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return True


# --- what is watched -------------------------------------------------------------------------


def metric_samples(url: str) -> dict[str, float]:
    """``/metrics``'s ``sglang_evict:`` and ``sglang:`` samples (``{name{labels}: v}``)."""
    import requests

    samples = {}
    text = requests.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(("sglang_evict:", "sglang:")):
            name, _, value = line.rpartition(" ")
            try:
                samples[name] = float(value)
            except ValueError:
                continue
    return samples


def metric_sum(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def failures_by_cause(samples: dict[str, float]) -> dict[str, float]:
    out = {}
    for key, value in samples.items():
        if key.startswith("sglang_evict:pass_failures_total{") and value:
            cause = key.split('cause="', 1)[1].split('"', 1)[0] if 'cause="' in key else key
            out[cause] = out.get(cause, 0) + value
    return out


class Monitor:
    """A sample every ``interval_s`` seconds: running requests, KV tokens held, RSS,
    passes (summed over the replicas still alive)."""

    def __init__(self, stack: Stack, interval_s: float = 2.0) -> None:
        self.stack, self.interval_s = stack, interval_s
        self.series: list[dict] = []
        self.t0 = time.monotonic()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                self.series.append(await asyncio.to_thread(self.sample))
            except Exception as error:  # a replica down mid-sample: the next sample
                self.series.append({"t_s": self.elapsed(), "error": str(error)[:200]})
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass

    def elapsed(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def sample(self) -> dict:
        running = held = passes = 0.0
        for replica in self.stack.replicas:
            if not replica.alive:
                continue
            samples = metric_samples(replica.url)
            running += metric_sum(samples, "sglang:num_running_reqs")
            held += metric_sum(samples, "sglang:num_used_tokens")
            passes += metric_sum(samples, "sglang_evict:passes_total")
        return {
            "t_s": self.elapsed(),
            "running": running,
            "kv_tokens": held,
            "rss_mib": round(self.stack.rss_bytes() / 2**20, 1),
            "passes": passes,
        }


def idle_check(stack: Stack, marks: dict, timeout_s: float = 120.0) -> dict:
    """Every live replica idle: SGLang's idle memory check ran after the phase (and
    passed: no leak in its log, no traceback), the plugin tracks no request."""
    from tests.engine_harness import wait_until

    report = {"rss_mib": round(stack.rss_bytes() / 2**20, 1), "replicas": []}
    for i, replica in enumerate(stack.replicas):
        if not replica.alive:
            report["replicas"].append({"replica": i, "alive": False})
            continue
        before = marks.get(i, {}).get("idle_checks", -1)
        state = (
            wait_until(
                lambda r=replica, b=before: (
                    (st := r.plugin_state())["idle_checks"] > b
                    and st["tracked_requests"] == 0
                    and _tier_tokens_held(st) == 0
                    and st
                ),
                timeout_s=timeout_s,
                interval_s=1.0,
            )
            or replica.plugin_state()
        )
        log = replica.log_since(marks.get(i, {}).get("log", 0))
        report["replicas"].append(
            {
                "replica": i,
                "alive": True,
                "idle_checks": state["idle_checks"],
                "tracked_requests": state["tracked_requests"],
                "tier_tokens_held": _tier_tokens_held(state),
                "idle_check_ran": state["idle_checks"] > before,
                "leak_in_log": "memory leak" in log.lower(),
                "traceback_in_log": "Traceback" in log,
            }
        )
        marks[i] = {"idle_checks": state["idle_checks"], "log": replica.log_size()}
    return report


def _tier_tokens_held(state: dict) -> int:
    """Tokens the replica's quantized tier holds (0 without a tier)."""
    tier = state.get("tier")
    return int(tier["tokens_held"]) if tier else 0


async def faults(
    stack: Stack, s: Settings, rng: random.Random, stop: asyncio.Event, phase: Phase, t0: float
) -> None:
    """SIGKILL the sidecar's server and restart Redis, alternating, at random intervals."""
    which = 0
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), rng.uniform(*s.fault_interval_s))
            return
        except TimeoutError:
            pass
        sidecar_turn = which % 2 == 0 and stack.sidecar is not None
        act = stack.kill_sidecar_server if sidecar_turn else stack.restart_redis
        what = await asyncio.to_thread(act)
        phase.faults.append({"t_s": round(time.monotonic() - t0, 1), "what": what})
        which += 1


def evicted_off_schedule(item: dict) -> bool:
    """Whether a completed request's eviction report says a fault moved its passes: a
    pass of it failed (the lease store or the compactor down: it kept its KV and
    evicted later) or SGLang retracted it (re-prefilled from its tokens). Its tokens may
    then differ from the same request's alone, by design."""
    report = item.get("report") or {}
    return bool(report.get("passes_failed") or report.get("retractions"))


def replay(url: str, done: list[dict], count: int, rng: random.Random) -> list[dict]:
    """Completed greedy ``/generate`` requests run again, one at a time, same policy;
    drawn from those whose passes ran on schedule (``evicted_off_schedule``)."""
    import requests

    on_schedule = [item for item in done if not evicted_off_schedule(item)]
    picked = rng.sample(on_schedule, min(count, len(on_schedule)))
    out = []
    for item in picked:
        body = {**item["body"], "stream": False}
        reply = requests.post(url + "/generate", json=body, timeout=600)
        alone = reply.json().get("output_ids") if reply.ok else None
        record = {
            "policy": body["sampling_params"].get("custom_params"),
            "tokens": len(item["output_ids"]),
            "equal": alone == item["output_ids"],
            "status": reply.status_code,
        }
        if alone is not None and not record["equal"]:
            # What a reader needs to tell a corrupted KV from a flipped near-tie: where
            # the two first differ, the prompt, and whether running it alone once more
            # gives the first replay's tokens again.
            again = requests.post(url + "/generate", json=body, timeout=600)
            record["first_differs_at"] = next(
                (
                    i
                    for i, (a, b) in enumerate(zip(alone, item["output_ids"], strict=False))
                    if a != b
                ),
                min(len(alone), len(item["output_ids"])),
            )
            record["text"] = body.get("text")
            record["alone_again_equal"] = again.ok and again.json().get("output_ids") == alone
        out.append(record)
    return out


async def kill_replica(stack: Stack, after_s: float, phase: Phase, monitor: Monitor) -> None:
    await asyncio.sleep(after_s)
    victim = stack.replicas[-1]
    # The whole replica at once (its scheduler and detokenizer too), as a node or
    # container dies: SIGKILL to its process group.
    os.killpg(victim.process.pid, signal.SIGKILL)
    victim.process.wait(timeout=30)
    phase.faults.append({"t_s": monitor.elapsed(), "what": f"SIGKILL replica {victim.url}"})
