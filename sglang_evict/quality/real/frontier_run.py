"""``sglang-evict eval-tier``: the frontier run. Every candidate (eviction's scorers, the
tier's bits, groups and outlier counts) at every KV-bytes fraction, on the needle task
(four kinds of needle) and decode-time perplexity, through the paged reference path
(``quality.real.frontier``); the full cache on the same inputs.

Everything lands in ``<out>/results.json`` as it completes (an interrupted run
resumes); ``results.md`` and ``results.png`` are drawn from it
(``quality.real.frontier_report``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

from sglang_evict.models.real_model import WEIGHTS_NOTE, weights_note_of
from sglang_evict.quality.real.evaluation import save_results as save
from sglang_evict.quality.real.frontier import (
    Candidate,
    Shape,
    config_for,
    needle_answer,
    spend,
)
from sglang_evict.quality.real.frontier_engine import ENGINE_CANDIDATES

RESULTS_FORMAT = "sglang-evict/tier-frontier"
# The rule's candidates (docs/quality.md): 2, 3 and 4 bits; groups of 32 and 64; the
# tier's groups beyond its bound dropped by position (streaming) or by R-KV's scores;
# and eviction's two best scorers on the real model. (The first measurement, in
# git history: outlier tokens never helped at 3 or 4 bits, groups of 128 could not hold
# a 1k prompt at 1/4 of the bytes, 4 bits trailed 3 at 1/4.)
TIER_CANDIDATES = ("2:32", "2:32/rkv", "3:32", "3:32/rkv", "3:64", "3:64/rkv", "4:32/rkv")
RULE_CANDIDATES = ("evict:streaming", "evict:rkv", *TIER_CANDIDATES)
KINDS = ("code7", "code5", "word", "time")
# kvpress's presses on the frontier's prompts: the two that found needles at 1/4 in
# eval-real (KeyDiff, StreamingLLM) and SnapKV (the observation-window classic); on the
# perplexity sequence the two best decoding presses there.
KVPRESS_NEEDLE_PRESSES = ("KeyDiffPress", "StreamingLLMPress", "SnapKVPress")
KVPRESS_DECODING_PRESSES = ("TOVAPress", "ExpectedAttentionPress")
SINK_TOKENS, WINDOW_TOKENS, PAGE_SIZE = 4, 32, 16
# The evaluation's prompts (development and the tests use lower indexes).
EVAL_FIRST_INDEX = 1000


@dataclass(frozen=True)
class FrontierSettings:
    candidates: tuple[str, ...] = RULE_CANDIDATES
    fractions: tuple[float, ...] = (0.25, 0.125)
    kinds: tuple[str, ...] = KINDS
    contexts: tuple[int, ...] = (1000,)
    depths: tuple[float, ...] = (0.2, 0.5, 0.8)
    per_depth: int = 2
    max_new_tokens: int = 24
    first_index: int = EVAL_FIRST_INDEX
    ppl_length: int = 1024
    ppl_sequences: int = 1
    ppl: bool = True
    peers: bool = True  # transformers' quantized cache (``real.qcache``)
    peer_candidates: tuple[str, ...] = ()  # (): the rule's choice
    kvpress: bool = True  # kvpress's presses at the frontier's fractions (``_kvpress``)
    kvpress_presses: tuple[str, ...] = KVPRESS_NEEDLE_PRESSES
    kvpress_decoding: tuple[str, ...] = KVPRESS_DECODING_PRESSES
    engine: bool = False  # the needle task through SGLang's engine too (``frontier_engine``)
    engine_candidates: tuple[str, ...] = ENGINE_CANDIDATES

    def __post_init__(self) -> None:
        from sglang_evict.scorers import SCORERS
        from sglang_evict_kernels.tier_format import TierFormat

        for text in (*self.candidates, *self.peer_candidates, *self.engine_candidates):
            candidate = Candidate.parse(text)
            if candidate.scorer not in SCORERS:
                raise ValueError(
                    f"--candidates {text}: scorer {candidate.scorer!r}; known: {sorted(SCORERS)}"
                )
            if candidate.bits is None:
                continue
            try:
                TierFormat(
                    bits=candidate.bits,
                    group_tokens=candidate.group_tokens,
                    outlier_tokens=candidate.outlier_tokens,
                    value_group_channels=candidate.value_group_channels,
                )
            except ValueError as error:
                raise ValueError(f"--candidates {text}: {error}") from None
        for fraction in self.fractions:
            if not 0.0 < fraction < 1.0:
                raise ValueError(f"--fractions: {fraction:g} is not in (0, 1)")
        if self.per_depth < 1 or self.max_new_tokens < 1 or self.ppl_sequences < 1:
            raise ValueError("--per-depth, --max-new-tokens and --ppl-sequences must be >= 1")
        if self.ppl_length < 256:
            raise ValueError(f"--ppl-length {self.ppl_length}: at least 256 tokens")


QUICK = dict(
    candidates=("evict:streaming", "3:32", "2:64"),
    fractions=(0.25,),
    kinds=("code7", "word"),
    depths=(0.5,),
    max_new_tokens=16,
    ppl_length=512,
    peers=False,
    kvpress=False,
)


def load(path: Path) -> dict:
    if path.is_file():
        results = json.loads(path.read_text())
        if results.get("format") != RESULTS_FORMAT:
            raise ValueError(f"{path} is not an eval-tier results file; choose another --out")
        return results
    return {"format": RESULTS_FORMAT, "weights": WEIGHTS_NOTE, "needle": {}, "perplexity": {}}


def run(model_path: Path, text_path: Path, out: Path, settings: FrontierSettings, *, progress=True):
    """Run (or resume) the frontier into ``out/results.json``; returns the results."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_evict.models.paged_model import paged_model
    from sglang_evict.quality.real import perplexity as ppl
    from sglang_evict.quality.real.needle import build_samples, prompt_style_of

    started = time.perf_counter()
    path = out / "results.json"
    results = load(path)
    results["settings"] = asdict(settings)
    results["model"], results["text"] = str(model_path), str(text_path)
    results["weights"] = weights_note_of(model_path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    results["prompt_style"] = prompt_style_of(tokenizer)
    text = text_path.read_text(encoding="utf-8")
    hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    model = paged_model(hf)
    shape = Shape.of(model)
    samples = build_samples(
        text,
        tokenizer,
        context_sizes=settings.contexts,
        depths=settings.depths,
        per_depth=settings.per_depth,
        first_index=settings.first_index,
        kinds=settings.kinds,
    )
    candidates = [Candidate.parse(c) for c in settings.candidates]
    runs = [(None, None)] + [(c, f) for c in candidates for f in settings.fractions]
    _needles(model, tokenizer, shape, samples, runs, settings, results, path, progress)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    sequences = ppl.sequences(ids, settings.ppl_length, settings.ppl_sequences)
    if settings.ppl:
        runs = [(None, None)] + [(c, f) for c in candidates for f in settings.fractions]
        _perplexity(model, shape, sequences, runs, settings, results, path, progress)
    if settings.peers:
        peer_inputs = (model_path, samples, sequences)
        _peers(model, tokenizer, shape, peer_inputs, settings, results, path, progress)
    if settings.kvpress:
        _kvpress(model_path, samples, sequences, settings, results, path, progress)
    if settings.engine:
        from sglang_evict.quality.real.frontier_engine import run_engine_needles

        run_engine_needles(
            model_path,
            tokenizer,
            samples,
            shape,
            settings,
            results,
            lambda: save(results, path),
            page_size=PAGE_SIZE,
            sink_tokens=SINK_TOKENS,
            window_tokens=WINDOW_TOKENS,  # raised for the tier by the model's window
            progress=progress,
            log_dir=out,
        )
    results["wall_s"] = round(results.get("wall_s", 0.0) + time.perf_counter() - started, 1)
    save(results, path)
    return results


def _peers(model, tokenizer, shape, inputs, settings, results, path, progress):
    """transformers' quantized cache on the same inputs (``real.qcache``), then the
    frontier's own candidates at exactly the fractions it held."""
    from sglang_evict.quality.real import perplexity as ppl
    from sglang_evict.quality.real import qcache

    model_path, samples, sequences = inputs
    peer = qcache.run(
        model_path,
        samples,
        settings.max_new_tokens,
        sequences if settings.ppl else [],
        ppl.PROMPT_TOKENS,
        path.parent,
        progress=progress,
    )
    results["peers"] = {"quantized_cache": peer}
    save(results, path)
    if peer["status"] != "ok":
        return
    candidates = [Candidate.parse(c) for c in peer_candidates(settings, results)]
    at = qcache.fractions(qcache.needle_rows(peer))
    runs = [(c, f) for c in candidates for f in at]
    _needles(model, tokenizer, shape, samples, runs, settings, results, path, progress)
    if settings.ppl:
        at = qcache.fractions(qcache.perplexity_rows(peer))
        runs = [(c, f) for c in candidates for f in at]
        _perplexity(model, shape, sequences, runs, settings, results, path, progress)


def _kvpress(model_path, samples, sequences, settings, results, path, progress):
    """kvpress's presses on the same token ids at the frontier's fractions, in kvpress's
    own environment (``quality.kvpress_bridge``): a press keeping ``f`` of the tokens in
    bfloat16 holds ``f`` of the bytes. Needles: the prompt compressed at the end of its
    prefill, then ``max_new_tokens`` decoded; perplexity: ``DecodingPress`` cutting the
    cache to ``f`` of the sequence every 32 steps (the frontier's cadence)."""
    from sglang_evict.quality import kvpress_bridge
    from sglang_evict.quality.real import perplexity as ppl
    from sglang_evict.quality.real.kvpress import PEER_MODULE, write_job

    job_settings = SimpleNamespace(
        kvpress_fractions=settings.fractions,
        ppl_budgets=[int(f * settings.ppl_length) for f in settings.fractions],
    )
    out = path.parent
    try:
        venv = kvpress_bridge.default_venv()
        if progress:
            print(f"kvpress: environment {venv} (created if missing)")
        versions = kvpress_bridge.ensure_venv(venv, create=True)
        job_path = write_job(
            out / "kvpress_job.json",
            model_path,
            job_settings,
            samples,
            sequences if settings.ppl else [],
        )
        job = json.loads(job_path.read_text())
        job["needle"]["presses"] = list(settings.kvpress_presses)
        job["needle"]["max_new_tokens"] = settings.max_new_tokens
        if "perplexity" in job:
            job["perplexity"]["presses"] = list(settings.kvpress_decoding)
            job["perplexity"]["cadence_tokens"] = 32
            job["perplexity"]["prompt_tokens"] = ppl.PROMPT_TOKENS
        job_path.write_text(json.dumps(job) + "\n")
        peer = kvpress_bridge.run_peer(
            venv, job_path, out / "kvpress_results.json", module=PEER_MODULE, progress=progress
        )
        record = {"status": "ok", **peer, "versions": peer["versions"] | versions}
    except kvpress_bridge.KVPressUnavailable as error:
        print(f"kvpress: not run: {error}")
        record = {"status": "not run", "reason": str(error)}
    results.setdefault("peers", {})["kvpress"] = record
    save(results, path)


def peer_candidates(settings: FrontierSettings, results: dict) -> tuple[str, ...]:
    """What runs at the peer's fractions: ``settings.peer_candidates``, or the rule's
    choice (the tier a server would run; eviction's figures at other bytes are on the
    frontier's lines)."""
    from sglang_evict.quality.real.frontier_report import apply_rule

    if settings.peer_candidates:
        return settings.peer_candidates
    by_name = {Candidate.parse(c).name: c for c in settings.candidates}
    choice = apply_rule(results)["choice"]
    return (by_name[choice],) if choice in by_name else ()


def _needles(model, tokenizer, shape, samples, runs, settings, results, path, progress):
    """Every ``(candidate, fraction)`` of ``runs`` on every sample not answered yet
    (``candidate`` None: the full cache)."""
    from tqdm import tqdm

    from sglang_evict.quality.real.needle import found

    todo = [
        (s, c, f)
        for s in samples
        for c, f in runs
        if _needle_key(s, c, f, settings) not in results["needle"]
    ]
    bar = tqdm(total=len(todo), desc="needle", unit="answer", disable=not progress)
    try:
        for sample, candidate, fraction in todo:
            bar.set_postfix_str(f"{candidate.name if candidate else 'full'} {fraction or ''}")
            length = len(sample.prompt_ids) + 1  # the pass runs with the first answer token
            config, spent = None, None
            if candidate is not None:
                try:
                    spent = spend(
                        candidate,
                        fraction=fraction,
                        length=length,
                        shape=shape,
                        min_budget=SINK_TOKENS + window_for(candidate, shape) + 1,
                    )
                except ValueError as error:  # too few bytes for it: a row saying so
                    results["needle"][_needle_key(sample, candidate, fraction, settings)] = {
                        "sample": sample.key,
                        "kind": sample.needle.kind,
                        "candidate": candidate.name,
                        "fraction": fraction,
                        "skipped": str(error),
                    }
                    bar.update(1)
                    continue
                config = _config(candidate, spent, shape)
            begun = time.perf_counter()
            ids, held, passes = needle_answer(
                model,
                sample.prompt_ids,
                config,
                max_new_tokens=settings.max_new_tokens,
                shape=shape,
            )
            answer = tokenizer.decode(ids, skip_special_tokens=True)
            results["needle"][_needle_key(sample, candidate, fraction, settings)] = {
                "sample": sample.key,
                "prompt_tokens": len(sample.prompt_ids),
                "kind": sample.needle.kind,
                "candidate": "full" if candidate is None else candidate.name,
                "fraction": fraction,
                "held_fraction": 1.0 if held is None else round(held.fraction, 4),
                "held_full_tokens": held and held.full_tokens,
                "held_tier_tokens": held and held.tier_tokens,
                "budget_tokens": spent and spent.budget_tokens,
                "tier_tokens": spent and spent.tier_tokens,
                "found": found(sample.needle, answer),
                "answer": answer[:120],
                "passes": passes,
                "seconds": round(time.perf_counter() - begun, 1),
            }
            save(results, path)
            bar.update(1)
    finally:
        bar.close()


def window_for(candidate: Candidate | None, shape) -> int:
    """The recent window a candidate keeps: ``WINDOW_TOKENS``, raised for a tier to the
    model's widest sliding window (its windowed layers do not read the tier: the server
    refuses a narrower one)."""
    if candidate is not None and candidate.bits is not None:
        return max(WINDOW_TOKENS, shape.window_tokens)
    return WINDOW_TOKENS


def _config(
    candidate: Candidate, spent, shape, cadence_tokens: int = 64, evict_prompt: bool = True
):
    return config_for(
        candidate,
        spent,
        page_size=PAGE_SIZE,
        sink_tokens=SINK_TOKENS,
        window_tokens=window_for(candidate, shape),
        cadence_tokens=cadence_tokens,
        evict_prompt=evict_prompt,
    )


def _needle_key(sample, candidate: Candidate | None, fraction: float | None, settings) -> str:
    """One answer's key: what decides it (the sample, the candidate, the fraction, the
    answer's length), so a run with other settings never reuses it."""
    name = "full" if candidate is None else candidate.name
    return f"{sample.key}|{name}|{fraction}|{settings.max_new_tokens}"


def _perplexity(model, shape, sequences, runs, settings, results, path, progress):
    """Decode-time perplexity (``quality.real.perplexity``'s protocol) for every
    ``(candidate, fraction)`` of ``runs`` not measured yet, the tier's bound and budget
    from ``spend`` over the whole sequence: at its end the request holds the fraction's
    bytes."""
    from tqdm import tqdm

    from sglang_evict.quality.real import perplexity as ppl

    todo = [(c, f) for c, f in runs if _ppl_key(c, f, settings) not in results["perplexity"]]
    bar = tqdm(total=len(todo), desc="perplexity", unit="run", disable=not progress)
    # The prompt (16 tokens) is protected; the window and sinks as in the needle task.
    try:
        for candidate, fraction in todo:
            config, spent = None, None
            if candidate is not None:
                try:
                    spent = spend(
                        candidate,
                        fraction=fraction,
                        length=settings.ppl_length,
                        shape=shape,
                        min_budget=ppl.PROMPT_TOKENS + window_for(candidate, shape) + 1,
                    )
                except ValueError as error:  # too few bytes for it: a row saying so
                    results["perplexity"][_ppl_key(candidate, fraction, settings)] = {
                        "candidate": candidate.name,
                        "fraction": fraction,
                        "skipped": str(error),
                    }
                    bar.update(1)
                    continue
                config = _config(candidate, spent, shape, cadence_tokens=32, evict_prompt=False)
            record = ppl.perplexity(model, sequences, config, page_size=PAGE_SIZE)
            results["perplexity"][_ppl_key(candidate, fraction, settings)] = {
                "candidate": "full" if candidate is None else candidate.name,
                "fraction": fraction,
                "spent_fraction": spent and round(spent.fraction, 4),
                "budget_tokens": spent and spent.budget_tokens,
                "tier_tokens": spent and spent.tier_tokens,
                **record,
            }
            save(results, path)
            bar.update(1)
    finally:
        bar.close()


def _ppl_key(candidate: Candidate | None, fraction: float | None, settings) -> str:
    name = "full" if candidate is None else candidate.name
    return f"{name}|{fraction}|{settings.ppl_length}x{settings.ppl_sequences}"
