"""The main side of ``eval-tier``'s peer, transformers' quantized KV cache: the job (the
frontier's needle prompts and perplexity sequences, the very token ids the paged
reference path got), the peer run in its own environment (``quality.peer_env``), and
its results as rows on the frontier's bytes axis.

The peer lands where its format puts it (2 bits in groups of 64 near 0.16 of the
bytes, 4 bits near 0.28); ``frontier_run`` then runs the frontier's own candidates at
those fractions (rounded down to 0.01: never more bytes than the peer), so every peer
point has the tier beside it at equal bytes.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from sglang_evict.quality import peer_env

PEER_MODULE = "sglang_evict.quality.real.qcache_peer"
QCACHE = peer_env.PeerEnv(
    name="quantized-cache",
    packages=("optimum-quanto==0.2.7", "hqq==0.2.8.post1"),
    imports=("optimum.quanto", "hqq", "transformers"),
    distributions=("optimum-quanto", "hqq", "transformers", "torch"),
    venv_env="SGLANG_EVICT_QCACHE_VENV",
)


def write_job(path: Path, model_path: Path, samples, max_new_tokens: int, sequences, prompt_tokens):
    job: dict = {"model": str(Path(model_path).resolve())}
    if samples:
        job["needle"] = {
            "max_new_tokens": max_new_tokens,
            "samples": [
                {
                    "key": s.key,
                    "prompt_ids": list(s.prompt_ids),
                    "needle": {
                        "place": s.needle.place,
                        "code": s.needle.code,
                        "kind": s.needle.kind,
                    },
                }
                for s in samples
            ],
        }
    if sequences:
        job["perplexity"] = {
            "prompt_tokens": prompt_tokens,
            "sequences": [list(s) for s in sequences],
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(job) + "\n", encoding="utf-8")
    return path


def run(model_path, samples, max_new_tokens, sequences, prompt_tokens, out: Path, *, progress=True):
    """The peer's results (resumed from ``out/qcache_results.json``), or why it did not
    run (``{"status": "not run", "reason": ...}``)."""
    venv = QCACHE.default_venv()
    try:
        if progress:
            print(f"quantized-cache peer: environment {venv} (created if missing)")
        versions = peer_env.ensure(QCACHE, venv, create=True)
        job = write_job(
            out / "qcache_job.json", model_path, samples, max_new_tokens, sequences, prompt_tokens
        )
        peer = peer_env.run_peer(
            venv,
            job,
            out / "qcache_results.json",
            module=PEER_MODULE,
            progress=progress,
            name="quantized-cache",
        )
    except peer_env.PeerUnavailable as error:
        print(f"quantized-cache peer: not run: {error}")
        return {"status": "not run", "reason": str(error)}
    return {"status": "ok", "venv": str(venv), **peer, "versions": peer["versions"] | versions}


def needle_rows(peer: dict) -> list[dict]:
    """One row per method: accuracy per kind and in all, mean bytes held (the
    frontier's ``needle_table`` shape)."""
    rows = []
    for entry in peer.get("entries", []):
        if entry["task"] != "needle" or not entry["rows"]:
            continue
        by_kind = defaultdict(list)
        for row in entry["rows"]:
            by_kind[row["kind"]].append(row["found"])
        answers = entry["rows"]
        rows.append(
            {
                "candidate": entry["method"],
                "accuracy": sum(r["found"] for r in answers) / len(answers),
                "by_kind": {k: sum(v) / len(v) for k, v in sorted(by_kind.items())},
                "held_fraction": sum(r["held_fraction"] for r in answers) / len(answers),
                "prompts": len(answers),
            }
        )
    return rows


def perplexity_rows(peer: dict) -> list[dict]:
    """One row per method, perplexity relative to the peer's own full cache."""
    entries = [e for e in peer.get("entries", []) if e["task"] == "perplexity"]
    full = next((e["perplexity"] for e in entries if e["method"] == "hf-full"), None)
    return [
        {
            "candidate": e["method"],
            "perplexity": e["perplexity"],
            "relative": None if full is None else e["perplexity"] / full,
            "held_fraction": e["held_fraction"],
        }
        for e in entries
    ]


def at_bytes(held_fraction: float) -> float:
    """The fraction the frontier's candidates run at beside a peer row: its bytes
    rounded down to 0.01, so they never hold more than the peer."""
    return math.floor(held_fraction * 100 + 1e-9) / 100


def fractions(rows: list[dict]) -> list[float]:
    """The distinct fractions (``at_bytes``) the peer's quantized methods held."""
    return sorted({at_bytes(r["held_fraction"]) for r in rows if r["candidate"] != "hf-full"})
