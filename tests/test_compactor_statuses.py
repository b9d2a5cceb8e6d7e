"""Every refusal gets its own status, and neither its message nor its log line grows
with what the client sent (a 1 MB pool id, a 100 KB lease name)."""

from __future__ import annotations

import grpc
import pytest

from compactor_service.limits import MAX_DETAIL_CHARS
from compactor_service.redis_leases import RedisLeaseStore
from compactor_service.runtime_dir import DEFAULT_POOL_DIR
from compactor_service.v1 import compactor_pb2 as pb
from compactor_service.wire import layout_to_proto, plan_to_proto
from tests.compactor_process import call, leased_compactor, make_pool
from tests.test_compactor_fuzz import MAX_LOG_LINE_CHARS
from tests.test_compactor_service import two_request_plans

HUGE = "p" * (1 << 20)


@pytest.fixture(scope="module")
def registered(tmp_path_factory, redis_server):
    process, namespace = leased_compactor(tmp_path_factory.mktemp("statuses"), redis_server.url)
    shared = make_pool()
    layout = layout_to_proto(shared.layout)
    _, _, reply = call(process.target, "RegisterPool", pb.RegisterPoolRequest(layout=layout))
    reply = pb.RegisterPoolResponse.FromString(reply)
    lease = RedisLeaseStore(redis_server.url, namespace).acquire("pass", "s", ttl_ms=600_000)
    yield process, reply, layout, lease
    shared.close()
    process.stop()


def _requests(reply, layout, lease) -> dict:
    plans = [plan_to_proto(p) for p in two_request_plans()]
    claim = pb.LeaseClaim(resource="pass", fencing_token=lease.token, holder="s")
    long_claim = pb.LeaseClaim(resource="r" * 100_000, fencing_token=lease.token, holder="s")
    cuda = pb.PoolLayout.FromString(layout.SerializeToString())
    cuda.device = pb.DEVICE_CUDA
    for handle in [*cuda.k_buffers, *cuda.v_buffers]:
        handle.Clear()
        handle.cuda.mem_handle = b"\x00garbage IPC bytes"
    directory = pb.PoolLayout.FromString(layout.SerializeToString())
    for handle in [*directory.k_buffers, *directory.v_buffers]:
        handle.shm_path = DEFAULT_POOL_DIR
    return {
        "1 MB pool id": (
            "Compact",
            pb.CompactRequest(pool_id=HUGE, epoch=reply.epoch, claim=claim, plans=plans),
            grpc.StatusCode.NOT_FOUND,
            "is not registered",
        ),
        "long lease name": (
            "Compact",
            pb.CompactRequest(
                pool_id=reply.pool_id, epoch=reply.epoch, claim=long_claim, plans=plans
            ),
            grpc.StatusCode.ABORTED,
            "is not the current lease of 'rrrr",
        ),
        "garbage IPC bytes": (
            "RegisterPool",
            pb.RegisterPoolRequest(layout=cuda),
            grpc.StatusCode.INVALID_ARGUMENT,
            "cuda.mem_handle holds 18 bytes, expected 66",
        ),
        "a directory as the pool file": (
            "RegisterPool",
            pb.RegisterPoolRequest(layout=directory),
            grpc.StatusCode.PERMISSION_DENIED,
            "is not in the compactor's pool directory",
        ),
        "1 MB client id": (
            "RegisterPool",
            pb.RegisterPoolRequest(layout=layout, client_id=HUGE),
            grpc.StatusCode.INVALID_ARGUMENT,
            "is longer than 256 characters",
        ),
        # Under the 64 KiB a small method may take (limits.MAX_SMALL_REQUEST_BYTES).
        "60 kB pool id to unregister": (
            "UnregisterPool",
            pb.UnregisterPoolRequest(pool_id="p" * 60_000, epoch=reply.epoch),
            grpc.StatusCode.NOT_FOUND,
            "is not registered",
        ),
        "1 MB pool id to unregister": (
            "UnregisterPool",
            pb.UnregisterPoolRequest(pool_id=HUGE, epoch=reply.epoch),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "more than 65536 bytes",
        ),
    }


CASES = [
    "1 MB pool id",
    "long lease name",
    "garbage IPC bytes",
    "a directory as the pool file",
    "1 MB client id",
    "60 kB pool id to unregister",
    "1 MB pool id to unregister",
]


@pytest.mark.parametrize("case", CASES)
def test_a_refusal_has_its_status_and_a_bounded_message_and_log_line(case, registered):
    process, reply, layout, lease = registered
    method, request, code, text = _requests(reply, layout, lease)[case]
    got, details, _ = call(process.target, method, request)
    assert (got, text in details) == (code, True), details[:300]
    assert len(details) <= MAX_DETAIL_CHARS + 30
    refusal = [e for e in process.log_entries() if e["msg"] == f"{method} refused"][-1]
    assert refusal["status"] == code.name
    longest = max(len(line) for line in process.log.read_text().splitlines())
    assert longest <= MAX_LOG_LINE_CHARS
