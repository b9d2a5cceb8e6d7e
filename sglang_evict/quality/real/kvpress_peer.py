"""kvpress 0.5.5 on the real model and the real-model tasks' exact inputs: the peer runner
of ``sglang-evict eval-real --kvpress``. Runs in the kvpress environment
(``kvpress_bridge``: ``transformers<5.3``), imports only pure modules of this project:

    <venv>/bin/python -m sglang_evict.quality.real.kvpress_peer --job job.json --out out.json

``needle``      each prompt (system, haystack with the needle, question: the very token
                ids SGLang's engines get) prefilled under a press that compresses it to
                the budget at the end of the prefill (kvpress's usual use; the question
                is in the compressed context, as in the engine), then ``max_new_tokens``
                greedy tokens decoded with no further compression.
``perplexity``  each sequence's first ``prompt_tokens`` prefilled, every later token fed
                one per step; ``DecodingPress`` cuts the cache back to ``target_size``
                (= our budget) every ``compression_interval`` (= our cadence) steps; the
                NLL of each fed token comes from the step that predicts it.

kvpress keeps a top-k per KV head (the plugin keeps one set per token: SGLang stores
every head of a token in one slot); its cache is HF's ``DynamicCache`` (no pages).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from sglang_evict.quality.real.needle import Needle, found

NEEDLE_PRESSES = (
    "SnapKVPress",
    "ExpectedAttentionPress",
    "StreamingLLMPress",
    "TOVAPress",
    "KnormPress",
    "KeyDiffPress",
    "AdaKV(ExpectedAttentionPress)",
    "AdaKV(SnapKVPress)",
)
DECODING_PRESSES = ("StreamingLLMPress", "KnormPress", "TOVAPress", "ExpectedAttentionPress")
SNAPKV_WINDOW_TOKENS = 64


def make_press(name: str, sink_tokens: int, window_limit: int | None = None):
    """A press from its name: ``Press`` or ``AdaKV(Press)`` (head-wise budgets)."""
    import kvpress

    if name.startswith("AdaKV(") and name.endswith(")"):
        return kvpress.AdaKVPress(make_press(name[6:-1], sink_tokens, window_limit))
    params = {}
    if name == "SnapKVPress":
        params["window_size"] = min(SNAPKV_WINDOW_TOKENS, window_limit or SNAPKV_WINDOW_TOKENS)
    elif name in ("StreamingLLMPress", "ExpectedAttentionPress"):
        params["n_sink"] = sink_tokens
    return getattr(kvpress, name)(**params)


def _greedy(model, cache, logits, steps: int, position: int) -> list[int]:
    out = [int(logits.argmax())]
    for i in range(steps - 1):
        ids = torch.tensor([[out[-1]]])
        positions = torch.tensor([[position + i]])
        logits = model(input_ids=ids, past_key_values=cache, position_ids=positions).logits[0, -1]
        out.append(int(logits.argmax()))
    return out


def run_needle(model, tokenizer, job: dict, press_name: str | None, fraction: float) -> dict:
    from transformers import DynamicCache

    rows = []
    start = time.perf_counter()
    for sample in job["needle"]["samples"]:
        ids = torch.tensor([sample["prompt_ids"]])
        length = ids.shape[1]
        cache = DynamicCache()
        press = None
        if press_name is not None:
            press = make_press(press_name, job["sink_tokens"], window_limit=length - 1)
            budget = max(1, round(fraction * length))
            # kvpress keeps int(n * (1 - ratio)); +0.5 makes that exactly the budget.
            press.compression_ratio = max(0.0, 1.0 - (budget + 0.5) / length)
        with torch.no_grad():
            context, last = ids[:, :-1], ids[:, -1:]
            if press is not None:
                with press(model):
                    model.model(input_ids=context, past_key_values=cache)
            else:
                model.model(input_ids=context, past_key_values=cache)
            kept = cache.get_seq_length()
            logits = model(
                input_ids=last, past_key_values=cache, position_ids=torch.tensor([[length - 1]])
            ).logits[0, -1]
            answer = _greedy(model, cache, logits, job["needle"]["max_new_tokens"], length)
        text = tokenizer.decode(answer, skip_special_tokens=True)
        needle = Needle(**sample["needle"])
        rows.append(
            {
                "key": sample["key"],
                "context_tokens": sample["context_tokens"],
                "found": found(needle, text),
                "kept_tokens": kept,
                "answer": text[:200],
            }
        )
    return {"rows": rows, "wall_s": round(time.perf_counter() - start, 1)}


def run_perplexity(model, job: dict, press_name: str | None, budget: int | None) -> dict:
    from kvpress import DecodingPress
    from transformers import DynamicCache

    spec = job["perplexity"]
    total_nll, total_tokens, peak = 0.0, 0, 0
    start = time.perf_counter()
    for tokens in spec["sequences"]:
        cache = DynamicCache()
        prompt = torch.tensor([tokens[: spec["prompt_tokens"]]])
        press = None
        if press_name is not None:
            press = DecodingPress(
                base_press=make_press(press_name, job["sink_tokens"], spec["cadence_tokens"] - 1),
                compression_interval=spec["cadence_tokens"],
                target_size=budget,
            )
        with torch.no_grad(), press(model) if press is not None else _Nothing():
            logits = model(input_ids=prompt, past_key_values=cache).logits[0, -1]
            position = prompt.shape[1]
            for offset, token in enumerate(tokens[spec["prompt_tokens"] :]):
                total_nll -= float(torch.log_softmax(logits.float(), dim=-1)[token])
                total_tokens += 1
                ids = torch.tensor([[token]])
                positions = torch.tensor([[position + offset]])
                logits = model(input_ids=ids, past_key_values=cache, position_ids=positions).logits[
                    0, -1
                ]
                peak = max(peak, cache.get_seq_length())
    return {
        "perplexity": math.exp(total_nll / total_tokens),
        "tokens_scored": total_tokens,
        "peak_kv_tokens": peak,
        "wall_s": round(time.perf_counter() - start, 1),
    }


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run_job(job: dict, progress: bool = True, out: Path | None = None) -> dict:
    import kvpress
    import transformers
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, torch.get_num_threads()))
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        job["model"], dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    done = json.loads(out.read_text()) if out is not None and out.is_file() else {}
    results = {"entries": done.get("entries", []), "skipped": done.get("skipped", [])}
    seen = {(e["task"], e["method"], e["budget"]) for e in results["entries"]}
    seen |= {(e["task"], e["method"], e["budget"]) for e in results["skipped"]}
    runs = []
    if "needle" in job:
        runs.append(("needle", None, 1.0))
        runs += [
            ("needle", p, f) for p in job["needle"]["presses"] for f in job["needle"]["fractions"]
        ]
    if "perplexity" in job:
        runs.append(("perplexity", None, None))
        spec = job["perplexity"]
        runs += [("perplexity", p, b) for p in spec["presses"] for b in spec["budgets"]]
    bar = tqdm(total=len(runs), desc="kvpress peer", unit="run", disable=not progress)
    for task, press, budget in runs:
        method = "kvpress:none" if press is None else f"kvpress:{press}"
        key = (task, method, budget)
        bar.set_postfix_str(f"{task} {method} {budget}")
        if key in seen:
            bar.update(1)
            continue
        try:
            if task == "needle":
                outcome = run_needle(model, tokenizer, job, press, budget)
            else:
                outcome = run_perplexity(model, job, press, budget)
        except Exception as error:  # a press that cannot run here is reported, not fatal
            results["skipped"].append(
                {
                    "task": task,
                    "method": method,
                    "budget": budget,
                    "reason": f"{type(error).__name__}: {error}",
                }
            )
        else:
            results["entries"].append({"task": task, "method": method, "budget": budget, **outcome})
        if out is not None:  # resumable: every finished run is kept
            _write(out, results, kvpress, transformers)
        bar.update(1)
    bar.close()
    return _versions(results, kvpress, transformers)


def _versions(results: dict, kvpress, transformers) -> dict:
    from importlib.metadata import version

    results["versions"] = {
        "kvpress": version("kvpress"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    return results


def _write(out: Path, results: dict, kvpress, transformers) -> None:
    out.write_text(json.dumps(_versions(results, kvpress, transformers), indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="job JSON written by eval-real")
    parser.add_argument("--out", required=True, help="results JSON (resumed when present)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    job = json.loads(Path(args.job).read_text(encoding="utf-8"))
    run_job(job, progress=not args.no_progress, out=Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
