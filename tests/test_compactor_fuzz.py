"""Fuzz the compactor's gRPC API: a seeded generator mutates every field of every RPC
(and sends bytes that are no message at all) against a real server process that checks
leases in a real Redis. Every generated call is malformed by construction: each must be
refused with its specific status (never UNKNOWN, INTERNAL or OK), leave every byte of
the pool's shared memory as it was, and leave the server serving; a valid pass goes
through at the end. Cases by element count (empty plans or buffer handles over their
bounds, fields over a level's budget) and wire bytes malformed where the servicer walks
them before parsing (``compactor_service.wire_bounds``) are among them.

``SGLANG_EVICT_FUZZ_CASES`` (default 1000) and ``SGLANG_EVICT_FUZZ_SEED`` choose the
run; a failure prints the seed and case to replay.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import torch

from compactor_service.health import check_health
from compactor_service.limits import (
    FIELDS_PER_MESSAGE,
    MAX_DETAIL_CHARS,
    MAX_LAYERS,
    MAX_SMALL_REQUEST_BYTES,
)
from compactor_service.redis_leases import RedisLeaseStore
from compactor_service.runtime_dir import DEFAULT_POOL_DIR
from compactor_service.v1 import compactor_pb2 as pb
from compactor_service.wire import layout_to_proto, plan_to_proto
from sglang_evict.passes.planner import plan_compaction
from tests.compactor_process import call, leased_compactor, make_pool
from tests.test_compactor_service import LAYERS, PAGE, SLOTS, two_request_plans

CASES = int(os.environ.get("SGLANG_EVICT_FUZZ_CASES", "1000"))
SEED = int(os.environ.get("SGLANG_EVICT_FUZZ_SEED", "20240517"))
MAX_PLANS, MAX_MOVES = 16, 64
PINNED_PAGE = 12
# A log line: the message, a few bounded fields and the JSON around them.
MAX_LOG_LINE_CHARS = 4000
HOLDER = "scheduler-fuzz"
Code = grpc.StatusCode


@dataclass
class Target:
    target: str
    pool_id: str
    epoch: int
    claim: pb.LeaseClaim
    layout: pb.PoolLayout
    plans: list[pb.Plan]  # a valid batch
    pinned_plan: pb.Plan  # valid, but it moves slots of the pinned page


@pytest.fixture(scope="module")
def world(tmp_path_factory, redis_server):
    process, namespace = leased_compactor(
        tmp_path_factory.mktemp("fuzz"),
        redis_server.url,
        *("--max-plans-per-call", str(MAX_PLANS), "--max-moves-per-call", str(MAX_MOVES)),
    )
    shared = make_pool(seed=1)
    layout = layout_to_proto(shared.layout)
    code, details, reply = call(
        process.target, "RegisterPool", pb.RegisterPoolRequest(layout=layout, client_id="fuzz")
    )
    assert code == Code.OK, details
    registered = pb.RegisterPoolResponse.FromString(reply)
    leases = RedisLeaseStore(redis_server.url, namespace=namespace)
    lease = leases.acquire("fuzz-pass", HOLDER, ttl_ms=600_000)
    leases.pin([PINNED_PAGE], HOLDER)  # a shared prefix page no pass may move
    row = torch.arange(PINNED_PAGE * PAGE, (PINNED_PAGE + 3) * PAGE)
    pinned = plan_compaction(row, torch.tensor([0, 2, 3, 5, 6, 9, 11]), page_size=PAGE)
    assert pinned.num_moves
    yield (
        Target(
            target=process.target,
            pool_id=registered.pool_id,
            epoch=registered.epoch,
            claim=pb.LeaseClaim(resource="fuzz-pass", fencing_token=lease.token, holder=HOLDER),
            layout=layout,
            plans=[plan_to_proto(p) for p in two_request_plans()],
            pinned_plan=plan_to_proto(pinned),
        ),
        shared,
        process,
    )
    shared.close()
    process.stop()


# --- values ---------------------------------------------------------------------------


def text(rng: random.Random) -> str:
    length = rng.choice([0, 1, 8, 32, 300, 5000, 1 << 20])
    if length > 5000:
        return "x" * length
    return "".join(
        chr(rng.choice([rng.randint(32, 126), rng.randint(0x80, 0x2FFF)])) for _ in range(length)
    )


def garbage(rng: random.Random) -> bytes:
    return rng.randbytes(rng.randint(1, 2000))


def le64(values) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()


def values(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i8").tolist()


def out_of_range(rng: random.Random, high: int) -> int:
    return rng.choice([rng.randint(-(2**63), -1), rng.randint(high, 2**63 - 1), -1, high])


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def length_delimited(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def unknown_fields(rng: random.Random, count: int) -> bytes:
    """``count`` fields no message declares (numbers 100..200), of every wire type."""
    fields = []
    for _ in range(count):
        number = rng.randint(100, 200)
        fields.append(
            rng.choice(
                [
                    varint(number << 3) + varint(rng.randint(0, 2**64 - 1)),
                    varint(number << 3 | 1) + rng.randbytes(8),
                    length_delimited(number, rng.randbytes(rng.randint(0, 8))),
                    varint(number << 3 | 5) + rng.randbytes(4),
                ]
            )
        )
    return b"".join(fields)


def malformed_wire(rng: random.Random, valid: bytes, nested: int) -> bytes:
    """``valid`` followed by a field the walk cannot read (a request's bytes may end with
    more fields: the parser merges them); ``nested``: the number of a message-typed
    field of the request (the walk enters it)."""
    tag = bytes([nested << 3 | 2])
    return valid + rng.choice(
        [
            bytes([rng.choice([3, 4, 6, 7]) | rng.randint(1, 15) << 3]),  # a group, 6, 7
            b"\x02\x00",  # field number 0
            b"\x10" + b"\xff" * 10 + b"\x01",  # a varint of 11 bytes
            b"\x10\xff",  # a varint cut short
            tag + varint(rng.randint(1, 1 << 20)),  # a length past the end
            tag + b"\x03\x0a\x09x",  # a field of the nested message past its end
        ]
    )


# --- Compact ---------------------------------------------------------------------------

Case = tuple[str, str, bytes, set]  # (what, method, request bytes, acceptable codes)
ARRAY_BOUNDS = {
    "new_row": SLOTS,
    "new_positions": 1 << 31,
    "src_slots": SLOTS,
    "dst_slots": SLOTS,
    "freed_pages": SLOTS // PAGE,
    "claimed_pages": SLOTS // PAGE,
}


def compact(t: Target, **fields) -> pb.CompactRequest:
    request = pb.CompactRequest(pool_id=t.pool_id, epoch=t.epoch, plans=[])
    request.claim.CopyFrom(t.claim)
    request.plans.extend(pb.Plan.FromString(p.SerializeToString()) for p in t.plans)
    for name, value in fields.items():
        if name == "claim" and value is None:
            request.ClearField("claim")
        elif name == "plans":
            del request.plans[:]
            request.plans.extend(value)
        else:
            setattr(request, name, value)
    return request


def mutate_array(rng: random.Random, plan: pb.Plan) -> tuple[str, set]:
    name = rng.choice(sorted(ARRAY_BOUNDS))
    field = f"{name}_le64"
    current = values(getattr(plan, field))
    how = rng.choice(["length", "range", "repeat", "too long", "moves"])
    if how == "length":
        setattr(plan, field, getattr(plan, field) + rng.randbytes(rng.randint(1, 7)))
    elif how == "range" or (how == "repeat" and not current):
        index = rng.randrange(len(current)) if current else None
        bad = out_of_range(rng, ARRAY_BOUNDS[name])
        if index is None:
            current.append(bad)
        else:
            current[index] = bad
        setattr(plan, field, le64(current))
    elif how == "repeat":
        setattr(plan, field, le64([*current, rng.choice(current)]))
    elif how == "too long":
        setattr(plan, field, le64([0] * rng.randint(SLOTS + 1, 4 * SLOTS)))
        if name == "src_slots":  # SLOTS == MAX_MOVES: the move bound is checked first
            return f"{field}: {how}", {Code.RESOURCE_EXHAUSTED}
    else:  # more moves than a call may carry: refused before decoding
        plan.src_slots_le64 = le64([1] * rng.randint(MAX_MOVES + 1, 8 * MAX_MOVES))
        return f"{name}: moves over the bound", {Code.RESOURCE_EXHAUSTED}
    return f"{field}: {how}", {Code.INVALID_ARGUMENT}


def compact_case(rng: random.Random, t: Target) -> Case:
    kind = rng.choice(
        [
            "pool_id",
            "epoch",
            "claim missing",
            "claim.resource",
            "claim.fencing_token",
            "claim.holder",
            "plans: count",
            "plans: repeated",
            "plan.page_size",
            "plan.rid",
            "plan array",
            "plan array",
            "plan array",
            "plans: shared source",
            "plans: write into the other row",
            "plans: empty, over the bound",
            "fields: over the budget",
            "wire: malformed",
            "bytes",
        ]
    )
    expected = {Code.INVALID_ARGUMENT}
    if kind == "plans: empty, over the bound":  # a valid pool, so no status but this one
        request = compact(t, plans=[]).SerializeToString()
        empty = b"\x22\x00" * rng.randint(MAX_PLANS + 1, 100_000)
        return kind, "Compact", request + empty, {Code.RESOURCE_EXHAUSTED}
    if kind == "fields: over the budget":
        request = compact(t)
        level = rng.choice(["request", "plan", "claim"])
        budget = {
            "request": FIELDS_PER_MESSAGE + MAX_PLANS,
            "plan": FIELDS_PER_MESSAGE * MAX_PLANS,
            "claim": FIELDS_PER_MESSAGE,
        }[level]
        extra = unknown_fields(rng, rng.randint(budget + 1, 4 * budget))
        if level == "request":
            data = request.SerializeToString() + extra
        else:
            data = request.SerializeToString() + length_delimited(
                4 if level == "plan" else 3, extra
            )
        return f"{kind} ({level})", "Compact", data, {Code.RESOURCE_EXHAUSTED}
    if kind == "wire: malformed":
        data = malformed_wire(rng, compact(t).SerializeToString(), nested=4)  # plans
        return kind, "Compact", data, {Code.INVALID_ARGUMENT}
    if kind == "pool_id":
        pool_id = text(rng)
        request, expected = (
            compact(t, pool_id=pool_id if pool_id != t.pool_id else ""),
            {Code.NOT_FOUND},
        )
    elif kind == "epoch":
        epoch = rng.choice([0, rng.randint(1, t.epoch - 1), rng.randint(t.epoch + 1, 2**64 - 1)])
        request, expected = compact(t, epoch=epoch), {Code.FAILED_PRECONDITION}
    elif kind == "claim missing":
        request, expected = compact(t, claim=None), {Code.ABORTED}
    elif kind.startswith("claim."):
        request = compact(t)
        expected = {Code.ABORTED}
        if kind == "claim.resource":
            request.claim.resource = text(rng) + "-not-the-lease"
        elif kind == "claim.fencing_token":
            token = t.claim.fencing_token
            request.claim.fencing_token = rng.choice([0, token - 1, token + 1, 2**64 - 1])
        else:  # naming the pinning holder gets no plan past a pin
            request.claim.holder = rng.choice([HOLDER, text(rng)])
            del request.plans[:]
            request.plans.append(t.pinned_plan)
    elif kind == "plans: count":
        plans = [t.plans[0]] * rng.randint(MAX_PLANS + 1, 20 * MAX_PLANS)
        request, expected = compact(t, plans=plans), {Code.RESOURCE_EXHAUSTED}
    elif kind == "plans: repeated":
        request = compact(t, plans=[t.plans[0], t.plans[0]])
    else:
        request = compact(t)
        plan = request.plans[rng.randrange(len(request.plans))]
        if kind == "plan.page_size":
            plan.page_size = rng.choice([0, 1, 2, 3, 5, 16, 2**32 - 1])
        elif kind == "plan.rid":  # a long rid rides along with a real fault
            plan.rid = text(rng)
            plan.page_size = 0
        elif kind == "plan array":
            kind, expected = mutate_array(rng, plan)
        elif kind == "plans: shared source":
            first, second = request.plans
            shared = values(first.src_slots_le64)[0]
            second.src_slots_le64 = le64([shared, *values(second.src_slots_le64)[1:]])
        elif kind == "plans: write into the other row":
            first, second = request.plans
            second.dst_slots_le64 = le64(
                [values(first.new_row_le64)[0], *values(second.dst_slots_le64)[1:]]
            )
        else:  # bytes that are no CompactRequest (or parse into one naming no pool)
            return kind, "Compact", garbage(rng), {Code.INVALID_ARGUMENT, Code.NOT_FOUND}
    return kind, "Compact", request.SerializeToString(), expected


# --- RegisterPool ----------------------------------------------------------------------


def register_case(rng: random.Random, t: Target) -> Case:
    layout = pb.PoolLayout.FromString(t.layout.SerializeToString())
    kind = rng.choice(
        [
            "num_layers",
            "num_slots",
            "num_kv_heads",
            "head_dim",
            "dtype",
            "page_size",
            "device",
            "device_index",
            "buffer dropped",
            "shm_path of one buffer",
            "shm_path of every buffer",
            "offset_bytes",
            "cuda on a CPU buffer",
            "cuda layout",
            "client_id",
            "handles: empty, over MAX_LAYERS",
            "layout: over the field budget",
            "wire: malformed",
            "bytes",
        ]
    )
    expected = {Code.INVALID_ARGUMENT}
    client_id = "fuzz-register"
    if kind == "handles: empty, over MAX_LAYERS":
        handle = rng.choice([b"\x4a\x00", b"\x52\x00"])  # k_buffers (9), v_buffers (10)
        body = layout.SerializeToString() + handle * rng.randint(MAX_LAYERS + 1, 100_000)
        return kind, "RegisterPool", length_delimited(1, body), {Code.RESOURCE_EXHAUSTED}
    if kind == "layout: over the field budget":
        budget = FIELDS_PER_MESSAGE + 2 * MAX_LAYERS
        body = layout.SerializeToString() + unknown_fields(rng, rng.randint(budget + 1, 10_000))
        return kind, "RegisterPool", length_delimited(1, body), {Code.RESOURCE_EXHAUSTED}
    if kind == "wire: malformed":
        request = pb.RegisterPoolRequest(layout=layout).SerializeToString()
        data = malformed_wire(rng, request, nested=1)  # layout
        return kind, "RegisterPool", data, {Code.INVALID_ARGUMENT}
    # Values that change the pool file's size (or are invalid outright): a value that
    # keeps the size would describe the same file and be a valid registration.
    if kind == "num_layers":
        layout.num_layers = rng.choice([0, 1, 3, rng.randint(4, 5000)])
    elif kind == "num_slots":
        layout.num_slots = rng.choice([0, rng.randint(200, 10**6), 2**64 - 1])
    elif kind == "num_kv_heads":
        layout.num_kv_heads = rng.choice([0, rng.randint(5, 2**32 - 1)])
    elif kind == "head_dim":
        layout.head_dim = rng.choice([0, rng.randint(20, 2**32 - 1)])
    elif kind == "dtype":
        layout.dtype = rng.choice(["", "int64", "BFLOAT16", "bfloat16 ", text(rng)])
    elif kind == "page_size":
        layout.page_size = rng.choice([0, rng.randint(SLOTS + 1, 2**32 - 1)])
    elif kind == "device":
        layout.device = rng.choice([0, 3, rng.randint(4, 2**31 - 1), pb.DEVICE_CUDA])
    elif kind == "device_index":
        layout.device_index = rng.choice([-1, -(2**31), rng.randint(256, 2**31 - 1)])
    elif kind == "buffer dropped":
        del rng.choice([layout.k_buffers, layout.v_buffers])[rng.randrange(LAYERS)]
    elif kind == "shm_path of one buffer":
        handles = [*layout.k_buffers, *layout.v_buffers]
        handles[rng.randrange(len(handles))].shm_path = text(rng) + "/x"
    elif kind == "shm_path of every buffer":
        path = rng.choice(
            [
                text(rng),
                "/etc/passwd",
                "/dev/shm",
                f"{DEFAULT_POOL_DIR}/../{os.path.basename(t.layout.k_buffers[0].shm_path)}",
                f"{DEFAULT_POOL_DIR}/sglang-evict-kv-1-{rng.randbytes(6).hex()}",
            ]
        )
        for handle in [*layout.k_buffers, *layout.v_buffers]:
            handle.shm_path = path
        expected = {Code.PERMISSION_DENIED, Code.NOT_FOUND, Code.INVALID_ARGUMENT}
    elif kind == "offset_bytes":
        handles = [*layout.k_buffers, *layout.v_buffers]
        handle = handles[rng.randrange(len(handles))]
        handle.offset_bytes = rng.choice([handle.offset_bytes + 1, rng.randint(0, 2**64 - 1)])
        if handle.offset_bytes == t.layout.k_buffers[0].offset_bytes:
            handle.offset_bytes += 4096
    elif kind == "cuda on a CPU buffer":
        layout.k_buffers[0].cuda.SetInParent()
        layout.k_buffers[0].cuda.mem_handle = rng.randbytes(rng.randint(0, 100))
    elif kind == "cuda layout":  # on a host without CUDA a well-formed one is refused too
        layout.device = pb.DEVICE_CUDA
        for handle in [*layout.k_buffers, *layout.v_buffers]:
            handle.Clear()
            handle.cuda.mem_handle = rng.choice(
                [
                    rng.randbytes(rng.randint(0, 200)),
                    bytes([rng.randint(0, 255), rng.randint(0, 255)]) + rng.randbytes(64),
                    bytes([2, ord("c")]) + rng.randbytes(64),
                ]
            )
            handle.cuda.storage_offset_bytes = rng.randint(0, 2**64 - 1)
            handle.cuda.storage_size_bytes = rng.randint(0, 2**64 - 1)
            handle.cuda.tensor_offset = rng.randint(0, 2**64 - 1)
        expected = {Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION}
    elif kind == "client_id":
        client_id = "c" * rng.randint(257, 10_000)
    else:
        return kind, "RegisterPool", garbage(rng), {Code.INVALID_ARGUMENT}
    request = pb.RegisterPoolRequest(layout=layout, client_id=client_id)
    return kind, "RegisterPool", request.SerializeToString(), expected


# --- Heartbeat, UnregisterPool, Stats ---------------------------------------------------


# Random bytes that happen to walk as more fields than a small request may hold (16:
# about one chance in 2^16) are refused for it.
SMALL_GARBAGE = {Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED}


def pool_call_case(method: str, request_type) -> Callable[[random.Random, Target], Case]:
    def case(rng: random.Random, t: Target) -> Case:
        kind = rng.choice(["pool_id", "epoch", "fields: over the budget", "bytes"])
        if kind == "pool_id":  # a pool id longer than the method's message limit allows
            request = request_type(pool_id=text(rng) or "none", epoch=t.epoch)
            data = request.SerializeToString()
            if len(data) > MAX_SMALL_REQUEST_BYTES:
                return "pool_id: over the message limit", method, data, {Code.RESOURCE_EXHAUSTED}
            return kind, method, data, {Code.NOT_FOUND}
        if kind == "epoch":
            request = request_type(pool_id=t.pool_id, epoch=rng.choice([0, t.epoch + 1]))
            return kind, method, request.SerializeToString(), {Code.FAILED_PRECONDITION}
        if kind == "fields: over the budget":
            request = request_type(pool_id=t.pool_id, epoch=t.epoch).SerializeToString()
            extra = unknown_fields(rng, rng.randint(FIELDS_PER_MESSAGE, 1000))
            return kind, method, request + extra, {Code.RESOURCE_EXHAUSTED}
        return kind, method, garbage(rng), SMALL_GARBAGE | {Code.NOT_FOUND}

    return case


def stats_case(rng: random.Random, t: Target) -> Case:
    # Stats has no field: bytes either parse (unknown fields are proto3-legal) or not.
    return "bytes", "Stats", garbage(rng), SMALL_GARBAGE | {Code.OK}


GENERATORS = [
    (compact_case, 10),
    (register_case, 7),
    (pool_call_case("Heartbeat", pb.HeartbeatRequest), 1),
    (pool_call_case("UnregisterPool", pb.UnregisterPoolRequest), 1),
    (stats_case, 1),
]


def test_every_malformed_call_is_refused_specifically_and_changes_no_byte(world):
    t, shared, process = world
    rng = random.Random(SEED)
    before = shared.path.read_bytes()
    outcomes: Counter[tuple[str, str]] = Counter()
    generators, weights = zip(*GENERATORS, strict=True)
    for index in range(CASES):
        kind, method, request, expected = rng.choices(generators, weights)[0](rng, t)
        code, details, _ = call(t.target, method, request, timeout_s=30)
        replay = f"SGLANG_EVICT_FUZZ_SEED={SEED}, case {index}: {method} {kind}"
        assert code in expected, f"{replay}: {code.name} {details[:300]}"
        assert len(details) <= MAX_DETAIL_CHARS + 30, replay
        assert shared.path.read_bytes() == before, f"{replay} changed the pool's memory"
        outcomes[(method, code.name)] += 1
        if index % 100 == 99:
            assert process.process.poll() is None and check_health(t.target), replay
    print(
        f"\n{CASES} cases, seed {SEED}: "
        + ", ".join(f"{m} {c}: {n}" for (m, c), n in sorted(outcomes.items()))
    )
    _, _, reply = call(t.target, "Stats", pb.StatsRequest())
    assert pb.StatsResponse.FromString(reply).pools == 1  # no mutated registration took
    # A valid pass is served afterwards and moves exactly its slots.
    expected = [b.clone() for b in shared.k + shared.v]
    for plan in two_request_plans():
        for buffer in expected:
            buffer[plan.dst_slots] = buffer[plan.src_slots]
    code, details, _ = call(t.target, "Compact", compact(t))
    assert code == Code.OK, details
    assert all(torch.equal(a, b) for a, b in zip(shared.k + shared.v, expected, strict=True))
