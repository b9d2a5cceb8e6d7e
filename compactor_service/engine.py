"""The compactor's domain logic, transport-free: pools, epochs, leases of registrations,
validated passes.

``CompactorEngine`` opens each registered pool once (a file of its pool directory, copied
through its descriptor, or CUDA IPC handles; kept open for the pool's life) and applies
batched passes to it: validate every plan and the batch → check the pass's lease →
enter the pool's fence (``compactor_service.fence``) → run the repack kernel → report.
Nothing moves unless every check passed; what the checks can and cannot establish about
slot ownership is listed in ``compactor_service.plan``. The gRPC servicer
(``compactor_service.servicer``) is a thin layer over this class; tests drive it
in-process too.

Epochs. Every registration gets an epoch larger than any this host's compactors handed
out before (wall-clock microseconds at registration, strictly increasing within a
process), so a request carrying the epoch of a previous compactor process, or of a
pool registration that was replaced, is refused as stale.

Registrations are leases. A pool lives ``limits.pool_lease_s`` after its registration or
its last call (``compact``, ``heartbeat``); ``drop_expired_pools`` (the server's reaper)
unregisters the rest, so the pools of a client that is gone are dropped whatever it
called itself. Registrations are bounded per client id and in all (``ServerLimits``).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from compactor_service import tracing
from compactor_service.compactor import (
    FAULT_POINTS,
    CompactResult,
    FileCompactor,
    InProcessCompactor,
    LeaseClaim,
)
from compactor_service.fence import CompactorFence
from compactor_service.leases import LeaseStore
from compactor_service.limits import LimitExceeded, ServerLimits, clip
from compactor_service.plan import CompactionPlan, PlanError
from compactor_service.shared_arena import (
    ArenaFile,
    ArenaLayout,
    ArenaMappingError,
    CudaArena,
    open_arena_file,
    open_cuda_arena,
)
from compactor_service.shared_pool import (
    DEVICE_CUDA,
    PoolDirectory,
    PoolFile,
    PoolFileRefused,
    PoolFileTruncated,
    PoolLayout,
)
from sglang_evict_kernels import guarded_copy
from sglang_evict_kernels.tier_quant import quantize_function

MAX_CLIENT_ID_CHARS = 256


def open_pool(layout: PoolLayout, pool_dir: PoolDirectory | None) -> PoolFile | tuple:
    """What the compactor copies in: a CPU pool's ``PoolFile`` (from ``pool_dir``), or a
    CUDA pool's ``(k_buffers, v_buffers)``. Raises ``PoolMappingError`` (or a subclass)
    and opens nothing on any failed check."""
    layout.validate()
    if layout.device == DEVICE_CUDA:
        from compactor_service.cuda_ipc import map_cuda_buffers  # CUDA pools only

        return map_cuda_buffers(layout)
    if pool_dir is None:
        raise PoolFileRefused("this compactor has no pool directory: CPU pools are refused")
    return pool_dir.open_pool(layout)


class UnknownPool(LookupError):
    """The pool id was never registered here, or was unregistered or expired (e.g. the
    compactor restarted): the client must register again."""


class StaleEpoch(RuntimeError):
    """The request carries an epoch other than the pool's current one."""


class BadClientId(ValueError):
    """A client id the compactor will not record."""


@dataclass
class _Pool:
    pool_id: str
    epoch: int
    layout: PoolLayout
    client_id: str
    compactor: InProcessCompactor
    expires_at_s: float
    # The pool's fence (``compactor_service.fence``); None: a client that registered
    # none gets the deadline check alone.
    fence: CompactorFence | None = None
    # The pool's tier arena (``compactor_service.shared_arena``), once registered.
    arena: ArenaFile | CudaArena | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        """Drop what the pool holds open (its file, its fence, its arena's file); the
        client's memory is untouched."""
        if isinstance(self.compactor, FileCompactor):
            self.compactor.pool_file.close()
        if self.fence is not None:
            self.fence.close()
        if self.arena is not None:
            self.arena.close()


@dataclass
class EngineStats:
    passes: int = 0
    passes_rejected: int = 0
    slots_moved: int = 0
    bytes_moved: int = 0
    kernel_seconds: float = 0.0
    pools_expired: int = 0
    groups_demoted: int = 0  # tier groups quantized into arenas (trash included)


class CompactorEngine:
    """Registered pools and the passes applied to them (thread-safe: one pass at a time
    per pool)."""

    def __init__(
        self,
        kernel: str = "auto",
        leases: LeaseStore | None = None,
        fault_hook: Callable[[str], None] | None = None,
        *,
        pool_dir: PoolDirectory | None = None,
        limits: ServerLimits | None = None,
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kernel = kernel
        self.leases = leases
        # Fault injection (tests): called at FAULT_POINTS of every pass; may kill the
        # process there.
        self.fault_hook = fault_hook
        self.pool_dir = pool_dir
        self.limits = limits or ServerLimits()
        self._clock_s = clock_s
        self.pools: dict[str, _Pool] = {}
        self.stats = EngineStats()
        self._lock = threading.Lock()
        self._last_epoch = 0
        self.epoch_base = self._next_epoch()
        if pool_dir is not None:  # CPU pool files: copies through a guarded mapping
            guarded_copy.start_loading()

    def _next_epoch(self) -> int:
        with self._lock:
            self._last_epoch = max(self._last_epoch + 1, time.time_ns() // 1000)
            return self._last_epoch

    def _check_room(self, client_id: str) -> None:
        """Refuse (``LimitExceeded``) a registration over the bounds; call under the lock."""
        limits = self.limits
        if len(self.pools) >= limits.max_pools:
            raise LimitExceeded(
                f"the compactor holds {len(self.pools)} pools (--max-pools "
                f"{limits.max_pools}); unregister pools or wait for idle ones to expire"
            )
        held = sum(p.client_id == client_id for p in self.pools.values())
        if held >= limits.max_pools_per_client:
            raise LimitExceeded(
                f"client {clip(client_id)} holds {held} pools (--max-pools-per-client "
                f"{limits.max_pools_per_client}); unregister one or let it expire"
            )

    def register_pool(
        self, layout: PoolLayout, client_id: str, fence_file: str = ""
    ) -> tuple[str, int]:
        """Open ``layout`` (once) and its ``fence_file`` (when given) and return
        ``(pool_id, epoch)``."""
        if len(client_id) > MAX_CLIENT_ID_CHARS:
            raise BadClientId(
                f"client_id {clip(client_id)} is longer than {MAX_CLIENT_ID_CHARS} characters"
            )
        with self._lock:
            self._check_room(client_id)  # cheap refusal before any mapping
        fence = None
        if fence_file:
            if self.pool_dir is None:
                raise PoolFileRefused("this compactor has no pool directory: fences are refused")
            fence = CompactorFence(self.pool_dir.open_fence_file(fence_file))
        try:
            opened = open_pool(layout, self.pool_dir)  # raises PoolMappingError
        except BaseException:
            if fence is not None:
                fence.close()
            raise
        if isinstance(opened, PoolFile):
            compactor = FileCompactor(opened, leases=self.leases, page_size=layout.page_size)
        else:
            compactor = InProcessCompactor(
                *opened,
                kernel=self.kernel,
                leases=self.leases,
                page_size=layout.page_size,
                # The reply means the bytes landed: the scheduler reads moved slots next.
                synchronize=layout.device == DEVICE_CUDA,
            )
        epoch = self._next_epoch()
        pool = _Pool(
            pool_id=uuid.uuid4().hex,
            epoch=epoch,
            layout=layout,
            client_id=client_id,
            compactor=compactor,
            expires_at_s=self._clock_s() + self.limits.pool_lease_s,
            fence=fence,
        )
        with self._lock:
            try:
                self._check_room(client_id)  # a concurrent registration may have taken it
            except LimitExceeded:
                pool.close()
                raise
            self.pools[pool.pool_id] = pool
        return pool.pool_id, pool.epoch

    def register_arena(self, pool_id: str, epoch: int, layout: ArenaLayout) -> int:
        """Open the tier arena of a registered pool (once: a pool has one arena for its
        registration's life) after ``ArenaLayout``'s checks; return its bytes. A refusal
        (``ArenaMappingError`` and the pool directory's) leaves nothing open."""
        pool = self.pool(pool_id, epoch)
        layout.validate()
        layout.check_matches(pool.layout)
        if layout.device == DEVICE_CUDA:
            return self._register_cuda_arena(pool, layout)
        if self.pool_dir is None:
            raise PoolFileRefused("this compactor has no pool directory: arenas are refused")
        with pool.lock:
            self._check_no_arena(pool)
            fd = open_arena_file(self.pool_dir, layout)
            try:
                if isinstance(pool.compactor, FileCompactor):
                    mine, theirs = os.fstat(fd), os.fstat(pool.compactor.pool_file.fd)
                    if (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino):
                        raise PoolFileRefused(
                            f"arena.shm_path {clip(layout.shm_path)} is the pool's own file: "
                            f"an arena may not overlap its pool"
                        )
            except BaseException:
                os.close(fd)
                raise
            pool.arena = ArenaFile(fd, layout)
            pool.compactor.attach_arena_file(pool.arena)
            self._renew(pool)
        # Load (on a new machine: build) the tier's CPU quantizer now, not inside the
        # first demotion's deadline.
        quantize_function("cpu")
        return layout.file_bytes

    @staticmethod
    def _check_no_arena(pool: _Pool) -> None:
        if pool.arena is not None:
            raise ArenaMappingError(
                f"pool {clip(pool.pool_id)} has its arena already: register the pool again "
                f"to give it another"
            )

    def _register_cuda_arena(self, pool: _Pool, layout: ArenaLayout) -> int:
        """A CUDA pool's arena, opened by IPC (``shared_arena.open_cuda_arena``); its
        demotions run the tier's quantizer on the pool's device (not run in CI)."""
        with pool.lock:
            self._check_no_arena(pool)
            arena = open_cuda_arena(layout)
            pool.arena = arena
            pool.compactor.attach_arena(arena.stores, layout.format())
            self._renew(pool)
        return layout.file_bytes

    def unregister_pool(self, pool_id: str, epoch: int) -> None:
        """Drop the pool and its mappings (the client's buffers are untouched)."""
        pool = self.pool(pool_id, epoch)
        with pool.lock, self._lock:
            if self.pools.pop(pool_id, None) is not None:
                pool.close()

    def heartbeat(self, pool_id: str, epoch: int) -> float:
        """Renew the pool's lease; return its length in seconds."""
        self._renew(self.pool(pool_id, epoch))
        return self.limits.pool_lease_s

    def _renew(self, pool: _Pool) -> None:
        pool.expires_at_s = self._clock_s() + self.limits.pool_lease_s

    def drop_expired_pools(self) -> list[str]:
        """Unregister pools whose lease ran out (no call within ``pool_lease_s``); return
        their ids. A pool whose pass is running is renewed by that pass, not dropped."""
        now = self._clock_s()
        dropped = []
        for pool in list(self.pools.values()):
            if pool.expires_at_s > now or not pool.lock.acquire(blocking=False):
                continue
            try:
                with self._lock:
                    if pool.expires_at_s <= now and self.pools.pop(pool.pool_id, None):
                        pool.close()
                        dropped.append(pool.pool_id)
                        self.stats.pools_expired += 1
            finally:
                pool.lock.release()
        return dropped

    def pool(self, pool_id: str, epoch: int) -> _Pool:
        """The registered pool, or ``UnknownPool``/``StaleEpoch``."""
        pool = self.pools.get(pool_id)
        if pool is None:
            raise UnknownPool(
                f"pool {clip(pool_id)} is not registered with this compactor (restarted, "
                f"unregistered or expired): register the pool again"
            )
        if epoch != pool.epoch:
            raise StaleEpoch(
                f"epoch {epoch} is stale for pool {clip(pool_id)} (current {pool.epoch}): "
                f"register the pool again"
            )
        return pool

    def check_call_size(self, num_plans: int, num_moves: int) -> None:
        """Refuse (``LimitExceeded``) a call over the per-call bounds, before any plan is
        decoded."""
        limits = self.limits
        if num_plans > limits.max_plans_per_call:
            raise LimitExceeded(
                f"{num_plans} plans in one call, more than --max-plans-per-call "
                f"{limits.max_plans_per_call}; split the batch"
            )
        if num_moves > limits.max_moves_per_call:
            raise LimitExceeded(
                f"{num_moves} slot moves in one call, more than --max-moves-per-call "
                f"{limits.max_moves_per_call}; split the batch"
            )

    def compact(
        self,
        pool_id: str,
        epoch: int,
        plans: Sequence[CompactionPlan],
        claim: LeaseClaim | None = None,
        still_wanted: Callable[[], bool] | None = None,
        call_seq: int = 0,
    ) -> CompactResult:
        """Validate the batch, check the lease, run the kernel inside the pool's fence
        (``call_seq``: the call's number in its client's fence). Raises (moving nothing)
        ``UnknownPool``, ``StaleEpoch``, ``LimitExceeded``, ``PlanError``,
        ``LeaseRefused``, or ``PassAbandoned`` when ``still_wanted()`` turns false (asked
        between plans during validation and right before the kernel) or the client
        revoked the call; ``PoolFileTruncated`` (the pool is dropped) may come after
        part of the copy."""
        with tracing.tracer().start_as_current_span(tracing.SPAN_COMPACT) as span:
            try:
                pool = self.pool(pool_id, epoch)
                self._renew(pool)
                self.check_call_size(len(plans), sum(p.num_moves for p in plans))
                fence = None
                if pool.fence is not None:
                    if call_seq < 1:
                        raise PlanError(
                            "call_seq must be >= 1: this pool was registered with a fence"
                        )
                    fence = functools.partial(pool.fence.hold, call_seq, still_wanted)
                with pool.lock:
                    result = pool.compactor.compact(
                        plans,
                        claim,
                        still_wanted=still_wanted,
                        fault=self.fault_hook,
                        fence=fence,
                    )
            except PoolFileTruncated:
                self.stats.passes_rejected += 1
                with self._lock:
                    if self.pools.pop(pool_id, None) is not None:
                        pool.close()
                raise
            except Exception:
                self.stats.passes_rejected += 1
                raise
            self.stats.passes += 1
            self.stats.slots_moved += result.slots_moved
            self.stats.bytes_moved += result.bytes_moved
            self.stats.kernel_seconds += result.kernel_s
            self.stats.groups_demoted += result.groups_demoted
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
            signal.pthread_kill(threading.get_ident(), signal.SIGKILL)  # before one more line

    return hook


def random_stop_hook(seed: int, probability: float) -> Callable[[str], None]:
    """A fault hook that stops this process (SIGSTOP; a test continues it) at a point of
    a pass: each pass is struck with ``probability``, at each of ``FAULT_POINTS`` in
    turn, so that a run stalls the compactor at every point of its pass."""
    import random
    import signal

    rng = random.Random(seed)
    strikes = [0]
    target: list[str | None] = [None]

    def hook(point: str) -> None:
        if point == FAULT_POINTS[0]:
            target[0] = None
            if rng.random() < probability:
                target[0] = FAULT_POINTS[strikes[0] % len(FAULT_POINTS)]
                strikes[0] += 1
        if point == target[0]:
            logging.getLogger("sglang_evict.compactor").warning(
                "fault injection: stopping the compactor", extra={"point": point}
            )
            # Sent to this thread: it stops before running one more line of the pass. A
            # signal sent to the process wakes the main thread first, and this thread
            # could finish its copy before the group stop reaches it.
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)

    return hook
