"""How much calibration text the triattention statistics need: statistics of the
reference checkpoint from 1..32 training-distribution sequences per task variant,
each compared with statistics of 32 other sequences per variant (held out), by the
measure `sglang-evict calibrate --check STATS --text FILE` prints (relative difference
of each head's mean query; median and worst head).

    python3 benches/quality/calibration_amount.py      # about 1 min on 2 cores
"""

from __future__ import annotations

from pathlib import Path

import torch

from sglang_evict.calibrate import calibrate, held_out_agreement, load_model
from sglang_evict.quality.reference import harness
from sglang_evict.quality.reference.task import make_sample

CHECKPOINT = Path(__file__).resolve().parent / "checkpoint"
HELD_OUT_SEED = 12345  # neither the eval's held-out seed (0) nor the calibration seed


def task_tokens(settings: harness.EvalSettings, seed: int, per_variant: int) -> torch.Tensor:
    ids: list[int] = []
    for variant in settings.variants:
        spec = settings.variant_spec(variant)
        for i in range(per_variant):
            ids.extend(make_sample(spec, seed, i).tokens)
    return torch.tensor(ids, dtype=torch.int64)


def main() -> None:
    model = load_model(CHECKPOINT)
    settings = harness.EvalSettings()
    chunk = settings.spec.total_tokens
    held_out = calibrate(model, task_tokens(settings, HELD_OUT_SEED, 32), chunk_tokens=chunk)
    print(f"{'sequences/variant':>18}{'tokens':>8}{'median':>8}{'worst':>8}  worst head")
    for per_variant in (1, 2, 4, 8, 16, 32):
        ids = task_tokens(settings, harness.CALIBRATION_DATA_SEED, per_variant)
        agreement = held_out_agreement(calibrate(model, ids, chunk_tokens=chunk), held_out)
        layer, head = agreement.worst_head
        print(
            f"{per_variant:>18}{ids.numel():>8}{agreement.median:>8.3f}{agreement.worst:>8.3f}"
            f"  layer {layer} head {head}"
        )


if __name__ == "__main__":
    main()
