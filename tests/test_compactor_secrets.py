"""The Redis password of the lease store: the compactor takes it from a file or the
environment, never shows it in its command line (/proc/PID/cmdline) or in its output,
and redacts it from every error. A real redis-server with ``requirepass``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis

from compactor_service.client import GrpcCompactor
from compactor_service.compactor import LeaseClaim
from compactor_service.redis_leases import LeaseStoreUnavailable, RedisLeaseStore
from compactor_service.secrets import REDIS_URL_ENV
from tests.compactor_process import ROOT, CompactorProcess, make_pool
from tests.redis_server import RedisServer
from tests.test_compactor_service import two_request_plans

PASSWORD = "hunter2-" + "s3cr3t"


@pytest.fixture(scope="module")
def protected_redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis-auth")).start()
    redis.Redis(port=server.port).config_set("requirepass", PASSWORD)
    yield server
    server.stop()


def url(server: RedisServer, password: str = PASSWORD) -> str:
    return f"redis://:{password}@127.0.0.1:{server.port}/0"


@pytest.fixture
def pool():
    shared = make_pool()
    yield shared
    shared.close()


def compact_with_a_lease(process: CompactorProcess, pool, store_url: str):
    namespace = "secrets"
    leases = RedisLeaseStore(store_url, namespace=namespace)
    lease = leases.acquire("pass", "scheduler-secrets", ttl_ms=60_000)
    client = GrpcCompactor(process.target, pool.layout, timeout_s=10)
    try:
        return client.compact(two_request_plans(), LeaseClaim("pass", lease.token, "s"))
    finally:
        client.close()
        leases.release(lease)


def everything_it_showed(process: CompactorProcess) -> str:
    cmdline = open(f"/proc/{process.process.pid}/cmdline", "rb").read().decode()
    return cmdline + process.log.read_text() + process.stdout.read_text()


@pytest.mark.parametrize("source", ["environment", "file"])
def test_the_password_is_never_on_the_command_line_nor_in_the_output(
    source, protected_redis, pool, tmp_path
):
    env, flags = {}, ()
    if source == "environment":
        env = {REDIS_URL_ENV: url(protected_redis)}
    else:
        secret = tmp_path / "redis-url"
        secret.write_text(url(protected_redis) + "\n")
        secret.chmod(0o600)
        flags = ("--redis-url-file", str(secret))
    process = CompactorProcess(tmp_path, *flags, "--lease-namespace", "secrets", env=env)
    process.start()
    try:
        # The lease check reached Redis with the password: the pass went through.
        assert compact_with_a_lease(process, pool, url(protected_redis)).slots_moved > 0
        shown = everything_it_showed(process)
    finally:
        process.stop()
    assert PASSWORD not in shown
    assert f"redis://:***@127.0.0.1:{protected_redis.port}/0" in shown  # what it shows


def test_a_url_on_the_command_line_still_works_with_a_warning_and_is_not_logged(
    protected_redis, pool, tmp_path
):
    process = CompactorProcess(
        tmp_path, "--redis-url", url(protected_redis), "--lease-namespace", "secrets"
    ).start()
    try:
        assert compact_with_a_lease(process, pool, url(protected_redis)).slots_moved > 0
    finally:
        process.stop()
    log = process.log.read_text() + process.stdout.read_text()
    assert "readable by every user in /proc" in log and "--redis-url-file" in log
    assert PASSWORD not in log


def test_a_wrong_password_fails_passes_without_showing_either_password(
    protected_redis, pool, tmp_path
):
    wrong = "not-" + PASSWORD
    process = CompactorProcess(
        tmp_path,
        "--lease-namespace",
        "secrets",
        env={REDIS_URL_ENV: url(protected_redis, wrong)},
    ).start()
    try:
        # The compactor's lease store refused it: told apart from the compactor being
        # down (nothing moved), without either password.
        with pytest.raises(LeaseStoreUnavailable, match="lease store") as failed:
            compact_with_a_lease(process, pool, url(protected_redis))
        shown = everything_it_showed(process) + str(failed.value)
    finally:
        process.stop()
    assert "unreachable" in shown
    assert PASSWORD not in shown and wrong not in shown


def test_a_malformed_url_is_refused_in_one_line_without_its_password():
    result = subprocess.run(
        [sys.executable, "-m", "compactor_service", "--no-socket", "--tcp", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": f"{ROOT}:{ROOT / 'kernels'}",
            REDIS_URL_ENV: f"redis://:{PASSWORD}@redis:port/0",
        },
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and f"${REDIS_URL_ENV}" in result.stderr
    assert PASSWORD not in result.stderr and "***" in result.stderr
