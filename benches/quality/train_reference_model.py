"""Train the quality reference model: a small Llama (RoPE, GQA) that solves the
recall-chain task (``sglang_evict.quality.reference.task``) with a full cache.

    python3 benches/quality/train_reference_model.py                    # writes the checkpoint
    python3 benches/quality/train_reference_model.py --out /tmp/ckpt    # elsewhere

CPU only, seeded and deterministic (same torch build + thread count -> same weights).
Writes ``config.json`` + ``model.safetensors`` (HF format) and ``training.json`` (the
exact command, seed, versions, wall time, per-stage steps, loss curve and the held-out
full-cache accuracy) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sglang_evict.quality.reference.task import VARIANTS, TaskSpec, held_out_samples, score_chain  # noqa: E402
from sglang_evict.quality.reference.training import (  # noqa: E402
    ModelShape,
    TrainConfig,
    greedy_chains,
    train,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "checkpoint"
HELD_OUT_SPEC = TaskSpec()  # the eval's default: 32 facts, 224 distractors, 16 steps


def held_out_accuracy(model, num_sequences: int, seed: int) -> dict:
    """Full-cache greedy accuracy on held-out sequences of each variant (HF forward)."""
    report = {}
    all_correct = all_steps = all_exact = 0
    for variant in VARIANTS:
        spec = TaskSpec(
            variant=variant,
            num_facts=HELD_OUT_SPEC.num_facts,
            num_distractors=HELD_OUT_SPEC.num_distractors,
            chain_steps=HELD_OUT_SPEC.chain_steps,
        )
        samples = held_out_samples(spec, seed, num_sequences)
        scores = [
            score_chain(s, c) for s, c in zip(samples, greedy_chains(model, samples), strict=True)
        ]
        correct = sum(c.steps_correct for c in scores)
        steps = sum(c.num_steps for c in scores)
        exact = sum(c.exact for c in scores)
        report[variant] = {
            "step_accuracy": round(correct / steps, 4),
            "exact_match": round(exact / len(scores), 4),
        }
        all_correct, all_steps, all_exact = (
            all_correct + correct,
            all_steps + steps,
            all_exact + exact,
        )
    report["all"] = {
        "step_accuracy": round(all_correct / all_steps, 4),
        "exact_match": round(all_exact / (num_sequences * len(VARIANTS)), 4),
    }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="checkpoint folder")
    parser.add_argument("--seed", type=int, default=0, help="weights and training data seed")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--held-out", type=int, default=128, help="held-out sequences per variant to score"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    shape = ModelShape()
    config = TrainConfig(seed=args.seed, threads=args.threads)
    command = "python3 " + shlex.join(
        [str(Path(sys.argv[0]).resolve().relative_to(ROOT)), *(argv or sys.argv[1:])]
    )
    print(f"training {shape} seed {args.seed}, {args.threads} thread(s)", flush=True)
    start = time.perf_counter()

    def on_step(step: int, loss: float, lr: float, accuracy: float) -> None:
        if step % 100 == 0:
            elapsed = time.perf_counter() - start
            print(
                f"step {step:>5}  loss {loss:.4f}  answer acc {accuracy:.3f}  lr {lr:.2e}  "
                f"{elapsed:.0f} s",
                flush=True,
            )

    model, log = train(shape, config, on_step=on_step)
    print(f"trained {log['total_steps']} steps in {log['train_wall_s']:.0f} s: {log['stages']}")
    held_out = held_out_accuracy(model, args.held_out, seed=0)
    print(f"held-out full-cache accuracy: {held_out}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    import transformers

    record = {
        "command": command,
        "seed": args.seed,
        "threads": args.threads,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "model": shape.__dict__,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "train": config.to_dict(),
        "stages": log["stages"],
        "total_steps": log["total_steps"],
        "train_wall_s": round(log["train_wall_s"], 1),
        "held_out": {
            "spec": {
                "num_facts": HELD_OUT_SPEC.num_facts,
                "num_distractors": HELD_OUT_SPEC.num_distractors,
                "chain_steps": HELD_OUT_SPEC.chain_steps,
                "total_tokens": HELD_OUT_SPEC.total_tokens,
            },
            "eval_seed": 0,
            "sequences_per_variant": args.held_out,
            "decoding": "greedy, full cache, HF forward",
            **held_out,
        },
        "total_wall_s": round(time.perf_counter() - start, 1),
        "loss_every_25_steps": log["loss_every_25_steps"],
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}/config.json, model.safetensors, training.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
