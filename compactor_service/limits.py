"""Bounds on what one client can make the compactor do, and on what it can make it say.

Every number a client controls is bounded before work proportional to it starts:

* message size: gRPC refuses a larger request itself (``RESOURCE_EXHAUSTED``);
* plans and slot moves per ``Compact`` call (``RESOURCE_EXHAUSTED``, before any plan is
  decoded); the client learns both at registration and splits larger batches;
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
  error and log line.

Defaults (flags of ``python -m compactor_service``), from the wire format: a plan
costs 16 bytes per kept token (new row and positions) and 16 per move (source and
destination), so 64 MiB holds e.g. 128 requests of 16k kept tokens and as many moves
(128 x 16k x 32 B), and 4M moves fill it (64 MiB / 16 B). A pass carries one plan per
request due at that step (requests come due at their own budget + cadence), so 1024
plans leave room for a whole batch coming due together; a larger batch is split by the
client. A scheduler process (one per tensor-parallel rank) registers one pool, hence 4
per client id and 64 in all. A registration lives 60 s without a call: heartbeats come
every 20 s, so two can be missed.
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
