"""The compactor's domain logic, transport-free: pools, epochs, validated passes.

``CompactorEngine`` maps each registered pool once (shared-memory file or CUDA IPC
handles, kept open for the pool's life) and applies batched passes to it:
validate every plan and the batch → check the pass's lease → run the repack kernel →
report. Nothing moves unless every check passed. The gRPC servicer
(``compactor_service.server``) is a thin layer over this class; tests drive it
in-process too.

Epochs. Every registration gets an epoch larger than any this host's compactors handed
out before (wall-clock microseconds at registration, strictly increasing within a
process), so a request carrying the epoch of a previous compactor process, or of a
pool registration that was replaced, is refused as stale.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from compactor_service import tracing
from compactor_service.compactor import (
    FAULT_POINTS,
    CompactResult,
    InProcessCompactor,
    LeaseClaim,
)
from compactor_service.leases import LeaseStore
from compactor_service.plan import CompactionPlan
from compactor_service.shared_pool import DEVICE_CUDA, PoolLayout, map_buffers


class UnknownPool(LookupError):
    """The pool id was never registered here, or was unregistered (e.g. the compactor
    restarted): the client must register again."""


class StaleEpoch(RuntimeError):
    """The request carries an epoch other than the pool's current one."""


@dataclass
class _Pool:
    pool_id: str
    epoch: int
    layout: PoolLayout
    client_id: str
    compactor: InProcessCompactor
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class EngineStats:
    passes: int = 0
    passes_rejected: int = 0
    slots_moved: int = 0
    bytes_moved: int = 0
    kernel_seconds: float = 0.0


class CompactorEngine:
    """Registered pools and the passes applied to them (thread-safe: one pass at a time
    per pool)."""

    def __init__(
        self,
        kernel: str = "auto",
        leases: LeaseStore | None = None,
        fault_hook: Callable[[str], None] | None = None,
    ) -> None:
        self.kernel = kernel
        self.leases = leases
        # Fault injection (tests): called at FAULT_POINTS of every pass; may kill the
        # process there.
        self.fault_hook = fault_hook
        self.pools: dict[str, _Pool] = {}
        self.stats = EngineStats()
        self._lock = threading.Lock()
        self._last_epoch = 0
        self.epoch_base = self._next_epoch()

    def _next_epoch(self) -> int:
        with self._lock:
            self._last_epoch = max(self._last_epoch + 1, time.time_ns() // 1000)
            return self._last_epoch

    def register_pool(self, layout: PoolLayout, client_id: str) -> tuple[str, int]:
        """Map ``layout`` (once) and return ``(pool_id, epoch)``."""
        k, v = map_buffers(layout)  # raises PoolMappingError, maps nothing on failure
        compactor = InProcessCompactor(
            k,
            v,
            kernel=self.kernel,
            leases=self.leases,
            page_size=layout.page_size,
            # The reply means the bytes landed: the scheduler reads moved slots next.
            synchronize=layout.device == DEVICE_CUDA,
        )
        pool = _Pool(
            pool_id=uuid.uuid4().hex,
            epoch=self._next_epoch(),
            layout=layout,
            client_id=client_id,
            compactor=compactor,
        )
        with self._lock:
            self.pools[pool.pool_id] = pool
        return pool.pool_id, pool.epoch

    def unregister_pool(self, pool_id: str, epoch: int) -> None:
        """Drop the pool and its mappings (the client's buffers are untouched)."""
        pool = self._pool(pool_id, epoch)
        with pool.lock, self._lock:
            self.pools.pop(pool_id, None)

    def drop_pools_of_dead_clients(self) -> list[str]:
        """Unregister pools whose client process (``client_id`` =
        ``"<name>:<host>:<pid>"``) ran on this host and no longer exists; return their
        ids. Clients on other hosts (TCP) are left alone."""
        dropped = []
        host = socket.gethostname()
        for pool in list(self.pools.values()):
            _, client_host, pid = (
                pool.client_id.rsplit(":", 2) if pool.client_id.count(":") >= 2 else ("", "", "")
            )
            if client_host == host and pid.isdigit() and not _process_alive(int(pid)):
                with pool.lock, self._lock:
                    self.pools.pop(pool.pool_id, None)
                dropped.append(pool.pool_id)
        return dropped

    def _pool(self, pool_id: str, epoch: int) -> _Pool:
        pool = self.pools.get(pool_id)
        if pool is None:
            raise UnknownPool(
                f"pool {pool_id!r} is not registered with this compactor (restarted or "
                f"unregistered): register the pool again"
            )
        if epoch != pool.epoch:
            raise StaleEpoch(
                f"epoch {epoch} is stale for pool {pool_id!r} (current {pool.epoch}): "
                f"register the pool again"
            )
        return pool

    def compact(
        self,
        pool_id: str,
        epoch: int,
        plans: Sequence[CompactionPlan],
        claim: LeaseClaim | None = None,
        still_wanted: Callable[[], bool] | None = None,
    ) -> CompactResult:
        """Validate the batch, check the lease, run the kernel. Raises (moving nothing)
        ``UnknownPool``, ``StaleEpoch``, ``PlanError``, ``LeaseRefused``, or
        ``PassAbandoned`` when ``still_wanted()`` is false once the pass's turn has come
        (checked after waiting for the pool and the checks, right before the kernel)."""
        with tracing.tracer().start_as_current_span(tracing.SPAN_COMPACT) as span:
            try:
                pool = self._pool(pool_id, epoch)
                with pool.lock:
                    result = pool.compactor.compact(
                        plans, claim, still_wanted=still_wanted, fault=self.fault_hook
                    )
            except Exception:
                self.stats.passes_rejected += 1
                raise
            self.stats.passes += 1
            self.stats.slots_moved += result.slots_moved
            self.stats.bytes_moved += result.bytes_moved
            self.stats.kernel_seconds += result.kernel_s
            span.set_attribute(tracing.ATTR_SLOTS_MOVED, result.slots_moved)
            span.set_attribute(tracing.ATTR_BYTES_MOVED, result.bytes_moved)
            span.set_attribute(tracing.ATTR_KERNEL, result.kernel)
            span.set_attribute(tracing.ATTR_EPOCH, epoch)
            return result


def random_kill_hook(seed: int, probability: float) -> Callable[[str], None]:
    """A fault hook that SIGKILLs this process at a random point of a pass: each pass
    is struck with ``probability``, at one of ``FAULT_POINTS`` chosen uniformly."""
    import random
    import signal

    rng = random.Random(seed)
    target: list[str | None] = [None]

    def hook(point: str) -> None:
        if point == FAULT_POINTS[0]:
            target[0] = rng.choice(FAULT_POINTS) if rng.random() < probability else None
        if point == target[0]:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
