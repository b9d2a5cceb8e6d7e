"""kvpress 0.5.5 on the reference model and the same sequences: the peer runner.

Runs in its own environment (kvpress needs ``transformers<5.3``; SGLang 0.5.17 pins
5.12.1), started by ``sglang_evict.quality.kvpress_bridge``:

    <venv>/bin/python -m sglang_evict.quality.reference.kvpress_peer --job job.json --out peer.json

Imports only the task module of this project (pure Python). Each press runs two ways:

``prefill``  kvpress's usual use (its pipeline): the context (prompt + body) is
             prefilled at once and compressed to the budget at the end of the prefill,
             with the whole context visible to the scorer; then ``QUERY x0`` and the
             answer are decoded with no further compression (the cache grows by
             ``2 + chain_steps`` tokens after the budget).
``decoding`` ``DecodingPress``: the prompt is prefilled, the body is fed one token per
             decode step (as our harness does), and every ``compression_interval``
             (= our cadence) steps the cache is cut back to ``target_size`` (= our
             budget). This is the like-for-like comparison with the plugin.

Differences from the plugin that stay: kvpress keeps a separate top-k per KV head
(the plugin keeps one set per token: SGLang stores every head of a token in one slot),
its cache is HF's ``DynamicCache`` (no pages), and nothing is protected unless the
press protects it (StreamingLLM and ExpectedAttention keep ``n_sink`` first tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from sglang_evict.quality.reference.task import Sample, TaskSpec, score_chain

PRESSES = ("StreamingLLMPress", "KnormPress", "SnapKVPress", "TOVAPress", "ExpectedAttentionPress")
MODES = ("prefill", "decoding")
SNAPKV_WINDOW_TOKENS = 64  # kvpress's default observation window (prefill)


def _samples(job: dict) -> dict[str, list[Sample]]:
    spec = job["task"]
    out = {}
    for variant, rows in job["sequences"].items():
        task = TaskSpec(
            variant=variant,
            num_facts=spec["num_facts"],
            num_distractors=spec["num_distractors"],
            chain_steps=spec["chain_steps"],
        )
        out[variant] = [
            Sample(
                spec=task,
                prompt=tuple(r["prompt"]),
                forced=tuple(r["forced"]),
                answer=tuple(r["answer"]),
                successor={int(k): v for k, v in r["successor"].items()},
                fact_positions=(),
            )
            for r in rows
        ]
    return out


def _make_press(name: str, mode: str, job: dict, context_tokens: int):
    import kvpress

    sink_tokens = job["sink_tokens"]
    cadence = job["cadence_tokens"]
    if name == "SnapKVPress":
        # Its scorer needs more hidden states than its window: the whole context at
        # prefill; at decoding only the states buffered since the last compression.
        limit = context_tokens - 1 if mode == "prefill" else cadence - 1
        params = {"window_size": min(SNAPKV_WINDOW_TOKENS, limit)}
    elif name in ("StreamingLLMPress", "ExpectedAttentionPress"):
        params = {"n_sink": sink_tokens}
    else:
        params = {}
    return getattr(kvpress, name)(**params), params


class _Runner:
    def __init__(self, model, samples: list[Sample]) -> None:
        self.model = model
        self.samples = samples
        self.batch = len(samples)
        self.peak_tokens = 0

    def _forward(self, tokens: torch.Tensor, cache, position: int):
        positions = torch.arange(position, position + tokens.shape[1]).expand(self.batch, -1)
        logits = self.model(input_ids=tokens, past_key_values=cache, position_ids=positions).logits
        self.peak_tokens = max(self.peak_tokens, cache.get_seq_length())
        return logits[:, -1]

    def _answer(self, logits: torch.Tensor, cache, position: int) -> list[list[int]]:
        steps = len(self.samples[0].answer)
        out = [logits.argmax(dim=-1)]
        for i in range(steps - 1):
            out.append(self._forward(out[-1][:, None], cache, position + i).argmax(dim=-1))
        return torch.stack(out, dim=1).tolist()

    def run(self, press, mode: str) -> tuple[list[list[int]], int, int]:
        """(answers, peak cached tokens, cached tokens at the end)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        self.peak_tokens = 0
        prompt = torch.tensor([s.prompt for s in self.samples])
        forced = torch.tensor([s.forced for s in self.samples])
        body, question = forced[:, :-2], forced[:, -2:]
        with torch.no_grad():
            if mode == "prefill" or press is None:
                context = torch.cat([prompt, body], dim=1)
                with press(self.model) if press is not None else _nothing():
                    self.model.model(input_ids=context, past_key_values=cache)
                self.peak_tokens = context.shape[1]
                logits = self._forward(question, cache, context.shape[1])
                answers = self._answer(logits, cache, context.shape[1] + 2)
            else:
                with press(self.model):
                    self._forward(prompt, cache, 0)
                    position = prompt.shape[1]
                    for j in range(forced.shape[1]):
                        logits = self._forward(forced[:, j : j + 1], cache, position + j)
                    answers = self._answer(logits, cache, position + forced.shape[1])
        return answers, self.peak_tokens, cache.get_seq_length()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run_job(job: dict, progress: bool = True) -> dict:
    import kvpress
    import transformers
    from kvpress import DecodingPress
    from tqdm import tqdm
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    model = LlamaForCausalLM.from_pretrained(
        job["checkpoint"], dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    samples = _samples(job)
    total_tokens = job["task"]["total_tokens"]
    runs = [(None, "prefill", 1.0, total_tokens)]
    for name in job["presses"]:
        for mode in job["modes"]:
            for budget in job["budgets"]:
                runs.append((name, mode, budget["fraction"], budget["tokens"]))
    entries, skipped = [], []
    full: dict | None = None
    bar = tqdm(total=len(runs), desc="kvpress peer", unit="run", disable=not progress)
    for name, mode, fraction, budget in runs:
        method = "kvpress:none" if name is None else f"kvpress:{name}({mode})"
        bar.set_postfix_str(f"{method} budget {fraction:g}")
        correct = exact = steps = 0
        peak = end = 0
        by_variant = {}
        start = time.perf_counter()
        params: dict = {}
        try:
            for variant, group in samples.items():
                runner = _Runner(model, group)
                context_tokens = len(group[0].prompt) + len(group[0].forced) - 2
                press = None
                if name is not None:
                    press, params = _make_press(name, mode, job, context_tokens)
                    if mode == "prefill":
                        # kvpress keeps int(n * (1 - ratio)); +0.5 makes that exactly budget.
                        press.compression_ratio = max(0.0, 1.0 - (budget + 0.5) / context_tokens)
                    else:
                        press = DecodingPress(
                            base_press=press,
                            compression_interval=job["cadence_tokens"],
                            target_size=budget,
                        )
                answers, run_peak, run_end = runner.run(press, mode)
                scores = [score_chain(s, a) for s, a in zip(group, answers, strict=True)]
                v_correct = sum(c.steps_correct for c in scores)
                v_steps = sum(c.num_steps for c in scores)
                by_variant[variant] = {
                    "step_accuracy": v_correct / v_steps,
                    "exact_match": sum(c.exact for c in scores) / len(scores),
                    "steps_correct": [c.steps_correct for c in scores],
                }
                correct += v_correct
                steps += v_steps
                exact += sum(c.exact for c in scores)
                peak += run_peak * len(group)
                end += run_end * len(group)
        except Exception as error:  # a press that cannot run here is reported, not fatal
            skipped.append(
                {
                    "engine": "kvpress",
                    "method": method,
                    "budget_fraction": fraction,
                    "reason": f"{type(error).__name__}: {error}",
                }
            )
            bar.update(1)
            continue
        num_sequences = sum(len(g) for g in samples.values())
        record = {
            "engine": "kvpress",
            "method": method,
            "press_params": params,
            "mode": mode,
            "page_size": None,
            "budget_fraction": fraction,
            "budget_tokens": budget,
            "step_accuracy": correct / steps,
            "exact_match": exact / num_sequences,
            "peak_tokens_held": peak / num_sequences,
            "end_tokens_held": end / num_sequences,
            "wall_s": time.perf_counter() - start,
            "num_sequences": num_sequences,
            "by_variant": by_variant,
        }
        if name is None:
            full = record
        entries.append(record)
        bar.update(1)
    bar.close()
    for record in entries:
        reference = full["step_accuracy"] if full else 0.0
        record["relative_step_accuracy"] = (
            record["step_accuracy"] / reference if reference > 0 else None
        )
    return {
        "versions": {
            "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "entries": entries,
        "skipped": skipped,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="job JSON written by the bridge")
    parser.add_argument("--out", required=True, help="where the results JSON goes")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    job = json.loads(Path(args.job).read_text(encoding="utf-8"))
    results = run_job(job, progress=not args.no_progress)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
