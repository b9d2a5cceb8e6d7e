"""The main side of ``eval-real --kvpress``: the job (the needle prompts' token ids and
the perplexity sequences, exactly what the engine and the decode path got), the peer run
in kvpress's own environment (``kvpress_bridge``), its results."""

from __future__ import annotations

import json
from pathlib import Path

from sglang_evict.quality import kvpress_bridge
from sglang_evict.quality.real.kvpress_peer import DECODING_PRESSES, NEEDLE_PRESSES
from sglang_evict.quality.real.needle_engine import MAX_NEW_TOKENS, NeedlePolicy
from sglang_evict.quality.real.perplexity import PROMPT_TOKENS, PerplexityPolicy

PEER_MODULE = "sglang_evict.quality.real.kvpress_peer"


def write_job(path: Path, model_path: Path, settings, needle_samples, ppl_sequences) -> Path:
    job: dict = {"model": str(model_path.resolve()), "sink_tokens": NeedlePolicy().sink_tokens}
    if needle_samples:
        job["needle"] = {
            "presses": list(NEEDLE_PRESSES),
            "fractions": list(settings.kvpress_fractions),
            "max_new_tokens": MAX_NEW_TOKENS,
            "samples": [
                {
                    "key": s.key,
                    "context_tokens": s.context_tokens,
                    "prompt_ids": list(s.prompt_ids),
                    "needle": {
                        "place": s.needle.place,
                        "code": s.needle.code,
                        "kind": s.needle.kind,
                    },
                }
                for s in needle_samples
            ],
        }
    if ppl_sequences:
        job["perplexity"] = {
            "presses": list(DECODING_PRESSES),
            "budgets": list(settings.ppl_budgets),
            "cadence_tokens": PerplexityPolicy().cadence_tokens,
            "prompt_tokens": PROMPT_TOKENS,
            "sequences": [list(s) for s in ppl_sequences],
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(job) + "\n", encoding="utf-8")
    return path


def run_kvpress(model_path, settings, needle_samples, ppl_sequences, out: Path, venv, progress):
    """The peer's results (resumed from ``out/kvpress_results.json``), or why it did not
    run."""
    venv = Path(venv) if venv else kvpress_bridge.default_venv()
    try:
        versions = kvpress_bridge.ensure_venv(venv, create=True)
        job = write_job(
            out / "kvpress_job.json", model_path, settings, needle_samples, ppl_sequences
        )
        peer = kvpress_bridge.run_peer(
            venv, job, out / "kvpress_results.json", progress=progress, module=PEER_MODULE
        )
    except kvpress_bridge.KVPressUnavailable as error:
        print(f"kvpress: not run: {error}")
        return {"status": "not run", "reason": str(error)}
    return {"status": "ok", "venv": str(venv), **peer, "versions": peer["versions"] | versions}
