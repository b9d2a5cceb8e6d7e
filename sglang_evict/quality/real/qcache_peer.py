"""transformers' own quantized KV cache (``QuantizedCache``, its quanto and HQQ
backends) on the real model and the frontier's exact inputs: the peer runner of
``sglang-evict eval-tier``. Runs in its own environment (``real.qcache``: this
interpreter's transformers plus optimum-quanto and hqq), imports only pure modules of
this project:

    <venv>/bin/python -m sglang_evict.quality.real.qcache_peer --job job.json --out out.json

The cache is used as its documentation shows a user (KIVI-style: the quantized tokens
plus a full-precision residual of ``residual_length`` tokens; quanto with
``axis_key = axis_value = 0``, HQQ with 1): at the prefill every prompt token is
quantized; decode tokens wait in the residual until it holds ``residual_length``, then
the whole cache is dequantized, joined and quantized again.

``needle``      each prompt but its last token prefilled into the cache, the last token
                and ``max_new_tokens`` greedy tokens decoded; the bytes are read right
                after the last prompt token (where the frontier reads its own).
``perplexity``  each sequence's first ``prompt_tokens`` prefilled, every later token fed
                one per step; the NLL of each fed token from the step that predicts it;
                the bytes are read at the sequence's end (where the frontier's spend
                holds its fraction), their mean over the fed steps beside them.

Bytes are what the cache's own tensors hold (``held_bytes``): packed codes at their real
size, every scale, zero and residual value counted at 2 bytes (bfloat16, the frontier's
accounting), over every layer; the fraction divides by every token in bfloat16.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch

from sglang_evict.quality.real.needle import Needle, found

# (backend, bits): what the cache's documentation offers (quanto 2 and 4 bits; HQQ 1-8).
CONFIGS = (("quanto", 2), ("quanto", 4), ("hqq", 2), ("hqq", 3), ("hqq", 4))
GROUP_TOKENS = 64  # QuantizedCache's q_group_size default
RESIDUAL_TOKENS = 128  # QuantizedCache's residual_length default
FULL_BYTES = 2  # bfloat16 (the frontier's accounting)


def method_name(backend: str, bits: int, group: int = GROUP_TOKENS) -> str:
    return f"hf-{backend} {bits}b G{group}"


def _leaves(value):
    """The plain tensors inside ``value`` (quanto's tensor subclasses flattened; HQQ's
    ``(codes, meta)`` pair and its meta dict walked)."""
    if isinstance(value, torch.Tensor):
        flatten = getattr(value, "__tensor_flatten__", None)
        if flatten is not None and type(value) is not torch.Tensor:
            names, _ = flatten()
            for name in names:
                yield from _leaves(getattr(value, name))
        else:
            yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)


def tensor_bytes(value) -> int:
    """Integer tensors (packed codes) at their size; floating ones at ``FULL_BYTES``."""
    total = 0
    for leaf in _leaves(value):
        if leaf.is_floating_point():
            total += leaf.numel() * FULL_BYTES
        else:
            total += leaf.numel() * leaf.element_size()
    return total


def held_bytes(cache) -> int:
    """Every layer's quantized keys and values plus its full-precision residual."""
    total = 0
    for layer in cache.layers:
        for name in ("_quantized_keys", "_quantized_values", "keys", "values"):
            total += tensor_bytes(getattr(layer, name, None))
    return total


def full_bytes(config, tokens: int) -> int:
    """``tokens`` tokens of every layer and KV head in bfloat16, keys and values."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (
        2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * tokens * FULL_BYTES
    )


def make_cache(model, backend: str, bits: int):
    from transformers import QuantizedCache

    axis = 0 if backend == "quanto" else 1
    return QuantizedCache(
        backend=backend,
        config=model.config,
        nbits=bits,
        axis_key=axis,
        axis_value=axis,
        q_group_size=GROUP_TOKENS,
        residual_length=RESIDUAL_TOKENS,
    )


def _step(model, cache, token: int, position: int):
    return model(
        input_ids=torch.tensor([[token]]),
        past_key_values=cache,
        position_ids=torch.tensor([[position]]),
        use_cache=True,
    ).logits[0, -1]


def run_needle(model, tokenizer, job: dict, backend: str | None, bits: int | None) -> dict:
    from transformers import DynamicCache

    rows = []
    start = time.perf_counter()
    steps = job["needle"]["max_new_tokens"]
    for sample in job["needle"]["samples"]:
        ids = sample["prompt_ids"]
        cache = DynamicCache() if backend is None else make_cache(model, backend, bits)
        with torch.no_grad():
            model.model(input_ids=torch.tensor([ids[:-1]]), past_key_values=cache, use_cache=True)
            logits = _step(model, cache, ids[-1], len(ids) - 1)
            fraction = (
                1.0 if backend is None else held_bytes(cache) / full_bytes(model.config, len(ids))
            )
            answer = [int(logits.argmax())]
            for i in range(steps - 1):
                answer.append(int(_step(model, cache, answer[-1], len(ids) + i).argmax()))
        text = tokenizer.decode(answer, skip_special_tokens=True)
        rows.append(
            {
                "key": sample["key"],
                "kind": sample["needle"]["kind"],
                "found": found(Needle(**sample["needle"]), text),
                "held_fraction": round(fraction, 4),
                "answer": text[:120],
            }
        )
    return {"rows": rows, "wall_s": round(time.perf_counter() - start, 1)}


def run_perplexity(model, job: dict, backend: str | None, bits: int | None) -> dict:
    from transformers import DynamicCache

    spec = job["perplexity"]
    total_nll, total_tokens, fractions, ends = 0.0, 0, [], []
    start = time.perf_counter()
    for tokens in spec["sequences"]:
        cache = DynamicCache() if backend is None else make_cache(model, backend, bits)
        prompt = tokens[: spec["prompt_tokens"]]
        with torch.no_grad():
            logits = model(
                input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True
            ).logits[0, -1]
            for position in range(len(prompt), len(tokens)):
                token = tokens[position]
                total_nll -= float(torch.log_softmax(logits.float(), dim=-1)[token])
                total_tokens += 1
                logits = _step(model, cache, token, position)
                if backend is not None:
                    fractions.append(held_bytes(cache) / full_bytes(model.config, position + 1))
        if backend is not None:
            ends.append(fractions[-1])
    return {
        "perplexity": math.exp(total_nll / total_tokens),
        "tokens_scored": total_tokens,
        "held_fraction": round(sum(ends) / len(ends), 4) if ends else 1.0,
        "held_fraction_mean": round(sum(fractions) / len(fractions), 4) if fractions else 1.0,
        "wall_s": round(time.perf_counter() - start, 1),
    }


def runs(job: dict) -> list[tuple[str, str | None, int | None]]:
    """Every (task, backend, bits) the job asks for, the full cache first."""
    configs = [tuple(c) for c in job.get("configs", CONFIGS)]
    out = []
    for task in ("needle", "perplexity"):
        if task in job:
            out.append((task, None, None))
            out += [(task, backend, bits) for backend, bits in configs]
    return out


def run_job(job: dict, progress: bool = True, out: Path | None = None) -> dict:
    import transformers
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        job["model"], dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    done = json.loads(out.read_text()) if out is not None and out.is_file() else {}
    digest = hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()[:16]
    if done.get("job_digest") != digest:  # another job's results are never resumed
        done = {}
    results = {"entries": done.get("entries", []), "skipped": done.get("skipped", [])}
    results["job_digest"] = digest
    seen = {(e["task"], e["method"]) for e in results["entries"] + results["skipped"]}
    todo = runs(job)
    bar = tqdm(total=len(todo), desc="quantized-cache peer", unit="run", disable=not progress)
    for task, backend, bits in todo:
        method = "hf-full" if backend is None else method_name(backend, bits)
        bar.set_postfix_str(f"{task} {method}")
        if (task, method) not in seen:
            try:
                if task == "needle":
                    outcome = run_needle(model, tokenizer, job, backend, bits)
                else:
                    outcome = run_perplexity(model, job, backend, bits)
            except Exception as error:  # a backend that cannot run here is reported
                results["skipped"].append(
                    {"task": task, "method": method, "reason": f"{type(error).__name__}: {error}"}
                )
            else:
                results["entries"].append({"task": task, "method": method, **outcome})
            if out is not None:  # resumable: every finished run is kept
                _write(out, results)
        bar.update(1)
    bar.close()
    return _versions(results)


def _versions(results: dict) -> dict:
    from importlib.metadata import version

    results["versions"] = {
        name: version(name) for name in ("transformers", "optimum-quanto", "hqq", "torch")
    }
    return results


def _write(out: Path, results: dict) -> None:
    out.write_text(json.dumps(_versions(results), indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="job JSON written by eval-tier")
    parser.add_argument("--out", required=True, help="results JSON (resumed when present)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    job = json.loads(Path(args.job).read_text(encoding="utf-8"))
    out = Path(args.out)
    _write(out, run_job(job, progress=not args.no_progress, out=out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
