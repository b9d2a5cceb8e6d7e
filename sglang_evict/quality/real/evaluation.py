"""``sglang-evict eval-real``: what eviction does to a real pretrained model's answers.

SmolLM2-135M-Instruct (``sglang-evict real-model``: 4-bit weights dequantised) and the
Paul Graham essays (``sglang-evict real-text``), two tasks, each through the path a user
runs, every server scorer at every budget against the full cache on the same inputs:

    needle       SGLang's real engine, ``--kv-evict-prompt``, page size 16
                 (``quality.real.needle_engine``); retrieval accuracy
    perplexity   essay text one token per decode step through the real decode path
                 (``quality.real.perplexity``); perplexity against the full cache's
    kvpress      (``--kvpress``) kvpress 0.5.5's presses on the same prompts and
                 sequences, in its own environment (``quality.real.kvpress_peer``)

Everything lands in ``<out>/results.json`` as it completes, so an interrupted run
resumes; ``results.md`` and ``results.png`` are drawn from it
(``quality.real.report``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sglang_evict.models.real_model import WEIGHTS_NOTE, weights_note_of

RESULTS_FORMAT = "sglang-evict/real-model-quality"
RESULTS_VERSION = 1
SERVER_SCORERS = ("rkv", "window", "knorm", "streaming", "triattention", "random")
DEFAULT_FRACTIONS = (0.125, 0.25, 0.5)
DEFAULT_CONTEXTS = (1000, 2000)
# kvpress's presses on the needle prompts: the goal's budget (1/4) and the one above it.
# Each press prefills every prompt in Hugging Face eager attention on the CPU (about 10
# CPU-seconds a 2k-token prompt); 1/8 as well would add an hour to the full run on 2 cores.
DEFAULT_KVPRESS_FRACTIONS = (0.25, 0.5)
DEFAULT_PPL_BUDGETS = (256, 512, 1024)
DEFAULT_PPL_LENGTH = 2048
DEFAULT_PPL_SEQUENCES = 1
# The published evaluation's needles and haystacks (indexes from here); development,
# diagnosis and the tests use lower indexes, so no figure is tuned on its own inputs.
EVAL_FIRST_INDEX = 1000
# The model's triattention statistics, calibrated on its own generated text (committed;
# benches/quality/real/README.md says how they were made).
DEFAULT_STATS = (
    Path(__file__).resolve().parents[2]
    / "benches"
    / "quality"
    / "real"
    / "triattention-smollm2.safetensors"
)


@dataclass(frozen=True)
class RealEvalSettings:
    scorers: tuple[str, ...] = SERVER_SCORERS
    tasks: tuple[str, ...] = ("needle", "perplexity")
    fractions: tuple[float, ...] = DEFAULT_FRACTIONS
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    per_depth: int = 2
    ppl_budgets: tuple[int, ...] = DEFAULT_PPL_BUDGETS
    ppl_length: int = DEFAULT_PPL_LENGTH
    ppl_sequences: int = DEFAULT_PPL_SEQUENCES
    kvpress: bool = False
    kvpress_fractions: tuple[float, ...] = DEFAULT_KVPRESS_FRACTIONS
    notes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.scorers) - set(SERVER_SCORERS))
        if unknown or not self.scorers:
            raise ValueError(f"unknown scorer(s) {unknown}; known: {list(SERVER_SCORERS)}")
        bad_tasks = sorted(set(self.tasks) - {"needle", "perplexity"})
        if bad_tasks or not self.tasks:
            raise ValueError(f"unknown task(s) {bad_tasks}; known: needle, perplexity")
        for fraction in (*self.fractions, *self.kvpress_fractions):
            if not 0.0 < fraction < 1.0:
                raise ValueError(
                    f"--budgets: {fraction:g} is not a fraction of the context in (0, 1); a "
                    f"budget at or above the context evicts nothing"
                )
        for context in self.contexts:
            if context < 64:
                raise ValueError(f"--contexts: {context} tokens is too small a haystack (>= 64)")
        for depth in self.depths:
            if not 0.0 <= depth <= 1.0:
                raise ValueError(f"--depths: {depth:g} is outside [0, 1]")
        if self.per_depth < 1 or self.ppl_sequences < 1:
            raise ValueError("--per-depth and --ppl-sequences must be >= 1")
        for budget in self.ppl_budgets:
            if not 0 < budget < self.ppl_length:
                raise ValueError(
                    f"--ppl-budgets: {budget} is not below the {self.ppl_length}-token "
                    f"sequences (--ppl-length): a budget at or above them evicts nothing"
                )


# The whole matrix (every scorer, both tasks), small: under 5 minutes on 2 CPU cores.
QUICK = dict(
    fractions=(0.25,),
    kvpress_fractions=(0.25,),
    contexts=(1000,),
    depths=(0.25, 0.75),
    per_depth=1,
    ppl_budgets=(128,),
    ppl_length=256,
    ppl_sequences=1,
)


def check_model(model_path: Path) -> dict:
    """The folder's config.json, refused in one line unless it holds an architecture the
    engine tests validate (``srt.server_args.VALIDATED_ARCHITECTURES``: what the
    engine's CPU settings and the reference path, ``models.paged_model``, run)."""
    config_path = model_path / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"--model {model_path}: no config.json there; give a Hugging Face model folder "
            f"(sglang-evict real-model builds one)"
        ) from None
    except (OSError, ValueError) as error:
        raise ValueError(f"--model {model_path}: config.json cannot be read ({error})") from None
    from sglang_evict.srt.server_args import VALIDATED_ARCHITECTURES

    architectures = config.get("architectures") or []
    if not any(a in VALIDATED_ARCHITECTURES for a in architectures):
        raise ValueError(
            f"--model {model_path}: {architectures or config.get('model_type')} is not an "
            f"architecture the evaluation runs; one of {', '.join(VALIDATED_ARCHITECTURES)}"
        )
    return config


def load_results(path: Path) -> dict:
    if path.is_file():
        results = json.loads(path.read_text())
        if results.get("format") != RESULTS_FORMAT:
            raise ValueError(f"{path} is not an eval-real results file; choose another --out")
        return results
    return {
        "format": RESULTS_FORMAT,
        "version": RESULTS_VERSION,
        "weights": WEIGHTS_NOTE,
        "needle_answers": {},
        "perplexity": {},
        "kvpress": None,
    }


def save_results(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


def run(
    model_path: Path,
    text_path: Path,
    out: Path,
    settings: RealEvalSettings,
    *,
    stats: str | None,
    progress: bool = True,
    kvpress_venv: Path | None = None,
) -> dict:
    """Run (or resume) the matrix into ``out/results.json``; returns the results."""
    from transformers import AutoTokenizer

    check_model(model_path)
    started = time.perf_counter()
    (out / "logs").mkdir(parents=True, exist_ok=True)  # the engines' logs
    path = out / "results.json"
    results = load_results(path)
    results["settings"] = asdict(settings)
    results["model"] = str(model_path)
    results["weights"] = weights_note_of(model_path)
    results["text"] = str(text_path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    from sglang_evict.quality.real.needle import prompt_style_of

    results["prompt_style"] = prompt_style_of(tokenizer)
    text = text_path.read_text(encoding="utf-8")
    if "triattention" in settings.scorers and stats is None:
        raise ValueError(
            "triattention needs the model's statistics: --triattention-stats FILE "
            "(sglang-evict calibrate makes one), or leave triattention out of --scorers"
        )
    needle_samples = []
    if "needle" in settings.tasks:
        from sglang_evict.quality.real.needle import build_samples
        from sglang_evict.quality.real.needle_engine import run_needle

        needle_samples = build_samples(
            text,
            tokenizer,
            context_sizes=settings.contexts,
            depths=settings.depths,
            per_depth=settings.per_depth,
            first_index=EVAL_FIRST_INDEX,
        )
        run_needle(
            model_path,
            needle_samples,
            settings.scorers,
            settings.fractions,
            results["needle_answers"],
            triattention_stats=stats,
            save=lambda: save_results(results, path),
            progress=progress,
            log_dir=out / "logs",
        )
        save_results(results, path)
    ppl_sequences = []
    if "perplexity" in settings.tasks:
        ppl_sequences = _run_perplexity(
            model_path, tokenizer, text, settings, results, stats, path, progress
        )
    if settings.kvpress:
        from sglang_evict.quality.real.kvpress import run_kvpress

        results["kvpress"] = run_kvpress(
            model_path, settings, needle_samples, ppl_sequences, out, kvpress_venv, progress
        )
    results["wall_s"] = round(results.get("wall_s", 0.0) + time.perf_counter() - started, 1)
    save_results(results, path)
    return results


def _run_perplexity(model_path, tokenizer, text, settings, results, stats, path, progress):
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from sglang_evict.models.paged_model import paged_model
    from sglang_evict.quality.real import perplexity as ppl

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    sequences = ppl.sequences(ids, settings.ppl_length, settings.ppl_sequences)
    policy = ppl.PerplexityPolicy()
    runs = [("full", None)] + [(s, b) for s in settings.scorers for b in settings.ppl_budgets]
    todo = [(s, b) for s, b in runs if f"{s}|{b}" not in results["perplexity"]]
    if not todo:
        return sequences
    hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    model = paged_model(hf)
    steps = settings.ppl_sequences * (settings.ppl_length - ppl.PROMPT_TOKENS)
    bar = tqdm(
        total=len(runs) * steps,
        initial=(len(runs) - len(todo)) * steps,
        desc="perplexity",
        unit="token",
        disable=not progress,
        dynamic_ncols=True,
    )
    try:
        for scorer, budget in todo:
            bar.set_postfix_str(f"{scorer} budget {budget}")
            config = None
            if scorer != "full":
                config = ppl.config_for(
                    policy, scorer, budget, stats if scorer == "triattention" else None
                )
            record = ppl.perplexity(
                model,
                sequences,
                config,
                page_size=policy.page_size,
                on_step=lambda *_: bar.update(1),
            )
            results["perplexity"][f"{scorer}|{budget}"] = {
                "method": scorer,
                "budget_tokens": budget,
                "length": settings.ppl_length,
                **record,
            }
            save_results(results, path)
    finally:
        bar.close()
    return sequences
