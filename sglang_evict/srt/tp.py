"""Tensor parallelism: ranks hold different KV heads, so per-rank scores are combined
over SGLang's CPU cache group before survivors are chosen."""

from __future__ import annotations

import torch
from torch import Tensor

# Scorers whose survivors do not depend on this rank's KV heads, and those whose
# per-rank scores are reduced across tensor-parallel ranks (``tp_score_reducer``): each
# rank scores its own heads (``window``/``rkv`` from its own query heads, captured by
# its own attention) and every head counts once in the reduction.
RANK_INDEPENDENT_SCORERS = ("streaming", "random")
TP_REDUCED_SCORERS = ("knorm", "window", "rkv")


def tp_score_reducer(group, head_reduction: str):
    """Combine per-token scores across the tensor-parallel ranks sharing requests.

    Each rank scores its own KV heads (an equal share); its per-token score is the mean
    (or max) over those heads, so the mean of the ranks' means is the mean over all heads,
    and the max of maxima the max. Runs on SGLang's CPU group for the cache
    (``tp_cache_group``): one all-reduce of ``num_tokens`` floats per pass.
    """
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    op = dist.ReduceOp.MAX if head_reduction == "max" else dist.ReduceOp.SUM

    def reduce(scores: Tensor) -> Tensor:
        combined = scores.detach().to("cpu", torch.float32).clone()
        dist.all_reduce(combined, op=op, group=group)
        if head_reduction != "max":
            combined /= world_size
        return combined.to(scores.device)

    return reduce
