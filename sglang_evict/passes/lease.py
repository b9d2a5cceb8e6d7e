"""The pass lease of one scheduler and its shared-page pins: what the eviction manager
asks of the lease store (``compactor_service.leases``).

* **The pass lease** (``<holder>:pass``, a fencing token) is taken after a pass scored
  and planned, right before its moves, and released right after them, so a pass never
  loses it to its own scoring time, however long. In-process the moves follow the grant
  at once, in this process; with the sidecar, the compactor checks the token when a
  call arrives, so the TTL is at least twice a call's deadline (``ttl_ms``) and a pass
  split over several calls renews it before each further call (``claim``).
* **Outages**: an unreachable store pauses passes for ``retry_interval_s`` (they fail
  at once, touching nothing, instead of reaching for the store at every decode step);
  a release the store missed is retried before the next acquire and counted
  (``release_failures``), never undoing a commit; a pin or unpin it missed is counted
  (``pin_failures``), never raised: SGLang's lock path must not fail.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from compactor_service.compactor import LeaseClaim
from compactor_service.leases import Lease, LeaseStore
from compactor_service.redis_leases import LeaseStoreUnavailable
from sglang_evict.passes.failures import LeaseBusy

logger = logging.getLogger(__name__)


@dataclass
class PassLease:
    """The lease store as one scheduler's passes use it (``store`` None: leases off)."""

    store: LeaseStore | None
    holder: str
    ttl_ms: int
    retry_interval_s: float = 1.0
    down_until_s: float = 0.0
    unreleased: Lease | None = None
    pin_failures: int = 0  # pin/unpin calls the lease store did not take (outage)
    release_failures: int = 0  # pass leases the store did not release (outage)

    @property
    def resource(self) -> str:
        return f"{self.holder}:pass"

    def paused(self) -> bool:
        """The store was unreachable moments ago: passes fail at once until then."""
        return self.store is not None and time.monotonic() < self.down_until_s

    def note_down(self) -> None:
        self.down_until_s = time.monotonic() + self.retry_interval_s

    def check_up(self) -> None:
        """Raise ``LeaseStoreUnavailable`` (before any scoring) while paused."""
        if self.paused():
            raise LeaseStoreUnavailable(
                "the lease store was unreachable moments ago: compaction paused"
            )

    def acquire(self) -> Lease | None:
        """A fresh pass lease (None: leases off); ``LeaseStoreUnavailable`` (and a pause)
        when the store is down, ``LeaseBusy`` when another grant holds it."""
        if self.store is None:
            return None
        try:
            if self.unreleased is not None:  # a release the store missed in an outage
                self.store.release(self.unreleased)
                self.unreleased = None
            lease = self.store.acquire(self.resource, self.holder, self.ttl_ms)
        except LeaseStoreUnavailable:
            self.note_down()
            raise
        if lease is None:
            raise LeaseBusy(f"the pass lease {self.resource!r} is held: pass skipped")
        return lease

    def claim(self, lease: Lease | None) -> LeaseClaim | None:
        """What the compactor is shown: the lease, renewable for a split pass."""
        if lease is None:
            return None
        store, ttl_ms = self.store, self.ttl_ms
        return LeaseClaim(
            lease.resource,
            lease.token,
            self.holder,
            renew=lambda: store.renew(lease, ttl_ms) is not None,
        )

    def release(self, lease: Lease | None) -> None:
        """Release the pass lease; a store that cannot take it is logged and counted and
        retried before the next acquire: it never undoes or skips a commit."""
        if lease is None:
            return
        try:
            self.store.release(lease)
        except Exception as error:  # an outage of any kind
            self.release_failures += 1
            self.unreleased = lease
            self.note_down()
            logger.error("sglang-evict: pass lease not released (%s); the pass committed", error)

    def pin_pages(self, slots: Tensor, page_size: int, pin: bool) -> None:
        """Pin (or unpin) the pages holding ``slots`` under this holder's name."""
        if self.store is None or slots.numel() == 0:
            return
        pages = torch.unique(slots.to("cpu", torch.int64) // page_size).tolist()
        try:
            if pin:
                self.store.pin(pages, self.holder)
            else:
                self.store.unpin(pages, self.holder)
        except (LeaseStoreUnavailable, ValueError):
            self.pin_failures += 1
