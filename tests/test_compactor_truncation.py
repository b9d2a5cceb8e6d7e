"""A client that truncates its registered pool file cannot crash the compactor: the
compactor copies CPU pools through the file's descriptor (``pread``/``pwrite``), never
through a mapping that would fault (SIGBUS) and take every other client's pool with it.
A real compactor process, two pools: one client truncates its file, before a pass and
in the middle of one; the other client's passes keep landing, bit for bit.

(This test process maps the truncated pool itself, as a scheduler does, and so never
touches that pool's buffers after truncating it.)
"""

from __future__ import annotations

import json
import os
import signal
import time

import grpc
import pytest
import torch

from compactor_service.client import CompactorUnavailable, GrpcCompactor
from compactor_service.compactor import FAULT_POINTS
from compactor_service.health import check_health
from compactor_service.v1 import compactor_pb2 as pb
from sglang_evict_kernels import repack_kv_reference
from tests.compactor_process import CompactorProcess, call, make_pool
from tests.test_compactor_service import snapshot, two_request_plans


def expected_after(shared, plans) -> list[torch.Tensor]:
    k, v = [b.clone() for b in shared.k], [b.clone() for b in shared.v]
    src = torch.cat([p.src_slots for p in plans])
    dst = torch.cat([p.dst_slots for p in plans])
    repack_kv_reference(k, v, src, dst)
    return k + v


def assert_other_pool_still_served(process, other) -> None:
    plans = two_request_plans()
    expected = expected_after(other, plans)
    client = GrpcCompactor(process.target, other.layout, timeout_s=10)
    try:
        assert client.compact(plans).slots_moved > 0
    finally:
        client.close()
    assert all(torch.equal(a, b) for a, b in zip(snapshot(other), expected, strict=True))


def pools_registered(process) -> int:
    _, _, reply = call(process.target, "Stats", pb.StatsRequest())
    return pb.StatsResponse.FromString(reply).pools


@pytest.mark.parametrize("when", ["before-the-pass", "during-the-pass"])
def test_a_truncated_pool_file_fails_its_pass_and_nothing_else(tmp_path, when):
    # "during": the compactor stops itself at one point of each pass in turn; once it
    # stops inside the fence, right before the kernel, the file is truncated, then it
    # continues.
    extra = ("--fault-injection", "1:1.0:stop") if when == "during-the-pass" else ()
    process = CompactorProcess(tmp_path, *extra).start()
    victim, other = make_pool(seed=1), make_pool(seed=2)
    client = GrpcCompactor(process.target, victim.layout, timeout_s=30)
    pid = process.process.pid
    try:
        if when == "during-the-pass":
            pending = _stop_inside_the_fence(client, process, pid)
            os.truncate(victim.path, victim.layout.file_bytes // 3)
            os.kill(pid, signal.SIGCONT)
            pending.join(30)
            error = pending.error
        else:
            client.register()
            os.truncate(victim.path, victim.layout.file_bytes // 3)
            with pytest.raises(CompactorUnavailable) as failed:
                client.compact(two_request_plans())
            error = failed.value
        assert isinstance(error, CompactorUnavailable), (error, process.log.read_text()[-4000:])
        assert "DATA_LOSS" in str(error) and "truncated" in str(error)
        assert process.process.poll() is None and check_health(process.target)
        assert pools_registered(process) == 0  # the truncated pool was dropped
        if when == "during-the-pass":
            os.kill(pid, signal.SIGCONT)  # the other client's passes stop too: continue
        assert_other_pool_still_served_while_continuing(process, other, pid, when)
    finally:
        client.close()
        process.stop()
        victim.close()
        other.close()
    assert process.process.returncode == 0  # drained and exited, never killed by SIGBUS


def assert_other_pool_still_served_while_continuing(process, other, pid, when) -> None:
    if when != "during-the-pass":
        assert_other_pool_still_served(process, other)
        return
    pending = _compact_in_thread(None, process=process, pool=other)
    while pending.is_alive():  # the stop hook strikes every pass: keep continuing it
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    pending.join(30)
    assert pending.error is None, pending.error
    assert pending.expected is not None
    assert all(torch.equal(a, b) for a, b in zip(snapshot(other), pending.expected, strict=True))


class _Pending:
    def __init__(self, thread) -> None:
        self.thread, self.error, self.expected = thread, None, None

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive()

    def is_alive(self) -> bool:
        return self.thread.is_alive()


def _compact_in_thread(client, *, process=None, pool=None) -> _Pending:
    import threading

    pending = _Pending(None)

    def run():
        own = client
        try:
            if own is None:
                own = GrpcCompactor(process.target, pool.layout, timeout_s=30)
                plans = two_request_plans()
                pending.expected = expected_after(pool, plans)
            else:
                plans = two_request_plans()
            own.compact(plans)
        except Exception as error:  # read by the test
            pending.error = error
        finally:
            if client is None and own is not None:
                own.close()

    pending.thread = threading.Thread(target=run, daemon=True)
    pending.thread.start()
    return pending


def _stop_inside_the_fence(client, process, pid: int) -> _Pending:
    """Send passes until the compactor stops itself inside the pass fence, right before
    the kernel (its log names the point of each stop: passes that stop elsewhere are
    continued); returns that pass, still stopped."""
    for _ in range(2 * len(FAULT_POINTS)):
        pending = _compact_in_thread(client)
        _wait_stopped(pid)
        if _last_stop_point(process) == "fenced":
            return pending
        os.kill(pid, signal.SIGCONT)
        pending.join(30)
    raise AssertionError(f"the compactor never stopped inside the fence: {process.log.read_text()}")


def _last_stop_point(process) -> str | None:
    point = None
    for line in process.log.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("msg") == "fault injection: stopping the compactor":
            point = record.get("point")
    return point


def _wait_stopped(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.005)
    raise AssertionError("the compactor did not stop at its fault point")


def test_a_grpc_status_for_a_truncated_pool_is_data_loss():
    from compactor_service.servicer import status_for
    from compactor_service.shared_pool import PoolFileTruncated

    assert status_for(PoolFileTruncated("x")) == grpc.StatusCode.DATA_LOSS
