"""The scheduler's side of the sidecar: ``GrpcCompactor`` and ``FallbackCompactor``.

Both implement the ``Compactor`` protocol, so the eviction manager does not know which
compactor it talks to. A pass is two-phase: ``compact`` returns only after the moves
landed, and only then does the caller commit rows and free pages. If the sidecar dies,
times out or restarted (unknown pool, stale epoch), ``GrpcCompactor`` raises
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

Limitation: a sidecar that is alive but past the client's deadline may still be
running its kernel when the fallback completes the pass; both write the same bytes
(same plan), but pages freed by the commit could be reused before the late kernel
ends. The server checks, right before the kernel (after any wait for the pool), that
the caller is still waiting, and moves nothing otherwise; so only a kernel already
running when the deadline passes can be late. Set the timeout well above the kernel
time (``bench_compactor.py`` reports it).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence

import grpc

from compactor_service.compactor import Compactor, CompactResult, LeaseClaim, LeaseRefused
from compactor_service.health import check_health
from compactor_service.plan import CompactionPlan, PlanError
from compactor_service.shared_pool import PoolLayout
from compactor_service.v1 import compactor_pb2 as pb
from compactor_service.v1 import compactor_pb2_grpc as pb_grpc
from compactor_service.wire import claim_to_proto, layout_to_proto, plan_to_proto

logger = logging.getLogger("sglang_evict.compactor.client")
FALLBACK_MODES = ("inprocess", "skip")


class CompactorUnavailable(RuntimeError):
    """The sidecar did not complete the pass (dead, timed out, restarted). Survivors are
    intact; the same plans may be completed elsewhere."""


class CompactionSkipped(RuntimeError):
    """The sidecar is down and the fallback mode is ``skip``: nothing was planned to
    move, the requests keep their full KV."""


class GrpcCompactor:
    """Sends passes to the sidecar at ``target`` over the pool described by ``layout``.

    Registers the pool on first use and again after the sidecar restarted (a refused
    call moved nothing, so it is retried once after re-registering).
    """

    def __init__(
        self,
        target: str,
        layout: PoolLayout,
        *,
        timeout_s: float = 1.0,
        register_timeout_s: float = 10.0,
        client_id: str | None = None,
    ) -> None:
        from opentelemetry.instrumentation.grpc import client_interceptor
        from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

        self.target = target
        self.layout = layout
        self.timeout_s = timeout_s
        self.register_timeout_s = register_timeout_s
        # "<name>:<host>:<pid>": the compactor reaps the pools of exited clients on its host.
        self.client_id = client_id or f"scheduler:{socket.gethostname()}:{os.getpid()}"
        # The instrumentation carries the W3C traceparent in the call's metadata.
        self._raw_channel = grpc.insecure_channel(target)
        self._channel = intercept_channel(self._raw_channel, client_interceptor())
        self._stub = pb_grpc.CompactorStub(self._channel)
        self.pool_id: str | None = None
        self.epoch: int | None = None
        self._layout_proto = layout_to_proto(layout)

    def register(self) -> tuple[str, int]:
        try:
            reply = self._stub.RegisterPool(
                pb.RegisterPoolRequest(layout=self._layout_proto, client_id=self.client_id),
                timeout=self.register_timeout_s,
            )
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(f"the compactor refused the pool: {error.details()}") from None
            raise CompactorUnavailable(
                f"cannot register the KV pool with the compactor at {self.target}: "
                f"{error.code().name} {error.details()}"
            ) from None
        self.pool_id, self.epoch = reply.pool_id, reply.epoch
        logger.info("KV pool registered with the compactor", extra={"epoch": reply.epoch})
        return self.pool_id, self.epoch

    def compact(
        self, plans: Sequence[CompactionPlan], claim: LeaseClaim | None = None
    ) -> CompactResult:
        if self.pool_id is None:
            self.register()
        for attempt in (0, 1):
            request = pb.CompactRequest(
                pool_id=self.pool_id,
                epoch=self.epoch,
                claim=claim_to_proto(claim),
                plans=[plan_to_proto(p) for p in plans],
            )
            try:
                reply = self._stub.Compact(request, timeout=self.timeout_s)
            except grpc.RpcError as error:
                code = error.code()
                if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                    # Restarted compactor or replaced registration: nothing moved.
                    self.pool_id = None
                    if attempt == 0:
                        self.register()
                        continue
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise PlanError(f"the compactor refused the pass: {error.details()}") from None
                if code == grpc.StatusCode.ABORTED:
                    raise LeaseRefused(error.details()) from None
                raise CompactorUnavailable(
                    f"the compactor at {self.target} did not complete the pass: "
                    f"{code.name} {error.details()}"
                ) from None
            return CompactResult(
                slots_moved=reply.slots_moved,
                bytes_moved=reply.bytes_moved,
                duration_s=reply.duration_s,
                kernel=reply.kernel,
            )
        raise AssertionError("unreachable")  # pragma: no cover

    def healthy(self, timeout_s: float = 0.5) -> bool:
        return check_health(self.target, timeout_s=timeout_s)

    def close(self) -> None:
        if self.pool_id is not None:
            try:
                self._stub.UnregisterPool(
                    pb.UnregisterPoolRequest(pool_id=self.pool_id, epoch=self.epoch), timeout=1.0
                )
            except grpc.RpcError:
                pass  # the compactor reaps pools of exited clients anyway
        self._raw_channel.close()


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
        self.fallback_passes = 0
        self.skipped_passes = 0

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
        with self._lock:
            if not self._sidecar_usable():
                if self.mode == "skip":
                    self.skipped_passes += 1
                    raise CompactionSkipped(
                        "the compactor sidecar is down and --kv-compactor-fallback is skip: "
                        "pass skipped, nothing moved"
                    )
                self.fallback_passes += 1
                return self.fallback.compact(plans, claim)
            try:
                result = self.primary.compact(plans, claim)
            except CompactorUnavailable as error:
                self._down_since = self._last_probe = self._clock_s()
                self.fallback_passes += 1
                logger.error("%s; completing the pass in-process", error)
                return self.fallback.compact(plans, claim)
            self.sidecar_passes += 1
            return result
