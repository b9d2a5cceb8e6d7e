"""The pass fence (``compactor_service.fence``): a copy the client gave up on can never
land after the client moved on.

The end-to-end test stops a real compactor (SIGSTOP, from its own fault hook) at each
point of its pass in turn: before validation, after the lease check, inside the fence
before the kernel, halfway through the copy, after it; and continues it only after the
client's call timed out, while the generation goes on (the client completed the pass
in-process, committed, and its freed pages are being written again). Every step checks
every survivor's K/V bit for bit and SGLang's page accounting; the outputs must equal a
full-cache replay masked to what each step attended to. Without the fence, stops after
the lease check let late kernels overwrite survivors.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from compactor_service.compactor import FAULT_POINTS, PassAbandoned
from compactor_service.fence import ClientFence, CompactorFence, PassRevoked
from compactor_service.runtime_dir import ensure_private_dir
from sglang_evict.models.reference_loop import generate
from tests import process_registry
from tests.compactor_process import CompactorProcess
from tests.fault_driver import assert_nothing_lost, fault_model, make_driver, step_checks
from tests.test_pass_faults import requests

TIMEOUT_MS = 300


@pytest.fixture
def fence_dir(tmp_path):
    return ensure_private_dir(tmp_path / "pool", "--pool-dir")


# A compactor's side of the fence in a process of its own: holds the fence around a
# "kernel" (prints "entered") until a line arrives on stdin, or says it was revoked.
COMPACTOR_SIDE = """
import os, sys
from compactor_service.fence import CompactorFence, PassRevoked
fence = CompactorFence(os.open(sys.argv[1], os.O_RDWR))
try:
    with fence.hold(int(sys.argv[2]), None):
        print("entered", flush=True)
        sys.stdin.readline()
except PassRevoked:
    print("revoked", flush=True)
"""


def start_compactor_side(path, call_seq: int) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", COMPACTOR_SIDE, str(path), str(call_seq)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    process_registry.register(process)
    return process


def test_a_revocation_waits_for_a_copy_in_progress_and_says_it_started(fence_dir):
    client = ClientFence(fence_dir)
    call = client.next_seq()
    compactor = start_compactor_side(client.path, call)
    try:
        assert compactor.stdout.readline().strip() == "entered"

        def end_the_copy():
            compactor.stdin.write("\n")
            compactor.stdin.flush()

        threading.Timer(0.5, end_the_copy).start()
        start = time.monotonic()
        assert client.revoke(call) is True  # the kernel had started: it may have moved
        assert time.monotonic() - start >= 0.4  # it waited for the copy to end
        assert client.waits == 1
    finally:
        compactor.wait(30)
        client.close()


def test_a_revoked_call_never_starts_its_kernel(fence_dir):
    client = ClientFence(fence_dir)
    first, second = client.next_seq(), client.next_seq()
    assert client.revoke(second) is False  # never started: nothing moved
    fence = CompactorFence(os.open(client.path, os.O_RDWR))
    try:
        for call in (first, second):  # every call up to the revoked one
            with pytest.raises(PassRevoked, match="nothing moved"):
                with fence.hold(call, None):
                    pytest.fail("the kernel of a revoked call started")
        assert issubclass(PassRevoked, PassAbandoned)
        with fence.hold(client.next_seq(), None):
            pass  # a later call runs
    finally:
        fence.close()
        client.close()


def test_a_compactor_that_dies_inside_its_copy_releases_the_fence(fence_dir):
    client = ClientFence(fence_dir)
    call = client.next_seq()
    compactor = start_compactor_side(client.path, call)
    assert compactor.stdout.readline().strip() == "entered"
    compactor.kill()
    compactor.wait(30)
    assert client.revoke(call) is True  # known dead: the lock is free again
    client.close()


def _process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


class Continuer:
    """Continues the compactor each time it stopped itself, once it has been stopped
    for ``delay_s`` (the client's call has timed out by then, and the client moved on
    or waits on the fence). A stop seen again right after a continue (the process not
    yet resumed, or stopped anew at its next pass) is simply continued again later."""

    def __init__(self, pid: int, delay_s: float) -> None:
        self.pid, self.delay_s = pid, delay_s
        self.continues = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stopped_since = None
        while not self._done.is_set():
            try:
                stopped = _process_state(self.pid) == "T"
            except OSError:
                return
            now = time.monotonic()
            if not stopped:
                stopped_since = None
            elif stopped_since is None:
                stopped_since = now
            elif now - stopped_since >= self.delay_s:
                os.kill(self.pid, signal.SIGCONT)
                self.continues += 1
                stopped_since = None
            time.sleep(0.002)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(10)
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_a_compactor_stalled_at_every_point_of_its_pass_corrupts_nothing(tmp_path):
    model = fault_model()
    process = CompactorProcess(tmp_path, "--fault-injection", "9:0.35:stop").start()
    continuer = Continuer(process.process.pid, delay_s=2 * TIMEOUT_MS / 1000)
    try:
        driver = make_driver(
            model,
            compactor="grpc",
            compactor_socket=str(process.socket),
            compactor_timeout_ms=TIMEOUT_MS,
        )
        manager = driver.evictor
        sidecar = manager.compactor
        sidecar.retry_interval_s = 0.0  # probe the sidecar again at the next pass
        work = requests()
        result = generate(driver, model, work, on_step=step_checks(driver))
    finally:
        # Kill the compactor (SIGKILL ends a stopped process too) before the continuer
        # stops: a graceful stop drains calls queued behind a stopped one, and each of
        # them may stop the process again (CI saw that drain outlast 30 s). This test is
        # about the fence, not about shutdown; its log lines are written as they happen.
        if process.process.poll() is None:
            process.kill()
        continuer.stop()
    fence = sidecar.primary.fence
    stops_by_point = Counter(
        point
        for line in process.log.read_text().splitlines()
        for point in FAULT_POINTS
        if f'"point": "{point}"' in line
    )
    print(
        f"\ncompactor continued {continuer.continues} times; revocations that waited for a copy "
        f"{fence.waits}; passes {len(result.passes)}, sidecar {sidecar.sidecar_passes}, "
        f"in-process {sidecar.fallback_passes}, completed after a started copy "
        f"{manager.forced_completions}; stops logged by point {dict(stops_by_point)}"
    )
    # Every point of the pass was stalled at least once, the fence waited for a copy.
    assert sum(stops_by_point.values()) >= 2 * len(FAULT_POINTS)
    assert all(stops_by_point[point] >= 1 for point in FAULT_POINTS), stops_by_point
    assert fence.waits >= 1
    assert len(result.passes) >= 40
    # Nothing leaked, nothing freed twice, no survivor changed (checked every step).
    assert_nothing_lost(driver, model, work, result)
