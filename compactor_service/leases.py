"""Leases: who may move which KV pages, and which shared pages nobody may move.

Two kinds of record, one store:

* **Exclusive leases with fencing tokens.** A compaction pass acquires the lease of the
  pages it moves (a resource name, e.g. ``pool:<id>:req:<rid>``) for ``ttl_ms``; every
  grant carries a fencing token, strictly increasing across the store. A commit
  carrying a token that is not the resource's current, unexpired one is refused, so a
  pass that stalled past its TTL (or whose compactor died and was replaced) cannot
  commit over a newer holder.
* **Refcounted pins of shared pages.** Pages held by radix-tree nodes that several
  requests lock are pinned once per holder; a pinned page is a shared prefix, which no
  pass may move (``pinned``), whoever pins it. Counts never go negative.

``InProcessLeaseStore`` is the default (one scheduler process). A Redis store for
multi-process deployments implements the same ``LeaseStore`` contract (same tests).
Times are milliseconds from an injectable clock so TTL behaviour is testable.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol


def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


@dataclass(frozen=True)
class Lease:
    resource: str
    owner: str
    token: int  # fencing token: strictly increasing over every grant of the store
    expires_at_ms: int


class LeaseStore(Protocol):
    def acquire(self, resource: str, owner: str, ttl_ms: int) -> Lease | None:
        """Grant an exclusive lease with a new fencing token, or None if another owner
        holds an unexpired one."""
        ...

    def renew(self, lease: Lease, ttl_ms: int) -> Lease | None:
        """Extend ``lease`` if it is still the current, unexpired grant; else None."""
        ...

    def release(self, lease: Lease) -> bool:
        """Drop ``lease`` if it is the current grant (compare owner and token first)."""
        ...

    def is_current(self, resource: str, token: int) -> bool:
        """Whether ``token`` is the resource's current, unexpired grant (fencing check)."""
        ...

    def pin(self, pages: Iterable[int], holder: str) -> None: ...

    def unpin(self, pages: Iterable[int], holder: str) -> None: ...

    def pinned_by_others(self, pages: Iterable[int], holder: str) -> list[int]:
        """The pages of ``pages`` that some holder other than ``holder`` pins."""
        ...

    def pinned(self, pages: Iterable[int]) -> list[int]:
        """The pages of ``pages`` that anyone pins (what no pass may move)."""
        ...


def check_ttl_ms(ttl_ms: int) -> None:
    if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int) or ttl_ms <= 0:
        raise ValueError(f"ttl_ms must be a positive integer, got {ttl_ms!r}")


class InProcessLeaseStore:
    """``LeaseStore`` for one process; thread-safe."""

    def __init__(self, clock_ms: Callable[[], int] = monotonic_ms) -> None:
        self._clock_ms = clock_ms
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._last_token = 0
        self._pins: dict[int, dict[str, int]] = {}  # page -> holder -> count

    def _live(self, resource: str) -> Lease | None:
        lease = self._leases.get(resource)
        if lease is not None and lease.expires_at_ms <= self._clock_ms():
            del self._leases[resource]
            return None
        return lease

    def acquire(self, resource: str, owner: str, ttl_ms: int) -> Lease | None:
        check_ttl_ms(ttl_ms)
        with self._lock:
            if self._live(resource) is not None:
                return None
            self._last_token += 1
            lease = Lease(resource, owner, self._last_token, self._clock_ms() + ttl_ms)
            self._leases[resource] = lease
            return lease

    def renew(self, lease: Lease, ttl_ms: int) -> Lease | None:
        check_ttl_ms(ttl_ms)
        with self._lock:
            current = self._live(lease.resource)
            if current is None or (current.owner, current.token) != (lease.owner, lease.token):
                return None
            renewed = Lease(lease.resource, lease.owner, lease.token, self._clock_ms() + ttl_ms)
            self._leases[lease.resource] = renewed
            return renewed

    def release(self, lease: Lease) -> bool:
        with self._lock:
            current = self._live(lease.resource)
            if current is None or (current.owner, current.token) != (lease.owner, lease.token):
                return False
            del self._leases[lease.resource]
            return True

    def is_current(self, resource: str, token: int) -> bool:
        with self._lock:
            current = self._live(resource)
            return current is not None and current.token == token

    def pin(self, pages: Iterable[int], holder: str) -> None:
        with self._lock:
            for page in pages:
                holders = self._pins.setdefault(int(page), {})
                holders[holder] = holders.get(holder, 0) + 1

    def unpin(self, pages: Iterable[int], holder: str) -> None:
        wanted = Counter(int(p) for p in pages)
        with self._lock:
            short = [p for p, n in wanted.items() if self._pins.get(p, {}).get(holder, 0) < n]
            if short:  # check everything first: a bad call changes nothing
                raise ValueError(f"{holder!r} does not pin pages {sorted(short)[:8]} that often")
            for page, n in wanted.items():
                holders = self._pins[page]
                holders[holder] -= n
                if holders[holder] == 0:
                    del holders[holder]
                if not holders:
                    del self._pins[page]

    def pinned_by_others(self, pages: Iterable[int], holder: str) -> list[int]:
        with self._lock:
            return [int(p) for p in pages if any(h != holder for h in self._pins.get(int(p), {}))]

    def pinned(self, pages: Iterable[int]) -> list[int]:
        with self._lock:
            return [int(p) for p in pages if self._pins.get(int(p))]
