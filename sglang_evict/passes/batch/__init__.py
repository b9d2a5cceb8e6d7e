"""The batched pass: every due request of a decode step in one pass, on the device.

A pass runs inside SGLang's scheduler loop between two decode steps, so whatever it
costs on the host every running request waits for. This package is the policy half of
a pass that costs the host O(1) per request and never waits for the device:

    module      job                                                 host reads
    counts      survivors, pages freed, protected ranges per        lengths it knows
                request (pure integer arithmetic)
    scoring     ``[R, N]`` scores of all due requests (batched       nothing
                scorer forms; per-request fallback)
    select      survivors of every request: bottom-k of an int64     nothing
                (score, position) key, per-row cut
    plan        ``hole_fill`` / ``repack`` for every request as      nothing
                tensor ops; moves padded with no-op self-moves;
                released pages as a tensor of host-known length
    inputs      the padded device inputs: host ints in one packed    nothing
                copy, rows and positions gathered on the device
    indices     index vectors as views of one cached ``arange``      nothing
    shapes      the pass's sizes, exact or padded to buckets (a      counts
                static shape a CUDA graph replays)

The mechanism (``sglang_evict.passes.manager.EvictionManager.run_batch_pass``) builds the
padded inputs from the pool, runs these, moves the slots in one launch and commits.
The numpy planner (``sglang_evict.passes.planner``) and ``sglang_evict.passes.selection`` are the
references the tests hold these to.
"""

from sglang_evict.passes.batch.counts import PassCounts, batch_strategy, pass_counts
from sglang_evict.passes.batch.plan import BatchPlan, PlanInputs, plan_hole_fill, plan_repack
from sglang_evict.passes.batch.scoring import score_batch, score_rows, score_rows_or_fall_back
from sglang_evict.passes.batch.select import protected_ranges_mask, select_keep

__all__ = [
    "BatchPlan",
    "PassCounts",
    "PlanInputs",
    "batch_strategy",
    "pass_counts",
    "plan_hole_fill",
    "plan_repack",
    "protected_ranges_mask",
    "score_batch",
    "score_rows",
    "score_rows_or_fall_back",
    "select_keep",
]
