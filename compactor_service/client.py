"""The scheduler's side of the sidecar: ``GrpcCompactor`` and ``FallbackCompactor``.

Both implement the ``Compactor`` protocol, so the eviction manager does not know which
compactor it talks to. A pass is two-phase: ``compact`` returns only after the moves
landed, and only then does the caller commit rows and free pages. If the sidecar dies,
times out, restarted or dropped the registration (unknown pool, stale epoch),
``GrpcCompactor`` re-registers once, else raises
``CompactorUnavailable``: the committed rows still hold every survivor intact (the
planner's invariant 3: no move writes a slot the committed row still needs; moves are
independent and idempotent), so ``FallbackCompactor`` completes the very same plans
in-process and the pass commits as if nothing happened.

Fallback modes (``--kv-compactor-fallback``):

    inprocess  every pass the sidecar cannot complete runs in-process (default)
    skip       while the sidecar is known to be down (a failure, until a health check
               succeeds again, at most every ``retry_interval_s``), passes are skipped
               before anything is planned to move: the requests keep their full KV.
               A pass already sent when the sidecar fails is still completed
               in-process: its evicted slots may be partly overwritten, so it cannot
               be abandoned.

A call the client gave up on (deadline, broken connection, any failure) is revoked in
the pool's fence (``compactor_service.fence``) before anything else happens: once
``revoke`` returns, that call's kernel has either finished or will never start, so the
in-process completion and the pages it frees cannot be overwritten by a late copy; and
the fence says which of the two it was, so a call whose kernel never started counts as
having moved nothing. A pass split over several calls (``split_batch``) whose later
call fails has moved the earlier calls' slots: it raises ``PassPartlyDone``, which the
caller completes in-process from the same plans whatever the failure.

A pass that demotes into the tier's arena is sent in two phases
(``compactor.in_two_phases``): its demotions, then its moves. A failed demotion call
moved nothing (``CompactorUnavailable.moved`` is False for it): ``FallbackCompactor``
demotes in-process from the unchanged pool, and the moves follow as any pass's.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from compactor_service.compactor import (
    CAUSE_LEASE_STORE_DOWN,
    CAUSE_METADATA_KEY,
    CompactionSkipped,
    Compactor,
    CompactorUnavailable,
    CompactResult,
    LeaseClaim,
    LeaseRefused,
    PassPartlyDone,
    in_two_phases,
    nothing_moved,
)
from compactor_service.fence import ClientFence
from compactor_service.health import check_health
from compactor_service.plan import CompactionPlan, PlanError
from compactor_service.redis_leases import LeaseStoreUnavailable
from compactor_service.shared_arena import ArenaLayout
from compactor_service.shared_pool import DEVICE_CPU, PoolLayout
from compactor_service.tls import open_channel
from compactor_service.v1 import compactor_pb2 as pb
from compactor_service.v1 import compactor_pb2_grpc as pb_grpc
from compactor_service.wire import (
    arena_layout_to_proto,
    claim_to_proto,
    layout_to_proto,
    plan_to_proto,
)

logger = logging.getLogger("sglang_evict.compactor.client")
FALLBACK_MODES = ("inprocess", "skip")
# The contract's failures, defined with it (grpc-free) and re-exported here.
__all__ = [
    "CompactionSkipped",
    "CompactorUnavailable",
    "FallbackCompactor",
    "GrpcCompactor",
    "PassPartlyDone",
    "nothing_moved",
]


# Statuses of RegisterPool that say the pool itself is refused (a configuration problem:
# retrying will not help), as opposed to the compactor being unreachable.
_POOL_REFUSED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
)
# The sidecar is local and a supervised one restarts in milliseconds: reconnect within
# 0.1-1 s instead of gRPC's default backoff (1 s growing to 120 s). Not
# ``grpc.min_reconnect_backoff_ms``: gRPC takes it as the minimum time a connection
# attempt is given, so 100 ms there failed every call at once (UNAVAILABLE, "connection
# attempt timed out before receiving SETTINGS frame") whenever a loaded host's sidecar
# answered a new connection late; its default (20 s) leaves each call's own deadline in
# charge. The compactor bounds message sizes itself (and says how at registration).
_CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", -1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
# Headroom of a Compact message over its plans' own sizes (pool id, claim, framing).
_REQUEST_OVERHEAD_BYTES = 4096


@dataclass(frozen=True)
class CallLimits:
    """What the compactor accepts per call (it says so at registration)."""

    max_plans_per_call: int
    max_moves_per_call: int
    max_message_bytes: int
    lease_s: float


def split_batch(plans: Sequence[pb.Plan], limits: CallLimits) -> list[list[pb.Plan]]:
    """``plans`` in consecutive calls that each stay within ``limits``. Splitting is
    safe: plans of one pass are independent and each call is validated on its own; a
    single plan over a bound is sent alone (the compactor refuses it, and the pass is
    completed in-process)."""
    chunks: list[list[pb.Plan]] = [[]]
    moves = size = 0
    for plan in plans:
        # A demoted token costs the compactor about what a move does: counted as one.
        plan_moves = (len(plan.src_slots_le64) + len(plan.demote_slots_le64)) // 8
        plan_size = plan.ByteSize() + 16
        chunk = chunks[-1]
        if chunk and (
            len(chunk) >= limits.max_plans_per_call
            or moves + plan_moves > limits.max_moves_per_call
            or size + plan_size + _REQUEST_OVERHEAD_BYTES > limits.max_message_bytes
        ):
            chunks.append([])
            moves = size = 0
        chunks[-1].append(plan)
        moves += plan_moves
        size += plan_size
    return chunks


class GrpcCompactor:
    """Sends passes to the sidecar at ``target`` over the pool described by ``layout``.

    Registers the pool on first use and again after the sidecar restarted or the
    registration expired (a refused call moved nothing, so it is retried once after
    re-registering). While registered, a daemon thread renews the registration's lease
    (``Heartbeat``, every third of the lease) so an idle scheduler keeps its pool.
    ``credentials``: TLS for a TCP target (``tls.channel_credentials``). ``fence_dir``:
    the compactor's pool directory, where the pool's fence file is created (default: the
    directory of a CPU pool's file; a CUDA pool without it has no fence). ``arena``: the
    tier arena (``shared_arena``) registered after the pool, every time it registers.
    """

    def __init__(
        self,
        target: str,
        layout: PoolLayout,
        *,
        timeout_s: float = 1.0,
        register_timeout_s: float = 10.0,
        client_id: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        fence_dir: str | os.PathLike | None = None,
        arena: ArenaLayout | None = None,
    ) -> None:
        from opentelemetry.instrumentation.grpc import client_interceptor
        from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

        self.target = target
        self.layout = layout
        self.timeout_s = timeout_s
        self.register_timeout_s = register_timeout_s
        self.client_id = client_id or f"scheduler:{socket.gethostname()}:{os.getpid()}"
        self.credentials = credentials
        # The instrumentation carries the W3C traceparent in the call's metadata.
        self._raw_channel = open_channel(target, credentials, options=_CHANNEL_OPTIONS)
        self._channel = intercept_channel(self._raw_channel, client_interceptor())
        self._stub = pb_grpc.CompactorStub(self._channel)
        self.pool_id: str | None = None
        self.epoch: int | None = None
        self.limits: CallLimits | None = None
        self._layout_proto = layout_to_proto(layout)
        self.arena = arena
        self._arena_proto = arena_layout_to_proto(arena) if arena is not None else None
        self._closed = threading.Event()
        self._heartbeat: threading.Thread | None = None
        if fence_dir is None and layout.device == DEVICE_CPU:
            fence_dir = os.path.dirname(layout.k_buffers[0].shm_path)
        self.fence = ClientFence(fence_dir) if fence_dir is not None else None

    def register(self) -> tuple[str, int]:
        try:
            reply = self._stub.RegisterPool(
                pb.RegisterPoolRequest(
                    layout=self._layout_proto,
                    client_id=self.client_id,
                    fence_file=str(self.fence.path) if self.fence is not None else "",
                ),
                timeout=self.register_timeout_s,
            )
        except grpc.RpcError as error:
            if error.code() in _POOL_REFUSED:
                raise ValueError(
                    f"the compactor refused the pool ({error.code().name}): {error.details()}"
                ) from None
            raise CompactorUnavailable(
                f"cannot register the KV pool with the compactor at {self.target}: "
                f"{error.code().name} {error.details()}"
            ) from None
        if self._arena_proto is not None:
            self._register_arena(reply.pool_id, reply.epoch)
        self.pool_id, self.epoch = reply.pool_id, reply.epoch
        self.limits = CallLimits(
            max_plans_per_call=max(1, reply.limits.max_plans_per_call),
            max_moves_per_call=max(1, reply.limits.max_moves_per_call),
            max_message_bytes=max(1, reply.limits.max_message_bytes),
            lease_s=reply.limits.lease_ms / 1000,
        )
        logger.info("KV pool registered with the compactor", extra={"epoch": reply.epoch})
        if self._heartbeat is None and self.limits.lease_s > 0:
            self._heartbeat = threading.Thread(
                target=self._beat, daemon=True, name="compactor-heartbeat"
            )
            self._heartbeat.start()
        return self.pool_id, self.epoch

    def attach_arena(self, arena: ArenaLayout) -> None:
        """Register ``arena`` (the pool's tier arena) now if the pool is registered, and
        after every registration from now on."""
        self.arena = arena
        self._arena_proto = arena_layout_to_proto(arena)
        if self.pool_id is not None:
            try:
                self._register_arena(self.pool_id, self.epoch)
            except CompactorUnavailable:
                self.pool_id = None  # the next call registers the pool and its arena
                raise

    def _register_arena(self, pool_id: str, epoch: int) -> None:
        try:
            self._stub.RegisterArena(
                pb.RegisterArenaRequest(pool_id=pool_id, epoch=epoch, layout=self._arena_proto),
                timeout=self.register_timeout_s,
            )
        except grpc.RpcError as error:
            if error.code() in _POOL_REFUSED:
                raise ValueError(
                    f"the compactor refused the tier arena ({error.code().name}): {error.details()}"
                ) from None
            raise CompactorUnavailable(
                f"cannot register the tier arena with the compactor at {self.target}: "
                f"{error.code().name} {error.details()}"
            ) from None

    def _beat(self) -> None:
        """Renew the registration every third of its lease until ``close``. A failed
        beat changes nothing: the next pass re-registers if the pool is gone."""
        while not self._closed.wait(self.limits.lease_s / 3):
            pool_id, epoch = self.pool_id, self.epoch
            if pool_id is None:
                continue
            try:
                self._stub.Heartbeat(
                    pb.HeartbeatRequest(pool_id=pool_id, epoch=epoch), timeout=self.timeout_s
                )
            except grpc.RpcError:
                pass

    def compact(
        self, plans: Sequence[CompactionPlan], claim: LeaseClaim | None = None
    ) -> CompactResult:
        """Send the pass: a pass that demotes as two (``compactor.in_two_phases``: its
        demotions, then its moves), each split into calls within the compactor's
        limits (``_send``)."""
        return in_two_phases(self._send, plans, claim)

    def _send(
        self, plans: Sequence[CompactionPlan], claim: LeaseClaim | None = None
    ) -> CompactResult:
        """Send plans, split into calls within the compactor's limits. A failure of
        the first call raises what it was (nothing moved unless the fence says its
        kernel started: ``CompactorUnavailable.moved``); a failure after a call moved
        slots raises ``PassPartlyDone``. Calls that only demote never move a slot:
        their failures say nothing moved (the arena slots they wrote are read by
        nobody until the caller commits). Before every call after the first, the
        pass's lease is renewed (``claim.renew``): a lease that cannot be renewed is a
        failure after a call moved slots."""
        if self.pool_id is None:
            self.register()
        messages = [plan_to_proto(p) for p in plans]
        chunks = split_batch(messages, self.limits)
        moves = any(p.num_moves for p in plans)
        results = []
        for index, chunk in enumerate(chunks):
            try:
                if index and claim is not None and not claim.renewed():
                    raise LeaseRefused(
                        f"the pass's lease {claim.resource!r} could not be renewed before "
                        f"its call {index + 1} of {len(chunks)}"
                    )
                results.append(self._compact_call(chunk, claim, moves))
            except Exception as error:
                if index == 0 or not moves:
                    raise
                raise PassPartlyDone(
                    f"call {index + 1} of the {len(chunks)} calls of a split pass failed "
                    f"after the earlier ones moved slots ({type(error).__name__}: {error})"
                ) from error
        return CompactResult(
            slots_moved=sum(r.slots_moved for r in results),
            bytes_moved=sum(r.bytes_moved for r in results),
            duration_s=sum(r.duration_s for r in results),
            kernel=results[0].kernel,
            groups_demoted=sum(r.groups_demoted for r in results),
        )

    def _compact_call(
        self, plans: list[pb.Plan], claim: LeaseClaim | None, moves: bool = True
    ) -> CompactResult:
        for attempt in (0, 1):
            call_seq = self.fence.next_seq() if self.fence is not None else 0
            request = pb.CompactRequest(
                pool_id=self.pool_id,
                epoch=self.epoch,
                claim=claim_to_proto(claim),
                plans=plans,
                call_seq=call_seq,
            )
            try:
                reply = self._stub.Compact(request, timeout=self.timeout_s)
            except grpc.RpcError as error:
                # Whatever happened, this call's kernel must not start from now on.
                moved = self.fence.revoke(call_seq) if self.fence is not None else True
                moved = moved and moves  # a call that only demotes moves no slot
                code = error.code()
                if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                    # Restarted compactor, expired or replaced registration: nothing moved.
                    self.pool_id = None
                    if attempt == 0:
                        self.register()
                        continue
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise PlanError(f"the compactor refused the pass: {error.details()}") from None
                if code == grpc.StatusCode.ABORTED:
                    raise LeaseRefused(error.details()) from None
                if code == grpc.StatusCode.UNAVAILABLE and _lease_store_down(error):
                    raise LeaseStoreUnavailable(
                        f"the compactor's lease store is unreachable: {error.details()}"
                    ) from None
                raise CompactorUnavailable(
                    f"the compactor at {self.target} did not complete the pass: "
                    f"{code.name} {error.details()}",
                    moved=moved,
                ) from None
            return CompactResult(
                slots_moved=reply.slots_moved,
                bytes_moved=reply.bytes_moved,
                duration_s=reply.duration_s,
                kernel=reply.kernel,
                groups_demoted=reply.groups_demoted,
            )
        raise AssertionError("unreachable")  # pragma: no cover

    def healthy(self, timeout_s: float | None = None) -> bool:
        """Whether the sidecar answers its health check within ``timeout_s`` (default:
        a pass's deadline, ``timeout_s``: a loaded host's sidecar is as slow to both)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        return check_health(self.target, timeout_s=timeout_s, credentials=self.credentials)

    def close(self) -> None:
        self._closed.set()
        if self.pool_id is not None:
            try:
                self._stub.UnregisterPool(
                    pb.UnregisterPoolRequest(pool_id=self.pool_id, epoch=self.epoch), timeout=1.0
                )
            except grpc.RpcError:
                pass  # the registration expires anyway
        self._raw_channel.close()
        if self.fence is not None:
            self.fence.close()


class FallbackCompactor:
    """The sidecar first; passes it cannot complete run on ``fallback`` (in-process)."""

    def __init__(
        self,
        primary: GrpcCompactor,
        fallback: Compactor,
        *,
        mode: str = "inprocess",
        retry_interval_s: float = 5.0,
        clock_s=time.monotonic,
    ) -> None:
        if mode not in FALLBACK_MODES:
            raise ValueError(f"unknown compactor fallback {mode!r}; known: {list(FALLBACK_MODES)}")
        self.primary = primary
        self.fallback = fallback
        self.mode = mode
        self.retry_interval_s = retry_interval_s
        self._clock_s = clock_s
        self._down_since: float | None = None
        self._last_probe = 0.0
        self._lock = threading.Lock()
        self.sidecar_passes = 0
        self.fallback_passes = 0  # passes whose moves ran in-process
        self.fallback_demotions = 0  # demotions (a pass's first phase) run in-process
        self.fallbacks_by_cause: Counter[str] = Counter()  # "pass:sidecar-down", ...
        self.skipped_passes = 0

    def attach_arena(self, stores: Sequence, fmt, layout: ArenaLayout) -> None:
        """The pool's tier arena: its layout registered with the sidecar, its stores
        (this process's mapping of the same memory) given to the in-process fallback,
        so that a demotion runs the same on either."""
        self.fallback.attach_arena(stores, fmt)
        try:
            self.primary.attach_arena(layout)
        except CompactorUnavailable as error:  # registered at its next registration
            logger.warning("%s; registering it when the sidecar is back", error)

    @property
    def sidecar_up(self) -> bool:
        return self._down_since is None

    def _sidecar_usable(self) -> bool:
        if self._down_since is None:
            return True
        now = self._clock_s()
        if now - self._last_probe < self.retry_interval_s:
            return False
        self._last_probe = now
        if self.primary.healthy():
            logger.info("compactor is back: passes go to the sidecar again")
            self._down_since = None
            return True
        return False

    def compact(
        self, plans: Sequence[CompactionPlan], claim: LeaseClaim | None = None
    ) -> CompactResult:
        """The pass on the sidecar, a pass that demotes in two phases
        (``compactor.in_two_phases``), each phase falling back on its own: a demotion
        that fails on the sidecar is done in-process from the unchanged pool, and the
        moves then follow wherever the sidecar's state sends them."""
        return in_two_phases(self._compact_once, plans, claim)

    def _fell_back(self, plans: Sequence[CompactionPlan], cause: str) -> None:
        demotes = any(p.num_demoted_groups for p in plans)
        kind = "demotion" if demotes and not any(p.num_moves for p in plans) else "pass"
        if kind == "pass":
            self.fallback_passes += 1
        else:
            self.fallback_demotions += 1
        self.fallbacks_by_cause[f"{kind}:{cause}"] += 1

    def _compact_once(
        self, plans: Sequence[CompactionPlan], claim: LeaseClaim | None = None
    ) -> CompactResult:
        with self._lock:
            if not self._sidecar_usable():
                if self.mode == "skip":
                    self.skipped_passes += 1
                    raise CompactionSkipped(
                        "the compactor sidecar is down and --kv-compactor-fallback is skip: "
                        "pass skipped, nothing moved"
                    )
                self._fell_back(plans, "sidecar-down")
                return self.fallback.compact(plans, claim)
            try:
                result = self.primary.compact(plans, claim)
            except CompactorUnavailable as error:
                self._down_since = self._last_probe = self._clock_s()
                self._fell_back(plans, "sidecar-failed")
                logger.error("%s; completing the pass in-process", error)
                try:
                    return self.fallback.compact(plans, claim)
                except Exception as refusal:
                    if not error.moved:
                        raise  # the sidecar moved nothing: the refusal stands
                    raise PassPartlyDone(
                        f"the sidecar's call may have moved slots, and the in-process "
                        f"completion was refused ({type(refusal).__name__}: {refusal})"
                    ) from refusal
            self.sidecar_passes += 1
            return result


def _lease_store_down(error: grpc.RpcError) -> bool:
    """The compactor said its lease store is down (it moved nothing), as opposed to the
    compactor itself being unreachable."""
    metadata = getattr(error, "trailing_metadata", lambda: None)() or ()
    return any(
        key == CAUSE_METADATA_KEY and value == CAUSE_LEASE_STORE_DOWN for key, value in metadata
    )
