"""A real compactor process (``python -m compactor_service``) started by the tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from compactor_service.health import check_health, socket_target
from compactor_service.runtime_dir import DEFAULT_POOL_DIR
from tests import process_registry

ROOT = Path(__file__).resolve().parents[1]


class CompactorProcess:
    def __init__(
        self, workdir: Path, *extra: str, env: dict | None = None, pool_dir: str = DEFAULT_POOL_DIR
    ) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.socket = workdir / "sock" / "compactor.sock"
        self.pool_dir = pool_dir
        self.extra = extra
        self.env = {**os.environ, **(env or {})}
        self.log = workdir / "compactor.log"
        self.stdout = workdir / "compactor.out"
        self.process: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return socket_target(str(self.socket))

    def start(self, timeout_s: float = 60.0) -> CompactorProcess:
        command = [
            sys.executable,
            "-m",
            "compactor_service",
            "--socket",
            str(self.socket),
            "--reap-interval-s",
            "0.2",
            "--drain-s",
            "5",
            "--pool-dir",
            str(self.pool_dir),
            *self.extra,
        ]
        with open(self.log, "ab") as log, open(self.stdout, "ab") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=log, env=self.env, cwd=ROOT, start_new_session=True
            )
        process_registry.register(self.process)
        try:
            self.wait_healthy(timeout_s)
        except BaseException:
            process_registry.kill_group(self.process)  # a supervisor with its child
            raise
        return self

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"compactor exited early:\n{self.log.read_text()[-2000:]}")
            if self.socket.exists() and check_health(self.target, timeout_s=0.5):
                return
            time.sleep(0.05)
        raise RuntimeError(f"compactor not healthy in {timeout_s} s:\n{self.log.read_text()}")

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> int:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(30)

    def stats(self) -> dict:
        """The compactor's ``Stats`` as a dict."""
        import grpc

        from compactor_service.v1 import compactor_pb2 as pb
        from compactor_service.v1 import compactor_pb2_grpc as pb_grpc

        with grpc.insecure_channel(self.target) as channel:
            reply = pb_grpc.CompactorStub(channel).Stats(pb.StatsRequest(), timeout=30)
        return {field.name: getattr(reply, field.name) for field in reply.DESCRIPTOR.fields}

    def log_entries(self) -> list[dict]:
        entries = []
        for line in self.log.read_text().splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # e.g. a warning printed by a library
        return entries


SERVICE = "/sglang_evict.compactor.v1.Compactor/"


def call(
    target: str, method: str, request, timeout_s: float = 10.0, credentials=None
) -> tuple[object, str, object]:
    """Call ``method`` with a message or raw bytes: ``(status code, details, reply)``
    (reply bytes, or None when refused)."""
    import grpc

    from compactor_service.tls import open_channel

    payload = request if isinstance(request, bytes) else request.SerializeToString()
    with open_channel(target, credentials) as channel:
        stub = channel.unary_unary(SERVICE + method)
        try:
            reply = stub(payload, timeout=timeout_s)
        except grpc.RpcError as error:
            return error.code(), error.details() or "", None
    return grpc.StatusCode.OK, "", reply


# The small pool every compactor test maps: 2 layers x 64 slots x 2 heads x 8, bf16,
# pages of 4.
POOL_SHAPE = {"num_layers": 2, "num_slots": 64, "num_kv_heads": 2, "head_dim": 8, "page_size": 4}


def make_pool(directory: str | None = None, seed: int = 0):
    """A CPU pool in a file of ``directory`` (default: the default pool directory),
    filled with seeded random values; ``close()`` removes the file."""
    import torch

    from compactor_service.shared_pool import create_shared_buffers

    shared = create_shared_buffers(
        **POOL_SHAPE, dtype=torch.bfloat16, directory=directory or DEFAULT_POOL_DIR
    )
    generator = torch.Generator().manual_seed(seed)
    for buffer in shared.k + shared.v:
        buffer.copy_(torch.randn(buffer.shape, generator=generator))
    return shared


def leased_compactor(workdir: Path, redis_url: str, *extra: str) -> tuple[CompactorProcess, str]:
    """A started compactor checking leases in ``redis_url`` under a fresh namespace
    (the URL reaches it through the environment, as in production)."""
    import uuid

    namespace = uuid.uuid4().hex
    process = CompactorProcess(
        workdir, "--lease-namespace", namespace, *extra, env={"SGLANG_EVICT_REDIS_URL": redis_url}
    )
    return process.start(), namespace
