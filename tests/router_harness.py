"""Evicting replicas behind SGLang's router on one machine: two ``sglang-evict serve``
servers on CPU (the project's small model) and ``sglang-evict router`` over them, for
``tests/test_router.py`` and ``benches/bench_router.py``."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from tests.engine_harness import (
    POLICY_SERVER,
    ServedEngine,
    free_port,
    stop_process_group,
    wait_until,
)


def start_replicas(model_path: Path, log_dir: Path, count: int = 2) -> list[ServedEngine]:
    """``count`` evicting servers (the policy tests' flags), started side by side."""
    replicas = [
        ServedEngine(model_path, log_dir / f"replica{i}.log", list(POLICY_SERVER.eviction_flags))
        for i in range(count)
    ]
    with ThreadPoolExecutor(count) as pool:
        started = list(pool.map(lambda replica: _start_or_none(replica), replicas))
    if not all(started):
        for replica in replicas:
            replica.stop()
        raise RuntimeError(f"a replica did not start; logs in {log_dir}")
    return replicas


def _start_or_none(replica: ServedEngine):
    try:
        return replica.start()
    except RuntimeError:
        return None


class RouterProcess:
    """``sglang-evict router --worker-urls ... --policy POLICY`` (SGLang's router after
    the command's worker checks), its output in a log file."""

    def __init__(self, worker_urls: list[str], log_path: Path, policy: str = "cache_aware"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.command = [
            "sglang-evict",
            "router",
            "--worker-urls",
            *worker_urls,
            "--policy",
            policy,
            "--port",
            str(self.port),
            # Router flags passed through: its own metrics port, and a dead worker noticed
            # within a few seconds.
            *("--prometheus-port", str(free_port())),
            *("--health-check-interval-secs", "1", "--health-failure-threshold", "2"),
            *("--request-timeout-secs", "600", "--log-level", "warn"),
        ]
        self.worker_urls = list(worker_urls)
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120) -> RouterProcess:
        from tests import process_registry

        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        process_registry.register(self.process)
        if not wait_until(self._ready, timeout_s=timeout_s, interval_s=0.5):
            self.stop()
            raise RuntimeError(
                "the router did not register its workers:\n" + self.log_path.read_text()[-3000:]
            )
        return self

    def workers(self) -> list[str]:
        """The worker URLs the router lists (``/workers``)."""
        reply = requests.get(self.url + "/workers", timeout=5).json()
        return sorted(entry["url"] for entry in reply["workers"])

    def healthy_workers(self) -> list[str]:
        """The worker URLs the router holds healthy."""
        reply = requests.get(self.url + "/workers", timeout=5).json()
        return sorted(entry["url"] for entry in reply["workers"] if entry.get("is_healthy"))

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError("the router exited:\n" + self.log_path.read_text()[-3000:])
        try:
            return self.workers() == sorted(self.worker_urls)
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        stop_process_group(self.process, grace_s=30)
        if self.process is not None:
            self._log.close()


def cached_tokens(reply: dict) -> int:
    return int(reply["meta_info"].get("cached_tokens", 0))
