"""Amplification by element count: bytes do not bound what a parse builds (``0x22 0x00``
is one empty plan), so the compactor walks a request's wire format before parsing it
(``compactor_service.wire_bounds``) and refuses, unparsed, a request holding more
plans, buffer handles or fields than its bounds, whatever pool it names.

Measured on a real compactor process (2 shared cores): before the walk, the floods of
the first test (8M empty plans to a registered pool and as many to an unknown pool id,
4M empty K or V handles, ...) raised its peak RSS by 1,185 MiB and held another
client's pass for up to 3.49 s; with the walk, 50 MiB and 0.04 s.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from compactor_service.client import GrpcCompactor
from compactor_service.limits import (
    DEFAULT_MAX_PLANS_PER_CALL,
    FIELDS_PER_MESSAGE,
    MAX_LAYERS,
    MAX_REGISTER_POOL_BYTES,
    MAX_SMALL_REQUEST_BYTES,
    PATH_MAX,
    LimitExceeded,
    ServerLimits,
)
from compactor_service.v1 import compactor_pb2 as pb
from compactor_service.wire import layout_to_proto, plan_to_proto
from compactor_service.wire_bounds import MalformedWire, _level, check_request, request_bounds
from tests.compactor_process import CompactorProcess, call, make_pool
from tests.test_compactor_fuzz import length_delimited
from tests.test_compactor_limits import expected_after, register, vm_kib
from tests.test_compactor_service import two_request_plans

Code = grpc.StatusCode
FLOOD = 8_000_000  # elements per flood: 16 MB of two-byte elements
PLAN = b"\x22\x00"  # CompactRequest.plans (field 4, length-delimited), an empty Plan
K_BUFFER, V_BUFFER = b"\x4a\x00", b"\x52\x00"  # PoolLayout.k_buffers (9), v_buffers (10)
UNKNOWN = b"\xf8\x01\x00"  # field 31, a varint: no field of any request
# Bounds of the first test: 1,185 MiB and 3.49 s before the walk (module docstring).
MAX_PEAK_GROWTH_MIB = 200
MAX_PASS_S = 1.0


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return length_delimited(number, payload)


def layout_of(body: bytes) -> bytes:
    """A RegisterPoolRequest whose layout (field 1) holds ``body``."""
    return field(1, body)


@pytest.fixture(scope="module")
def compactor(tmp_path_factory):
    """One compactor, not supervised: its pid is the server's own (VmHWM)."""
    process = CompactorProcess(tmp_path_factory.mktemp("amplification")).start()
    yield process
    process.stop()


def test_floods_by_element_count_are_refused_unparsed_and_another_client_keeps_its_passes(
    compactor,
):
    attacker, victim = make_pool(), make_pool(seed=1)
    try:
        flooded = register(compactor.target, attacker, "flooder")
        head = pb.CompactRequest(pool_id=flooded.pool_id, epoch=flooded.epoch)
        unknown = pb.CompactRequest(pool_id="no-such-pool", epoch=1)
        floods = {
            "empty plans": ("Compact", head.SerializeToString() + PLAN * FLOOD),
            "empty plans, unknown pool": ("Compact", unknown.SerializeToString() + PLAN * FLOOD),
            "empty K handles": ("RegisterPool", layout_of(K_BUFFER * (FLOOD // 2))),
            "empty V handles": ("RegisterPool", layout_of(V_BUFFER * (FLOOD // 2))),
            "a layout sent again and again": (
                "RegisterPool",
                layout_of(K_BUFFER) * (MAX_REGISTER_POOL_BYTES // 4),
            ),
            "unknown fields": ("Compact", UNKNOWN * (FLOOD // 2)),
            "unknown fields of one plan": (
                "Compact",
                head.SerializeToString() + field(4, UNKNOWN * (FLOOD // 2)),
            ),
        }
        expected_text = {
            "empty plans": "more than 1024 plans in one request (--max-plans-per-call 1024)",
            "empty plans, unknown pool": "more than 1024 plans",
            "empty K handles": f"more than {MAX_LAYERS} layout.k_buffers in one request",
            "empty V handles": f"more than {MAX_LAYERS} layout.v_buffers in one request",
            "a layout sent again and again": (
                f"more than {FIELDS_PER_MESSAGE} fields in RegisterPoolRequest"
            ),
            "unknown fields": "fields in CompactRequest",
            "unknown fields of one plan": "fields in CompactRequest.plans",
        }
        plans = two_request_plans()
        expected = expected_after(victim, plans)
        client = GrpcCompactor(compactor.target, victim.layout, timeout_s=30)
        client.compact(plans)  # registered and warm before the flood
        latencies: list[float] = []
        stop = threading.Event()

        def passes() -> None:
            while not stop.is_set():
                start = time.perf_counter()
                client.compact(plans)
                latencies.append(time.perf_counter() - start)

        peak_before_kib = vm_kib(compactor.process.pid, "VmHWM")
        other_client = threading.Thread(target=passes)
        other_client.start()
        try:
            outcomes = {
                what: call(compactor.target, method, data, timeout_s=60)
                for what, (method, data) in floods.items()
            }
        finally:
            stop.set()
            other_client.join(60)
        peak_growth_mib = (vm_kib(compactor.process.pid, "VmHWM") - peak_before_kib) / 1024
        print(
            f"\nserver peak RSS growth {peak_growth_mib:.0f} MiB; the other client's "
            f"{len(latencies)} passes: slowest {max(latencies):.3f} s"
        )
        assert peak_growth_mib < MAX_PEAK_GROWTH_MIB
        assert latencies and max(latencies) < MAX_PASS_S
        for what, (code, details, _) in outcomes.items():
            assert code == Code.RESOURCE_EXHAUSTED, (what, details[:300])
            assert expected_text[what] in details, (what, details[:300])
        assert all(torch.equal(a, b) for a, b in zip(victim.k + victim.v, expected, strict=True))
        client.close()
    finally:
        attacker.close()
        victim.close()


def test_each_method_has_its_own_message_limit(compactor):
    big_id = "p" * MAX_SMALL_REQUEST_BYTES
    for method, request in {
        "Heartbeat": pb.HeartbeatRequest(pool_id=big_id, epoch=1),
        "UnregisterPool": pb.UnregisterPoolRequest(pool_id=big_id, epoch=1),
        "Stats": UNKNOWN * (MAX_SMALL_REQUEST_BYTES // 3 + 1),
        "RegisterPool": pb.RegisterPoolRequest(client_id="c" * MAX_REGISTER_POOL_BYTES),
    }.items():
        code, details, _ = call(compactor.target, method, request)
        assert code == Code.RESOURCE_EXHAUSTED, (method, details[:300])
        assert f"{method}: a " in details and "-byte request, more than" in details
    # A pool id a little under the limit is looked up (and not found) as before.
    heartbeat = pb.HeartbeatRequest(pool_id="p" * (MAX_SMALL_REQUEST_BYTES - 100), epoch=1)
    assert call(compactor.target, "Heartbeat", heartbeat)[0] == Code.NOT_FOUND


@pytest.mark.parametrize(
    ("what", "data", "text"),
    [
        ("a plan running past the end", b"\x22\x05\x00", "runs past the end"),
        ("a group", b"\x23\x24", "wire type 3"),
        ("wire type 7", b"\x27", "wire type 7"),
        ("field number 0", b"\x02\x00", "field number 0"),
        ("a varint of 11 bytes", b"\x10" + b"\xff" * 10 + b"\x01", "longer than 10 bytes"),
        ("a truncated varint", b"\x10\xff", "runs past the end"),
        ("inside a plan", field(4, b"\x0a\x09abc"), "of CompactRequest.plans runs past"),
    ],
)
def test_bytes_the_walk_finds_malformed_are_invalid_argument(compactor, what, data, text):
    code, details, _ = call(compactor.target, "Compact", data)
    assert code == Code.INVALID_ARGUMENT, (what, details)
    assert "the request is not a valid CompactRequest" in details and text in details, what


# --- the walk, in-process --------------------------------------------------------------


BOUNDS = request_bounds(ServerLimits())


def _largest_valid_registration() -> bytes:
    """MAX_LAYERS layers, each handle with a PATH_MAX-long path, an offset and a CUDA
    export with every field set to its widest value."""
    handle = pb.BufferHandle(shm_path="/" * PATH_MAX, offset_bytes=2**64 - 1)
    handle.cuda.mem_handle = bytes(66)
    handle.cuda.storage_offset_bytes = handle.cuda.storage_size_bytes = 2**64 - 1
    handle.cuda.tensor_offset = 2**64 - 1
    layout = pb.PoolLayout(
        num_layers=MAX_LAYERS,
        num_slots=2**64 - 1,
        num_kv_heads=2**32 - 1,
        head_dim=2**32 - 1,
        dtype="bfloat16",
        page_size=2**32 - 1,
        device=pb.DEVICE_CUDA,
        device_index=-1,
        k_buffers=[handle] * MAX_LAYERS,
        v_buffers=[handle] * MAX_LAYERS,
    )
    request = pb.RegisterPoolRequest(layout=layout, client_id="c" * 256)
    if "fence_file" in pb.RegisterPoolRequest.DESCRIPTOR.fields_by_name:
        request.fence_file = "/" * PATH_MAX
    return request.SerializeToString()


def test_the_largest_valid_requests_pass_the_walk():
    check_request(_largest_valid_registration(), BOUNDS["RegisterPool"])
    plan = pb.Plan(
        rid="r" * 100,
        page_size=16,
        **{f"{name}_le64": bytes(8) for name in ("new_row", "new_positions", "src_slots")},
        **{f"{name}_le64": bytes(8) for name in ("dst_slots", "freed_pages", "claimed_pages")},
    )
    request = pb.CompactRequest(
        pool_id="a" * 32,
        epoch=2**64 - 1,
        claim=pb.LeaseClaim(resource="r", fencing_token=2**64 - 1, holder="h"),
        plans=[plan] * DEFAULT_MAX_PLANS_PER_CALL,
    )
    if "call_seq" in pb.CompactRequest.DESCRIPTOR.fields_by_name:
        request.call_seq = 2**64 - 1
    check_request(request.SerializeToString(), BOUNDS["Compact"])
    with pytest.raises(LimitExceeded, match="more than 1024 plans"):
        check_request(request.SerializeToString() + PLAN, BOUNDS["Compact"])
    valid = pb.CompactRequest(plans=[plan_to_proto(p) for p in two_request_plans()])
    check_request(valid.SerializeToString(), BOUNDS["Compact"])
    shared = make_pool()
    try:
        registration = pb.RegisterPoolRequest(layout=layout_to_proto(shared.layout))
        check_request(registration.SerializeToString(), BOUNDS["RegisterPool"])
    finally:
        shared.close()


def test_handles_of_a_layout_sent_in_pieces_add_up():
    """The parser merges a singular message field sent again: handles add up across
    the pieces, and so does the walk's count."""
    piece = layout_of(K_BUFFER * 100)
    check_request(piece * 10, BOUNDS["RegisterPool"])  # 1000 handles
    with pytest.raises(LimitExceeded, match=r"more than 1024 layout\.k_buffers"):
        check_request(piece * 11, BOUNDS["RegisterPool"])
    assert len(pb.RegisterPoolRequest.FromString(piece * 11).layout.k_buffers) == 1100


def test_the_walk_reads_as_many_fields_as_its_bounds_not_as_the_message():
    """A 64 MiB flood costs what the bound costs: far less than one Python step per
    field (33.5M of them would take seconds)."""
    flood = PLAN * (32 << 20)
    small = PLAN * (DEFAULT_MAX_PLANS_PER_CALL + 1)
    for data in (small, flood):
        start = time.perf_counter()
        with pytest.raises(LimitExceeded):
            check_request(data, BOUNDS["Compact"])
        elapsed = time.perf_counter() - start
    assert elapsed < 0.25, elapsed


def test_a_repeated_field_without_a_bound_is_refused_at_start_up():
    with pytest.raises(ValueError, match=r"PoolLayout\.k_buffers is repeated and has no bound"):
        _level(pb.PoolLayout.DESCRIPTOR, "PoolLayout", 1, "one request", {})


def test_malformed_wire_raises_before_any_count():
    with pytest.raises(MalformedWire, match="runs past the end"):
        check_request(b"\x0a\x7f", BOUNDS["Heartbeat"])
