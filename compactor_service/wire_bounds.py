"""A bounded walk of a request's wire bytes, before the request is parsed.

gRPC's message limit bounds bytes, not the objects a parse makes of them: ``0x22 0x00``
is one empty ``Plan``, so a 64 MiB ``CompactRequest`` parses into 33.5M plans (4.6 GiB
and ~5 CPU-seconds, measured, while the parse holds the GIL and every other client's
pass waits). The parse cannot be told to stop early, so the servicer walks the wire
format first (``check_request``):

* the message's size against its method's limit (``RequestBounds.max_bytes``);
* every level the parser would build objects at (the request and each message-typed
  field, found from the descriptors), field by field: tags and lengths are read,
  payloads are skipped without a copy, and only message-typed fields are entered;
* per level, the count of each repeated field against its bound and of all fields
  against ``FIELDS_PER_MESSAGE`` per message the level may hold (a singular message
  field sent again is merged by the parser, not replaced: its fields add up, and so do
  its repeated fields, which is why counts are kept across occurrences);
* the first count over its bound is ``LimitExceeded`` (``RESOURCE_EXHAUSTED``) naming
  the field and the flag, so the walk costs O(bounds) fields whatever the message's
  size; bytes that are no wire format there are ``MalformedWire``.

What the parse then builds is bounded: at most the bounded number of messages and
fields, plus copies of string and bytes payloads (at most the message's size).
Unknown fields are allowed (a newer client may send some) and counted; groups (wire
types 3 and 4, unused in proto3) are refused. A repeated field that no bound names
makes ``request_bounds`` fail at start-up, so a proto change cannot add an unbounded
one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from google.protobuf.descriptor import Descriptor

from compactor_service.limits import (
    FIELDS_PER_MESSAGE,
    MAX_LAYERS,
    MAX_REGISTER_POOL_BYTES,
    MAX_SMALL_REQUEST_BYTES,
    LimitExceeded,
    ServerLimits,
)
from compactor_service.v1 import compactor_pb2 as pb

_MAX_FIELD_NUMBER = (1 << 29) - 1
_WIRE_TYPES = {0: "varint", 1: "fixed64", 2: "length-delimited", 5: "fixed32"}


class MalformedWire(ValueError):
    """The bytes are not protobuf wire format where the walk read them."""


@dataclass(frozen=True, eq=False)
class Repeated:
    """A repeated field's bound: at most ``limit`` elements in one request."""

    name: str  # shown in the refusal: "plans", "layout.k_buffers"
    limit: int
    why: str  # the flag or constant that sets ``limit``, with its value


@dataclass(frozen=True, eq=False)
class Level:
    """One message type as the walk sees it (every occurrence in a request together)."""

    name: str  # the path from the request: "CompactRequest", "CompactRequest.plans"
    max_fields: int
    why: str  # why ``max_fields``
    repeated: Mapping[int, Repeated] = field(default_factory=dict)
    nested: Mapping[int, Level] = field(default_factory=dict)  # message-typed fields


@dataclass(frozen=True)
class RequestBounds:
    """What one method's request may hold."""

    method: str
    max_bytes: int
    bytes_why: str
    level: Level


def _level(
    descriptor: Descriptor, name: str, messages: int, why: str, repeated: Mapping[str, tuple]
) -> Level:
    """The level of ``descriptor`` when a request may hold ``messages`` of it (``why``);
    ``repeated`` bounds repeated fields by full name: ``(limit, why)``."""
    bounds: dict[int, Repeated] = {}
    nested: dict[int, Level] = {}
    max_fields = messages * FIELDS_PER_MESSAGE
    for f in descriptor.fields:
        path = f"{name}.{f.name}"
        count, count_why = messages, why
        if f.is_repeated:
            if f.full_name not in repeated:
                raise ValueError(f"{f.full_name} is repeated and has no bound in wire_bounds")
            limit, limit_why = repeated[f.full_name]
            bounds[f.number] = Repeated(path.partition(".")[2], limit, limit_why)
            max_fields += limit
            count, count_why = limit, limit_why
        if f.message_type is not None:
            nested[f.number] = _level(f.message_type, path, count, count_why, repeated)
    fields_why = f"FIELDS_PER_MESSAGE {FIELDS_PER_MESSAGE}"
    if messages > 1:
        fields_why += f" x {messages} messages ({why})"
    if bounds:
        fields_why += f" + {max_fields - messages * FIELDS_PER_MESSAGE} repeated elements"
    return Level(name, max_fields, fields_why, bounds, nested)


def request_bounds(limits: ServerLimits) -> dict[str, RequestBounds]:
    """Each method's ``RequestBounds`` under ``limits``, by method name."""
    layers = (MAX_LAYERS, f"a pool has at most MAX_LAYERS {MAX_LAYERS} layers")
    plans = limits.max_plans_per_call
    repeated = {
        "sglang_evict.compactor.v1.CompactRequest.plans": (
            plans,
            f"--max-plans-per-call {plans}",
        ),
        "sglang_evict.compactor.v1.PoolLayout.k_buffers": layers,
        "sglang_evict.compactor.v1.PoolLayout.v_buffers": layers,
    }
    message_mb = limits.max_message_bytes >> 20
    sizes = {
        "Compact": (limits.max_message_bytes, f"--max-message-mb {message_mb}"),
        "RegisterPool": (
            MAX_REGISTER_POOL_BYTES,
            f"MAX_REGISTER_POOL_BYTES: {MAX_LAYERS} K and V handles of a path each",
        ),
        "RegisterArena": (
            MAX_SMALL_REQUEST_BYTES,
            "MAX_SMALL_REQUEST_BYTES: a pool id, an epoch, a format and a path",
        ),
    }
    small = (MAX_SMALL_REQUEST_BYTES, "MAX_SMALL_REQUEST_BYTES: a pool id and an epoch")
    service = pb.DESCRIPTOR.services_by_name["Compactor"]
    bounds = {}
    for method in service.methods:
        max_bytes, bytes_why = sizes.get(method.name, small)
        request = method.input_type
        level = _level(request, request.name, 1, "one request", repeated)
        bounds[method.name] = RequestBounds(
            method.name, min(max_bytes, limits.max_message_bytes), bytes_why, level
        )
    return bounds


def check_request(data: bytes, bounds: RequestBounds) -> None:
    """Refuse ``data`` (``LimitExceeded``, ``MalformedWire``) if it is larger than its
    method allows or holds more elements or fields than its bounds; reads O(bounds)
    fields and copies nothing."""
    if len(data) > bounds.max_bytes:
        raise LimitExceeded(
            f"{bounds.method}: a {len(data)}-byte request, more than {bounds.max_bytes} "
            f"bytes ({bounds.bytes_why})"
        )
    _walk(memoryview(data), 0, len(data), bounds.level, {}, bounds.method)


def _varint(view: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end:
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise MalformedWire(f"a varint longer than 10 bytes ends at byte {pos}")
    raise MalformedWire(f"a varint runs past the end of its message (byte {end})")


def _walk(view: memoryview, pos: int, end: int, level: Level, counts: dict, method: str) -> None:
    """Walk the fields in ``view[pos:end]``, a message of ``level``; ``counts`` holds
    the counts of every level and repeated field of the request so far. (The common
    one-byte tags and lengths are read inline: a 1024-plan pass is walked in ~1 ms.)"""
    repeated, nested = level.repeated, level.nested
    fields, max_fields = counts.get(level, 0), level.max_fields
    while pos < end:
        fields += 1
        if fields > max_fields:
            raise LimitExceeded(
                f"{method}: more than {max_fields} fields in {level.name} ({level.why})"
            )
        start = pos
        tag = view[pos]
        pos += 1
        if tag >= 0x80:
            tag, pos = _varint(view, start, end)
        number, wire_type = tag >> 3, tag & 7
        if not 0 < number <= _MAX_FIELD_NUMBER:
            raise MalformedWire(f"field number {number} at byte {start} of {level.name}")
        if wire_type == 2:
            if pos < end and view[pos] < 0x80:
                length = view[pos]
                pos += 1
            else:
                length, pos = _varint(view, pos, end)
            pos += length
            if pos <= end and number in nested:
                counts[level] = fields
                _walk(view, pos - length, pos, nested[number], counts, method)
        elif wire_type == 0:
            _, pos = _varint(view, pos, end)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:
            raise MalformedWire(
                f"field {number} at byte {start} of {level.name} has wire type {wire_type} "
                f"(not {', '.join(f'{k} ({v})' for k, v in _WIRE_TYPES.items())})"
            )
        if pos > end:
            raise MalformedWire(
                f"field {number} at byte {start} of {level.name} runs past the end of its "
                f"message (byte {end})"
            )
        if number in repeated:
            bound = repeated[number]
            count = counts[bound] = counts.get(bound, 0) + 1
            if count > bound.limit:
                raise LimitExceeded(
                    f"{method}: more than {bound.limit} {bound.name} in one request ({bound.why})"
                )
    counts[level] = fields
