"""The compactor contract and its in-process implementation.

A compactor applies a batch of plans (many requests, one pass) to a KV pool: it checks
every plan and the batch as a whole before any byte moves, then copies the slots. The
scheduler commits rows and frees pages only after ``compact`` returns; see the
planner's invariant 3 for why an interrupted copy leaves survivors intact.

``InProcessCompactor`` (the embedded default) runs in the scheduler's process over the
pool's own buffers. ``compactor_service.client.GrpcCompactor`` implements the same
``Compactor`` protocol over the gRPC sidecar.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from compactor_service import demotion, tracing
from compactor_service.leases import LeaseStore
from compactor_service.limits import clip
from compactor_service.plan import CompactionPlan, PlanError
from compactor_service.redis_leases import LeaseStoreUnavailable
from sglang_evict_kernels import repack_kv_reference, repack_kv_triton

KERNEL_TORCH_REFERENCE = "torch-reference"
KERNEL_TRITON = "triton"
KERNELS = {KERNEL_TORCH_REFERENCE: repack_kv_reference, KERNEL_TRITON: repack_kv_triton}


@dataclass(frozen=True)
class CompactResult:
    """What one ``compact`` call did."""

    slots_moved: int
    bytes_moved: int  # read + written, all layers, K and V
    duration_s: float  # validation + lease check + kernel
    kernel: str
    kernel_s: float = 0.0  # the kernel alone
    groups_demoted: int = 0  # groups quantized into the tier's arena (trash included)


class LeaseRefused(PlanError):
    """The batch's lease is stale or expired, or it touches pages pinned by others."""


class PassAbandoned(TimeoutError):
    """The caller stopped waiting (deadline passed, call cancelled) before the kernel
    started: nothing was moved. The caller may be completing the pass elsewhere, so a
    late copy could write slots it has already freed."""


class CompactorUnavailable(RuntimeError):
    """The sidecar did not complete the pass (dead, timed out, restarted). Survivors are
    intact; the same plans may be completed elsewhere. ``moved``: whether the failed
    call's kernel may have started (the fence says; True where there is no fence)."""

    def __init__(self, message: str, *, moved: bool = True) -> None:
        super().__init__(message)
        self.moved = moved


class PassPartlyDone(RuntimeError):
    """Part of the pass may have moved (an earlier call of a split pass did, or the
    failed call's kernel started) and the rest cannot be done by this compactor: the
    caller must complete the pass from the same plans, whatever refused it."""


class DemotionFailed(RuntimeError):
    """A pass's demotion (its first phase: ``in_two_phases``) failed: its moves were
    never sent, so nothing moved; the arena slots it wrote are read by nobody."""


class CompactionSkipped(RuntimeError):
    """The sidecar is down and the fallback mode is ``skip``: nothing was planned to
    move, the requests keep their full KV."""


# Trailing metadata the compactor sets on UNAVAILABLE when its lease store, not the
# compactor, is down (nothing moved): the key and its value.
CAUSE_METADATA_KEY = "sglang-evict-cause"
CAUSE_LEASE_STORE_DOWN = "lease-store-unavailable"

# Points of a pass where a fault hook (tests) may strike: before validation, after the
# lease check, inside the pass fence before the kernel, halfway through the kernel (its
# moves; in a call that demotes, its demotion's groups), after the kernel (the fence
# released).
FAULT_POINTS = ("received", "checked", "fenced", "mid-copy", "copied")


def _no_fault(point: str) -> None:
    return None


@dataclass(frozen=True)
class LeaseClaim:
    """Who asks: the exclusive lease the pass holds (``resource``, fencing ``token``) and
    the scheduler's holder name (for logs: pins block every pass, whoever holds them).
    ``renew``: extends the lease (False: it is gone), for a pass sent in several calls;
    never sent on the wire."""

    resource: str
    token: int
    holder: str
    renew: Callable[[], bool] | None = field(default=None, compare=False, repr=False)

    def renewed(self) -> bool:
        """Extend the lease before a further call of the same pass; False if it is gone."""
        return True if self.renew is None else bool(self.renew())


class Compactor(Protocol):
    def compact(
        self, plans: Sequence[CompactionPlan], claim: LeaseClaim | None = None
    ) -> CompactResult:
        """Apply ``plans``; raise ``PlanError`` (and move nothing) if any is invalid or,
        with a lease store, if ``claim`` does not hold a current lease."""
        ...


def in_two_phases(
    compact: Callable[[Sequence[CompactionPlan], LeaseClaim | None], CompactResult],
    plans: Sequence[CompactionPlan],
    claim: LeaseClaim | None,
) -> CompactResult:
    """A pass that demotes, as two calls of ``compact``: its demotions first (they read
    the pool and write only arena slots nobody reads yet), then, once they are
    confirmed, its moves (which overwrite the demoted tokens' slots). So a pass that
    fails in its first call has moved nothing: the pool is as it was, its demotion can
    be done again from it; and one that fails in its second has its demotion done and
    is completed like any pass whose moves failed. A pass without demotions, or
    without moves, is one call."""
    if not any(p.num_demoted_groups for p in plans) or not any(p.num_moves for p in plans):
        return compact(plans, claim)  # one kind of work: nothing to order
    try:
        first = compact([p.without_moves() for p in plans], claim)
    except Exception as error:
        if nothing_moved(error):
            raise
        raise DemotionFailed(
            f"the pass's demotion failed before its moves were sent, nothing moved "
            f"({type(error).__name__}: {error})"
        ) from error
    if claim is not None and not claim.renewed():
        raise LeaseRefused(
            f"the pass's lease {claim.resource!r} could not be renewed after its demotion: "
            f"its moves were not sent, nothing moved"
        )
    second = compact([p.without_demotion() for p in plans], claim)
    return CompactResult(
        slots_moved=second.slots_moved,
        bytes_moved=second.bytes_moved,
        duration_s=first.duration_s + second.duration_s,
        kernel=second.kernel,
        kernel_s=first.kernel_s + second.kernel_s,
        groups_demoted=first.groups_demoted,
    )


def _pages(slots: Tensor, page_size: int) -> Tensor:
    return torch.div(slots, page_size, rounding_mode="floor")


def _overlap(a: Tensor, b: Tensor) -> list[int]:
    return a[torch.isin(a, b)][:8].tolist()


def validate_batch(
    plans: Sequence[CompactionPlan],
    num_slots: int,
    still_wanted: Callable[[], bool] | None = None,
) -> tuple[Tensor, Tensor]:
    """Validate each plan and the batch; return the concatenated ``(src, dst)`` slots.

    Plans of one pass own disjoint private slots, so across plans: no slot is written or
    read twice, none is both read and written, no plan reads a slot another row keeps, no
    page is freed or claimed twice or freed while a row uses it, and a page that several
    rows hold (a shared prefix) is frozen: nobody reads, writes, frees or claims it.
    ``still_wanted`` is asked between plans: once it is false the validation stops
    (``PassAbandoned``), so a caller that gave up costs no further work.
    """
    for index, plan in enumerate(plans):
        if still_wanted is not None and not still_wanted():
            raise PassAbandoned(
                f"the caller stopped waiting while plan {index} of {len(plans)} was being "
                f"checked: nothing moved"
            )
        try:
            plan.validate_structure(num_slots=num_slots)
        except PlanError as error:
            raise PlanError(f"plan {index}: {error}") from None
    if not plans:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty
    page_size = plans[0].page_size
    if any(p.page_size != page_size for p in plans):
        raise PlanError("plans of one batch differ in page_size")
    src = torch.cat([p.src_slots for p in plans])
    dst = torch.cat([p.dst_slots for p in plans])
    rows = torch.cat([p.new_row for p in plans])
    freed = torch.cat([p.freed_pages for p in plans])
    claimed = torch.cat([p.claimed_pages for p in plans])
    for name, values in (
        ("write", dst),
        ("read", src),
        ("free", freed),
        ("claim", claimed),
    ):
        if torch.unique(values).numel() != values.numel():
            raise PlanError(f"two plans of one batch {name} the same slot or page")
    if torch.isin(dst, src).any():
        raise PlanError(f"slots {_overlap(dst, src)} are read by one plan and written by another")
    if torch.isin(src, rows).any():
        raise PlanError(f"slots {_overlap(src, rows)} are read by one plan and kept by another")
    row_pages = torch.cat([torch.unique(_pages(p.new_row, page_size)) for p in plans])
    if torch.isin(freed, row_pages).any():
        raise PlanError(f"pages {_overlap(freed, row_pages)} are freed while a row uses them")
    unique_pages, counts = torch.unique(row_pages, return_counts=True)
    shared = unique_pages[counts > 1]
    if shared.numel():
        touched = torch.cat([_pages(src, page_size), _pages(dst, page_size), claimed])
        if torch.isin(touched, shared).any():
            raise PlanError(
                f"pages {_overlap(touched, shared)} are held by several rows of the batch "
                f"(a shared prefix) and are read, written or claimed by a plan"
            )
    return src, dst


class InProcessCompactor:
    """Applies plans to per-layer K/V buffers in the caller's process.

    ``kernel``: ``triton`` (one launch over all layers), ``torch-reference``, or ``auto``:
    Triton for CUDA buffers, the reference for CPU buffers (Triton runs there only under
    its interpreter). ``FileCompactor`` is the same contract over a CPU pool's file.
    """

    def __init__(
        self,
        k_buffers: Sequence[Tensor],
        v_buffers: Sequence[Tensor],
        kernel: str = "auto",
        leases: LeaseStore | None = None,
        page_size: int | None = None,
        synchronize: bool = False,
    ) -> None:
        if len(k_buffers) != len(v_buffers) or not k_buffers:
            raise ValueError("need one K and one V buffer per layer (at least one layer)")
        if kernel == "auto":
            kernel = KERNEL_TRITON if k_buffers[0].is_cuda else KERNEL_TORCH_REFERENCE
        if kernel not in KERNELS:
            raise ValueError(f"unknown repack kernel {kernel!r}; known: {sorted(KERNELS)}")
        self._set_checks(leases, page_size)
        self.kernel = kernel
        # Wait for the kernel before returning (a compactor in another process than the
        # one that reads the moved slots next); in-process, stream order suffices.
        self.synchronize = synchronize
        self.k_buffers = list(k_buffers)
        self.v_buffers = list(v_buffers)
        self.num_slots = min(b.shape[0] for b in (*self.k_buffers, *self.v_buffers))
        self.bytes_per_slot = sum(
            b[0].numel() * b.element_size() for b in (*self.k_buffers, *self.v_buffers)
        )
        self.arena_stores: list | None = None
        self.arena_format = None

    def attach_arena(self, stores: Sequence, fmt) -> None:
        """The tier arena's per-layer stores (``TierStore``, the last slot the trash)
        and format: passes may then demote into it."""
        self.arena_stores, self.arena_format = list(stores), fmt

    def _arena(self) -> tuple[object | None, int]:
        """(the arena's format or None, its slots with the trash slot)."""
        if self.arena_stores is None:
            return None, 0
        return self.arena_format, int(self.arena_stores[0].k_codes.shape[0])

    def demote(self, token_slots: Tensor, targets: Tensor) -> None:
        """Quantize validated demotions into the arena (``compactor_service.demotion``)."""
        demotion.demote_tensors(
            self.arena_stores,
            self.arena_format,
            self.k_buffers,
            self.v_buffers,
            token_slots,
            targets,
        )

    def _set_checks(self, leases: LeaseStore | None, page_size: int | None) -> None:
        if leases is not None and page_size is None:
            raise ValueError("a compactor checking leases needs the pool's page_size")
        self.leases = leases
        # The pool's page size: plans of another page size are refused (None: any).
        self.page_size = page_size

    def compact(
        self,
        plans: Sequence[CompactionPlan],
        claim: LeaseClaim | None = None,
        *,
        still_wanted: Callable[[], bool] | None = None,
        fault: Callable[[str], None] | None = None,
        fence: Callable[[], AbstractContextManager] | None = None,
    ) -> CompactResult:
        """Validate → check the lease → (``still_wanted()``, else ``PassAbandoned``) →
        enter ``fence()`` (the pass fence, ``compactor_service.fence``: refuses a call
        its client gave up on) → kernel → leave the fence. ``fault`` is called at each
        of ``FAULT_POINTS`` (fault injection)."""
        tracer = tracing.tracer()
        hook = fault or _no_fault
        start = time.perf_counter()
        hook("received")
        with tracer.start_as_current_span(tracing.SPAN_VALIDATE):
            if self.page_size is not None:
                for index, plan in enumerate(plans):
                    if plan.page_size != self.page_size:
                        raise PlanError(
                            f"plan {index}: page_size {plan.page_size} != the pool's "
                            f"{self.page_size}"
                        )
            src, dst = validate_batch(plans, self.num_slots, still_wanted)
            arena_format, arena_slots = self._arena()
            token_slots, targets = demotion.check_batch(
                plans, arena_format, arena_slots, self.num_slots
            )
        if self.leases is not None:
            with tracer.start_as_current_span(tracing.SPAN_LEASE_CHECK):
                reads = torch.cat([src, token_slots.reshape(-1)])  # a demotion reads too
                check_leases(self.leases, claim, reads, dst, self.page_size)
        if still_wanted is not None and not still_wanted():
            raise PassAbandoned(
                "the caller stopped waiting before the kernel started: nothing moved"
            )
        hook("checked")
        with (fence or nullcontext)(), tracer.start_as_current_span(tracing.SPAN_KERNEL):
            hook("fenced")
            kernel_start = time.perf_counter()
            if targets.numel():  # before the moves: they may overwrite demoted slots
                half = targets.numel() // 2 if fault is not None else targets.numel()
                self.demote(token_slots[:half], targets[:half])
                if fault is not None:
                    hook("mid-copy")  # halfway through the kernel: here its demotion
                    self.demote(token_slots[half:], targets[half:])
                self.copy(src, dst)
            elif fault is None:
                self.copy(src, dst)
            else:
                half = src.numel() // 2
                self.copy(src[:half], dst[:half])
                hook("mid-copy")
                self.copy(src[half:], dst[half:])
            self.wait_for_copies()
            kernel_s = time.perf_counter() - kernel_start
        hook("copied")
        return CompactResult(
            slots_moved=int(src.numel()),
            bytes_moved=2 * int(src.numel()) * self.bytes_per_slot,
            duration_s=time.perf_counter() - start,
            kernel=self.kernel,
            kernel_s=kernel_s,
            groups_demoted=int(targets.numel()),
        )

    def copy(self, src: Tensor, dst: Tensor) -> None:
        """Run the repack kernel on already validated moves."""
        if src.numel():
            KERNELS[self.kernel](self.k_buffers, self.v_buffers, src, dst)

    def wait_for_copies(self) -> None:
        """Return once the copies landed (inside the fence: a compactor in another
        process than the one that reads the moved slots next)."""
        if self.synchronize:
            torch.cuda.synchronize(self.k_buffers[0].device)


class FileCompactor(InProcessCompactor):
    """The compactor over a CPU pool's file (``shared_pool.PoolFile``): through its
    guarded mapping once that is ready, else with ``pread``/``pwrite``; a client that
    truncates its file makes a copy fail (``PoolFileTruncated``), never the compactor
    fault (SIGBUS)."""

    def __init__(
        self, pool_file, leases: LeaseStore | None = None, page_size: int | None = None
    ) -> None:
        self._set_checks(leases, page_size)
        self.pool_file = pool_file
        self.synchronize = False
        self.num_slots = pool_file.layout.num_slots
        self.bytes_per_slot = pool_file.bytes_per_slot
        self.arena_file = None

    def attach_arena_file(self, arena_file) -> None:
        """The pool's registered arena file (``shared_arena.ArenaFile``)."""
        self.arena_file = arena_file

    def _arena(self) -> tuple[object | None, int]:
        if self.arena_file is None:
            return None, 0
        return self.arena_file.layout.format(), self.arena_file.layout.num_slots

    @property
    def kernel(self) -> str:
        return self.pool_file.kernel

    def demote(self, token_slots: Tensor, targets: Tensor) -> None:
        demotion.demote_files(self.pool_file, self.arena_file, token_slots, targets)

    def copy(self, src: Tensor, dst: Tensor) -> None:
        if src.numel():
            self.pool_file.copy_slots(src, dst)

    def wait_for_copies(self) -> None:
        return None


def check_leases(
    leases: LeaseStore, claim: LeaseClaim | None, src: Tensor, dst: Tensor, page_size: int
) -> None:
    """Refuse (``LeaseRefused``) a batch whose claim is missing, stale or expired, or
    that reads or writes a pinned page, whoever pins it: pins mark shared prefixes,
    which no pass may move (the claim's holder name is the caller's word, so it grants
    nothing). Runs before any byte moves."""
    if claim is None:
        raise LeaseRefused("this compactor checks leases: a pass must present its lease")
    if not leases.is_current(claim.resource, claim.token):
        raise LeaseRefused(
            f"fencing token {claim.token} is not the current lease of {clip(claim.resource)} "
            f"(expired or superseded): nothing was moved"
        )
    pages = torch.unique(torch.cat([src, dst]) // page_size).tolist()
    pinned = leases.pinned(pages)
    if pinned:
        raise LeaseRefused(
            f"pages {pinned[:8]} are pinned (a shared prefix): no pass may move them; "
            f"nothing was moved"
        )


def nothing_moved(error: Exception) -> bool:
    """Whether a failed ``compact`` call provably moved nothing: a refusal made before
    any byte moved (by the sidecar, whose fence then says no kernel started, or by the
    in-process compactor), or a skipped pass. ``PassPartlyDone`` and anything
    unexpected may have moved part of the pass."""
    if isinstance(error, PassPartlyDone):
        return False
    if isinstance(error, CompactorUnavailable):
        return not error.moved
    return isinstance(error, (CompactionSkipped, DemotionFailed, PlanError, LeaseStoreUnavailable))
