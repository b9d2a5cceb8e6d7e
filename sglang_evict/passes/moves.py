"""Moving a pass's slots: in-process (one repack launch on the pool's device) or
through the gRPC compactor sidecar, and the staging pages ``repack`` borrows.

In-process the moves follow the pass lease's grant at once, in this process: no
fencing check can fail between them (the sidecar checks the claim when a call arrives).

With the gRPC sidecar the plans go to the host first (``BatchPlan.to_host_plans``, a
synchronisation): its API carries host plans. Once the ``Compact`` call was sent, a
failure may come after some slots moved (the sidecar died mid-copy, then the
in-process fallback could not check the lease because the lease store is down too), so
the pass is then completed in-process from the same plan (moves are idempotent and
write no survivor: the planner's invariant 3) and committed, without a lease: the
manager's ``forced_completions`` counts it. Only refusals that prove nothing moved (an
invalid plan, a refused lease, a lease store down, a call whose kernel the pool's fence
says never started, ``CompactionSkipped``) skip a pass; a later call of a split pass
failing after an earlier one moved slots (``PassPartlyDone``) is completed like a
failure.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import Tensor

from compactor_service.compactor import Compactor, LeaseClaim, nothing_moved
from compactor_service.redis_leases import LeaseStoreUnavailable
from sglang_evict.passes.batch import BatchPlan
from sglang_evict.passes.batch.counts import BatchCounts
from sglang_evict.passes.lease import PassLease
from sglang_evict.passes.state import KVPoolAccess
from sglang_evict_kernels import repack_kv_independent

logger = logging.getLogger(__name__)


def claim_staging(pool: KVPoolAccess, total: int) -> Tensor | None:
    """The ``total`` repack staging pages the allocator hands out (None: none needed)."""
    if total == 0:
        return None
    claimed = pool.alloc_pages(total)
    if claimed is None:  # batch_strategy checked the free count; raced by nothing here
        raise RuntimeError(f"the allocator could not give {total} staging pages")
    return claimed


def move_slots(
    pool: KVPoolAccess,
    compactor: Compactor | None,
    lease: PassLease,
    plan: BatchPlan,
    counts: BatchCounts,
    claim: LeaseClaim | None,
    demotions: dict[int, dict[str, Tensor]] | None = None,
) -> tuple[Tensor, bool]:
    """Move the slots of ``plan``; returns the copies per request (``[R]``, on the
    device for in-process moves) and whether the pass had to be completed in-process
    after the sidecar failed mid-call. Raises only when nothing moved. ``demotions``:
    request index -> its plan's demotion fields (the sidecar quantizes them first:
    ``compactor.in_two_phases``, so a completion here finds them done)."""
    src, dst = plan.src.reshape(-1), plan.dst.reshape(-1)
    if compactor is None:
        repack_kv_independent(pool.k_buffers, pool.v_buffers, src, dst)
        return plan.move_counts(), False
    host_plans = plan.to_host_plans(counts.survivors.tolist(), counts.frozen_len.tolist())
    for index, fields in (demotions or {}).items():
        host_plans[index] = dataclasses.replace(host_plans[index], **fields)
    forced = False
    try:
        compactor.compact(host_plans, claim)
    except Exception as error:
        if isinstance(error, LeaseStoreUnavailable):  # the compactor's store: pause too
            lease.note_down()
        if nothing_moved(error):
            raise
        # The sidecar may have moved part of the plan: complete it from the same plan,
        # here, and commit (invariant 3 makes the re-run safe; the pool's fence
        # guarantees no late copy of it can follow).
        forced = True
        logger.error(
            "sglang-evict: compactor failed after the pass was sent (%s); completing it in-process",
            error,
        )
        repack_kv_independent(pool.k_buffers, pool.v_buffers, src, dst)
    return torch.tensor([p.num_moves for p in host_plans], dtype=torch.int64), forced
