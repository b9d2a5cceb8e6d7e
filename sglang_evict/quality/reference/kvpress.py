"""The main side of ``sglang-evict eval --kvpress``: the job kvpress's peer runs on
the reference model (the checkpoint, the same sequences, budgets, presses), in
kvpress's own environment (``sglang_evict.quality.kvpress_bridge``).
"""

from __future__ import annotations

import json
from pathlib import Path

from sglang_evict.quality.reference.task import Sample

PEER_MODULE = "sglang_evict.quality.reference.kvpress_peer"


def write_job(
    path: Path,
    *,
    checkpoint: Path,
    samples: dict[str, list[Sample]],
    budgets: list[tuple[float, int]],
    presses: list[str],
    modes: list[str],
    cadence_tokens: int,
    sink_tokens: int,
) -> Path:
    spec = next(iter(samples.values()))[0].spec
    job = {
        "checkpoint": str(checkpoint.resolve()),
        "task": {
            "num_facts": spec.num_facts,
            "num_distractors": spec.num_distractors,
            "chain_steps": spec.chain_steps,
            "total_tokens": spec.total_tokens,
        },
        "sequences": {
            variant: [
                {
                    "prompt": list(s.prompt),
                    "forced": list(s.forced),
                    "answer": list(s.answer),
                    "successor": {str(k): v for k, v in s.successor.items()},
                }
                for s in group
            ]
            for variant, group in samples.items()
        },
        "budgets": [{"fraction": f, "tokens": t} for f, t in budgets],
        "presses": presses,
        "modes": modes,
        "cadence_tokens": cadence_tokens,
        "sink_tokens": sink_tokens,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(job) + "\n", encoding="utf-8")
    return path
