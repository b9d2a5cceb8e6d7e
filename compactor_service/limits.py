"""Bounds on what one client can make the compactor do, and on what it can make it say.

Every number a client controls is bounded before work proportional to it starts:

* message size: gRPC refuses a request over ``--max-message-mb`` itself
  (``RESOURCE_EXHAUSTED``); the servicer holds every other method to a smaller limit
  of its own (``MAX_REGISTER_POOL_BYTES``, ``MAX_SMALL_REQUEST_BYTES``);
* element counts, before the request is parsed (``wire_bounds``): bytes do not bound
  objects (``0x22 0x00`` is one empty plan, so 64 MiB parse into 33.5M plans: 4.6 GiB
  and seconds of a CPU holding the GIL, stalling every other client's pass), so a
  bounded walk of the wire format counts the repeated fields (``CompactRequest.plans``
  against ``--max-plans-per-call``, ``PoolLayout.k_buffers``/``v_buffers`` against
  ``MAX_LAYERS``) and the fields of every message the parser would build
  (``FIELDS_PER_MESSAGE`` each), stopping at the first count over its bound
  (``RESOURCE_EXHAUSTED``, naming the field and the flag; before the pool is looked up,
  so an unknown pool id changes nothing); the parse that follows builds a bounded
  number of objects and copies at most the message's bytes;
* plans and slot moves per ``Compact`` call (``RESOURCE_EXHAUSTED``; plans before the
  parse, as above, moves before any plan is decoded); the client learns both at
  registration and splits larger batches;
* passes in flight per pool: a pool with that many calls running or waiting gets
  ``RESOURCE_EXHAUSTED`` at once instead of occupying more server threads, so one
  client's calls cannot starve other pools;
* registrations per client id and in all (``RESOURCE_EXHAUSTED``); client ids are
  self-declared, so the global bound is the one that holds against a hostile client,
  and the per-client bound keeps one misbehaving scheduler from filling it;
* registrations expire unless renewed (any call naming the pool renews it; the client
  sends ``Heartbeat`` while idle), so pools of clients that are gone are dropped whatever
  their id;
* client-supplied text (ids, paths, lease names) is shown clipped (``clip``) in every
  error and log line;
* refusal log lines are rate-limited per client and cause (``logs.LogRateLimiter``):
  ``REFUSAL_LINES_PER_KEY`` per ``REFUSAL_LOG_INTERVAL_S`` for each peer address,
  method and status, ``REFUSAL_LINES_IN_ALL`` in all, then one line per key with the
  count suppressed; at most ``REFUSAL_LOG_KEYS`` keys are tracked (the least recently
  used is dropped, its count joining one summary of the window).

Defaults (flags of ``python -m compactor_service``), from the wire format: a plan
costs 16 bytes per kept token (new row and positions) and 16 per move (source and
destination), so 64 MiB holds e.g. 128 requests of 16k kept tokens and as many moves
(128 x 16k x 32 B), and 4M moves fill it (64 MiB / 16 B). A pass carries one plan per
request due at that step (requests come due at their own budget + cadence), so 1024
plans leave room for a whole batch coming due together; a larger batch is split by the
client. A scheduler process (one per tensor-parallel rank) registers one pool, hence 4
per client id and 64 in all. A registration lives 60 s without a call: heartbeats come
every 20 s, so two can be missed.

Per-method message limits: a ``RegisterPool`` carries at most ``MAX_LAYERS`` K and V
handles of at most a path (``PATH_MAX``) and a CUDA handle each, so
``MAX_REGISTER_POOL_BYTES`` (8.6 MiB) holds the largest valid one with room to spare
(a real one is ~100 bytes a handle); ``Heartbeat``, ``UnregisterPool`` and ``Stats``
carry a pool id (32 hex characters) and an epoch, or nothing: 64 KiB. A message level
may hold ``FIELDS_PER_MESSAGE`` (16) fields per message, twice the 8 singular fields
of the largest (``Plan``, ``PoolLayout``), leaving room for fields a newer client adds.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
DEFAULT_MAX_PLANS_PER_CALL = 1024
DEFAULT_MAX_MOVES_PER_CALL = 1 << 22
DEFAULT_MAX_INFLIGHT_PER_POOL = 2  # one pass running, one waiting for the pool
DEFAULT_MAX_POOLS_PER_CLIENT = 4  # a scheduler process registers one pool per KV pool
DEFAULT_MAX_POOLS = 64
DEFAULT_POOL_LEASE_S = 60.0
# Layers a pool may have (the deepest open models have ~130) and its device indexes.
MAX_LAYERS = 1024
MAX_DEVICE_INDEX = 255
CLIP_CHARS = 80
# Per-method message limits and fields per message (module docstring: why these sizes).
PATH_MAX = 4096  # Linux: the longest path a pool file (shm_path) can have
MAX_HANDLE_BYTES = PATH_MAX + 256  # a path, its offset, a CUDA IPC handle, framing
MAX_REGISTER_POOL_BYTES = 2 * MAX_LAYERS * MAX_HANDLE_BYTES + (64 << 10)
MAX_SMALL_REQUEST_BYTES = 64 << 10
FIELDS_PER_MESSAGE = 16
# Refusal log lines (``logs.LogRateLimiter``).
REFUSAL_LINES_PER_KEY = 5
REFUSAL_LINES_IN_ALL = 100
REFUSAL_LOG_INTERVAL_S = 10.0
REFUSAL_LOG_KEYS = 1024
MAX_DETAIL_CHARS = 600  # a status message; gRPC's default metadata limit is 8 KiB


@dataclass(frozen=True)
class ServerLimits:
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_plans_per_call: int = DEFAULT_MAX_PLANS_PER_CALL
    max_moves_per_call: int = DEFAULT_MAX_MOVES_PER_CALL
    max_inflight_per_pool: int = DEFAULT_MAX_INFLIGHT_PER_POOL
    max_pools_per_client: int = DEFAULT_MAX_POOLS_PER_CLIENT
    max_pools: int = DEFAULT_MAX_POOLS
    pool_lease_s: float = DEFAULT_POOL_LEASE_S

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")


class LimitExceeded(RuntimeError):
    """A request exceeds one of the server's bounds; nothing was done."""


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """``text`` quoted, cut to ``limit`` characters with its full length appended."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}...({len(text)} chars)"


def clip_detail(text: str) -> str:
    """A whole message cut to ``MAX_DETAIL_CHARS``."""
    if len(text) <= MAX_DETAIL_CHARS:
        return text
    return text[:MAX_DETAIL_CHARS] + f"...({len(text)} chars)"


class InFlight:
    """Counts calls in flight per key and refuses one over ``limit`` (thread-safe)."""

    def __init__(self, limit: int, what: str, flag: str) -> None:
        self.limit, self.what, self.flag = limit, what, flag
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def enter(self, key: str) -> None:
        with self._lock:
            if self._counts[key] >= self.limit:
                raise LimitExceeded(
                    f"{self.what} {clip(key)} already has {self._counts[key]} calls in "
                    f"flight ({self.flag} {self.limit}); wait for them to finish"
                )
            self._counts[key] += 1

    def leave(self, key: str) -> None:
        with self._lock:
            self._counts[key] -= 1
            if self._counts[key] <= 0:
                del self._counts[key]
