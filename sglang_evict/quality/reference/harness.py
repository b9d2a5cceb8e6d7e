"""``sglang-evict eval``: scorer quality on the reference model, through the real path.

For every scorer x budget x page size, the held-out recall-chain sequences of each
task variant run as one continuous batch through ``reference_loop.generate`` on a
``TeacherForcedDriver``: SGLang's allocator, radix cache and KV pool, the plugin's
passes (scoring, selection, compaction, page frees) at every decode step. The same
sequences with no policy (plain SGLang memory management) are the full-cache
reference. Budgets are fractions of a sequence's total length; the policy's sinks,
window and cadence are fixed for the whole matrix (``EvalPolicy``).

Reported per run (per sequence, averaged over the variant's sequences):
    step_accuracy   answer steps equal to f(previous output)  (``task.score_chain``)
    exact_match     whole answer correct
    peak_pages_held KV pages held at the busiest decode step (pages of page_size
                    slots: the request's own pages plus its share of the tree's)
    pages_freed     pages the plugin's passes returned to the allocator
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sglang_evict.quality.reference.task import (
    VARIANTS,
    Sample,
    TaskSpec,
    held_out_samples,
    score_chain,
)

RESULTS_FORMAT = "sglang-evict/quality-results"
RESULTS_VERSION = 1
FULL_CACHE = "full"  # the method name of the no-eviction reference runs
ENGINE = "sglang-evict"
DEFAULT_SCORERS = ("streaming", "knorm", "triattention", "window", "rkv", "random")
DEFAULT_BUDGETS = (0.125, 0.25, 0.5)
DEFAULT_PAGE_SIZES = (1, 16)
# Data seed of the triattention calibration text: a training-range seed (the same
# distribution the model was trained on), never the evaluation's held-out seeds.
CALIBRATION_DATA_SEED = 9_999
CALIBRATION_SEQUENCES_PER_VARIANT = 16


@dataclass(frozen=True)
class ScorerEntry:
    """A scorer as the harness runs it: registry ``name`` plus parameters, shown as
    ``label`` (``window:mode=last``)."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        return ":".join([self.name, *(f"{k}={v}" for k, v in self.params)])

    def params_dict(self) -> dict[str, Any]:
        return dict(self.params)


def parse_scorer_entry(text: str) -> ScorerEntry:
    """``name`` or ``name:key=value:key=value`` (values read as JSON, else as strings);
    unknown scorers or parameters raise ``ValueError`` naming the known ones."""
    from sglang_evict.scorers import SCORERS, scorer_parameters

    name, *assignments = text.strip().split(":")
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; known: {sorted(SCORERS)}")
    params = []
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key:
            raise ValueError(f"scorer parameter {assignment!r} in {text!r} is not key=value")
        if key not in scorer_parameters(name):
            raise ValueError(
                f"scorer {name!r} has no parameter {key!r}; allowed: {scorer_parameters(name)}"
            )
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        params.append((key, value))
    return ScorerEntry(name, tuple(params))


@dataclass(frozen=True)
class EvalPolicy:
    """The policy knobs shared by every run (budget aside). Small sinks, window and
    cadence keep 12.5 % budgets legal on ~340-token sequences: a budget must exceed
    sink_tokens + window_tokens (``EvictionConfig``)."""

    sink_tokens: int = 4
    window_tokens: int = 16
    cadence_tokens: int = 16
    compaction: str = "hole_fill"
    query_window_tokens: int = 32


DEFAULT_SPEC = TaskSpec()
DEFAULT_POLICY = EvalPolicy()


@dataclass(frozen=True)
class EvalSettings:
    spec: TaskSpec = DEFAULT_SPEC  # the variant field is ignored: every variant runs
    variants: tuple[str, ...] = VARIANTS
    num_sequences: int = 12  # per variant
    seed: int = 0
    budget_fractions: tuple[float, ...] = DEFAULT_BUDGETS
    page_sizes: tuple[int, ...] = DEFAULT_PAGE_SIZES
    scorers: tuple[ScorerEntry, ...] = tuple(ScorerEntry(n) for n in DEFAULT_SCORERS)
    policy: EvalPolicy = DEFAULT_POLICY
    triattention_stats: str | None = None  # None: calibrate from the checkpoint

    def __post_init__(self) -> None:
        if self.num_sequences < 1:
            raise ValueError(f"num_sequences={self.num_sequences} must be >= 1")
        for fraction in self.budget_fractions:
            if not 0.0 < fraction < 1.0:
                raise ValueError(f"budget fraction {fraction} is out of range; allowed: (0, 1)")
        unknown = sorted(set(self.variants) - set(VARIANTS))
        if unknown or not self.variants:
            raise ValueError(f"unknown task variant(s) {unknown}; known: {list(VARIANTS)}")
        for page_size in self.page_sizes:
            if page_size < 1:
                raise ValueError(f"page size {page_size} must be >= 1")

    def variant_spec(self, variant: str) -> TaskSpec:
        return dataclasses.replace(self.spec, variant=variant)

    def budget_tokens(self, fraction: float) -> int:
        return max(1, round(fraction * self.spec.total_tokens))

    def samples(self) -> dict[str, list[Sample]]:
        return {
            v: held_out_samples(self.variant_spec(v), self.seed, self.num_sequences)
            for v in self.variants
        }

    def to_dict(self) -> dict:
        return {
            "task": {
                "num_facts": self.spec.num_facts,
                "num_distractors": self.spec.num_distractors,
                "chain_steps": self.spec.chain_steps,
                "total_tokens": self.spec.total_tokens,
                "variants": list(self.variants),
            },
            "num_sequences_per_variant": self.num_sequences,
            "seed": self.seed,
            "budget_fractions": list(self.budget_fractions),
            "budget_tokens": [self.budget_tokens(f) for f in self.budget_fractions],
            "page_sizes": list(self.page_sizes),
            "scorers": [s.label for s in self.scorers],
            "policy": dataclasses.asdict(self.policy),
        }


QUICK_SETTINGS = dict(
    spec=TaskSpec(num_facts=8, num_distractors=32, chain_steps=4),
    num_sequences=2,
    policy=EvalPolicy(sink_tokens=2, window_tokens=4, cadence_tokens=4, query_window_tokens=8),
)


def load_checkpoint(path: str | Path):
    """The reference model of ``path`` (an HF folder: config.json + safetensors)."""
    from sglang_evict.quality.reference.task import VOCAB_SIZE

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a model folder (no config.json); the reference model is in "
            f"benches/quality/checkpoint (train one with benches/quality/train_reference_model.py)"
        )
    import transformers
    from transformers import LlamaForCausalLM

    transformers.utils.logging.disable_progress_bar()
    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    if model.config.vocab_size != VOCAB_SIZE:
        raise ValueError(
            f"{path}: vocab_size {model.config.vocab_size} is not the task's {VOCAB_SIZE}; "
            f"is this the recall-chain reference model?"
        )
    return model.eval()


@dataclass
class RunOutcome:
    """One (method, page size, budget, variant) run over its sequences; memory figures
    are sums over the sequences (``_summarise`` divides)."""

    chains: list[list[int]]
    steps_correct: list[int]
    exact: list[bool]
    peak_tokens_held: int  # per sequence: slots in use at its busiest decode step
    mean_tokens_held: float  # per sequence: mean over its decode steps
    pages_freed: int
    tokens_evicted: int
    passes: int
    wall_s: float


def run_sequence(model, sample: Sample, page_size: int, config=None, on_step=None):
    """One sample through ``generate`` on a fresh driver (``config`` None: no eviction).

    One request per driver: the task's prompts are identical within a variant, and the
    reference loop admits a prompt whose every token is already cached with nothing left
    to prefill (SGLang's scheduler always leaves one token to compute)."""
    from sglang_evict.models.reference_loop import GenerationRequest, generate
    from sglang_evict.models.reference_model import PagedLlama
    from sglang_evict.quality.forced import TeacherForcedDriver

    paged = PagedLlama(model)
    length = sample.spec.total_tokens
    driver = TeacherForcedDriver.for_model(
        paged,
        forced={"s": sample.forced},
        page_size=page_size,
        num_tokens=length + 4 * page_size,
        config=config,
        max_requests=2,
        max_context=length + 2 * page_size,
    )
    request = GenerationRequest("s", list(sample.prompt), len(sample.forced) + len(sample.answer))
    return generate(driver, paged, [request], on_step=on_step)


def run_sequences(
    model,
    samples: Sequence[Sample],
    page_size: int,
    config=None,
    on_step: Callable[[], None] | None = None,
) -> RunOutcome:
    """Every sample through ``run_sequence``; scores and memory figures."""
    start = time.perf_counter()
    outcome = RunOutcome([], [], [], 0, 0.0, 0, 0, 0, 0.0)
    for sample in samples:
        result = run_sequence(
            model,
            sample,
            page_size,
            config,
            on_step=(lambda *_: on_step()) if on_step is not None else None,
        )
        chain = result.outputs["s"][len(sample.forced) :]
        score = score_chain(sample, chain)
        outcome.chains.append(chain)
        outcome.steps_correct.append(score.steps_correct)
        outcome.exact.append(score.exact)
        passes = [p for _, _, p in result.passes]
        outcome.peak_tokens_held += max(result.held_tokens)
        outcome.mean_tokens_held += sum(result.held_tokens) / len(result.held_tokens)
        outcome.pages_freed += sum(p.pages_freed for p in passes)
        outcome.tokens_evicted += sum(p.tokens_evicted for p in passes)
        outcome.passes += len(passes)
    outcome.wall_s = time.perf_counter() - start
    return outcome


def _summarise(
    outcomes: dict[str, RunOutcome], samples: dict[str, list[Sample]], page_size: int
) -> dict:
    """Metrics of one method/page size/budget over every variant (per sequence)."""
    num_sequences = sum(len(v) for v in samples.values())
    steps = sum(len(s.answer) for v in samples.values() for s in v)
    correct = sum(sum(o.steps_correct) for o in outcomes.values())
    exact = sum(sum(o.exact) for o in outcomes.values())
    by_variant = {}
    for variant, outcome in outcomes.items():
        n = len(samples[variant])
        by_variant[variant] = {
            "step_accuracy": sum(outcome.steps_correct)
            / sum(len(s.answer) for s in samples[variant]),
            "exact_match": sum(outcome.exact) / n,
            "steps_correct": outcome.steps_correct,
        }
    return {
        "step_accuracy": correct / steps,
        "exact_match": exact / num_sequences,
        "peak_pages_held": sum(o.peak_tokens_held for o in outcomes.values())
        / page_size
        / num_sequences,
        "mean_pages_held": sum(o.mean_tokens_held for o in outcomes.values())
        / page_size
        / num_sequences,
        "pages_freed": sum(o.pages_freed for o in outcomes.values()) / num_sequences,
        "tokens_evicted": sum(o.tokens_evicted for o in outcomes.values()) / num_sequences,
        "passes": sum(o.passes for o in outcomes.values()) / num_sequences,
        "wall_s": sum(o.wall_s for o in outcomes.values()),
        "num_sequences": num_sequences,
        "by_variant": by_variant,
    }


def calibrate_triattention(model, settings: EvalSettings, out_path: Path) -> Path:
    """Triattention statistics of ``model`` over training-distribution sequences (data
    seed ``CALIBRATION_DATA_SEED``, not the held-out set), one sequence per chunk; the
    same computation as ``sglang-evict calibrate``."""
    from sglang_evict.calibrate import calibrate
    from sglang_evict.quality.reference.task import make_sample
    from sglang_evict.scorers.triattention_stats import save_stats

    token_ids = []
    for variant in settings.variants:
        spec = settings.variant_spec(variant)
        for i in range(CALIBRATION_SEQUENCES_PER_VARIANT):
            token_ids.extend(make_sample(spec, CALIBRATION_DATA_SEED, i).tokens)
    stats = calibrate(
        model,
        torch.tensor(token_ids, dtype=torch.int64),
        chunk_tokens=settings.spec.total_tokens,
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    save_stats(stats, out_path)
    return out_path


def _policy_config(settings: EvalSettings, entry: ScorerEntry, budget: int, page_size: int):
    from sglang_evict.config import EvictionConfig

    policy = settings.policy
    return EvictionConfig(
        kv_budget_tokens=budget,
        cadence_tokens=policy.cadence_tokens,
        sink_tokens=policy.sink_tokens,
        window_tokens=policy.window_tokens,
        scorer=entry.name,
        scorer_params=entry.params_dict(),
        compaction=policy.compaction,
        page_size=page_size,
        query_window_tokens=policy.query_window_tokens,
    )


def run_eval(
    checkpoint: str | Path,
    settings: EvalSettings,
    out_dir: str | Path,
    *,
    progress: bool = True,
) -> dict:
    """Run the matrix; returns the results document (see ``RESULTS_FORMAT``)."""
    from tqdm import tqdm

    start = time.perf_counter()
    checkpoint = Path(checkpoint)
    out_dir = Path(out_dir)
    model = load_checkpoint(checkpoint)
    samples = settings.samples()
    skipped: list[dict] = []
    scorers = list(settings.scorers)
    calibration = None
    if any(entry.name == "triattention" for entry in scorers):
        stats_path = settings.triattention_stats
        if stats_path is None:
            stats_path = str(calibrate_triattention(model, settings, out_dir / "triattention.json"))
            calibration = {
                "stats_path": stats_path,
                "data_seed": CALIBRATION_DATA_SEED,
                "sequences_per_variant": CALIBRATION_SEQUENCES_PER_VARIANT,
            }
        scorers = [
            ScorerEntry(e.name, (("stats_path", stats_path), *e.params))
            if e.name == "triattention" and "stats_path" not in e.params_dict()
            else e
            for e in scorers
        ]
    runs = []  # (method label, scorer entry or None, page size, fraction, budget tokens)
    for page_size in settings.page_sizes:
        runs.append((FULL_CACHE, None, page_size, 1.0, settings.spec.total_tokens))
        for entry, shown in zip(scorers, settings.scorers, strict=True):
            for fraction in settings.budget_fractions:
                runs.append(
                    (shown.label, entry, page_size, fraction, settings.budget_tokens(fraction))
                )
    steps_per_run = sum(
        len(group) * (s.spec.forced_tokens + s.spec.chain_steps)
        for group in samples.values()
        for s in group[:1]
    )
    bar = tqdm(
        total=len(runs) * steps_per_run,
        desc="eval",
        unit="step",
        disable=not progress,
        dynamic_ncols=True,
    )
    entries: list[dict] = []
    full_by_page: dict[int, dict] = {}
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny per-token matmuls: more threads only contend
    try:
        for label, entry, page_size, fraction, budget in runs:
            bar.set_postfix_str(f"{label} page {page_size} budget {fraction:g}")
            config = None
            if entry is not None:
                try:
                    config = _policy_config(settings, entry, budget, page_size)
                except ValueError as error:
                    skipped.append(
                        {
                            "engine": ENGINE,
                            "method": label,
                            "page_size": page_size,
                            "budget_fraction": fraction,
                            "reason": str(error),
                        }
                    )
                    bar.update(steps_per_run)
                    continue
            outcomes = {
                variant: run_sequences(model, group, page_size, config, on_step=bar.update)
                for variant, group in samples.items()
            }
            summary = _summarise(outcomes, samples, page_size)
            record = {
                "engine": ENGINE,
                "method": label,
                "page_size": page_size,
                "budget_fraction": fraction,
                "budget_tokens": budget,
                **summary,
            }
            if entry is None:
                full_by_page[page_size] = record
            entries.append(record)
    finally:
        torch.set_num_threads(previous)
        bar.close()
    for record in entries:
        full = full_by_page[record["page_size"]]
        record["relative_step_accuracy"] = _ratio(record["step_accuracy"], full["step_accuracy"])
        record["full_cache_peak_pages"] = full["peak_pages_held"]
    from importlib.metadata import version

    import transformers

    return {
        "format": RESULTS_FORMAT,
        "version": RESULTS_VERSION,
        "checkpoint": shown_path(checkpoint),
        "checkpoint_sha256": checkpoint_digest(checkpoint),
        "settings": settings.to_dict(),
        "triattention_calibration": calibration,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "sglang": version("sglang"),  # no import: only the adapter imports SGLang
        },
        "entries": entries,
        "skipped": skipped,
        "wall_s": round(time.perf_counter() - start, 1),
    }


def _ratio(value: float, reference: float) -> float | None:
    """``value / reference``; None when the reference is 0 (nothing to be relative to:
    the gate fails such entries rather than call them perfect)."""
    return value / reference if reference > 0 else None


def checkpoint_digest(checkpoint: Path) -> dict[str, str]:
    """sha256 of each safetensors file of the checkpoint (what ``sha256sum`` prints)."""
    import hashlib

    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(checkpoint.glob("*.safetensors"))
    }


def shown_path(path: Path) -> str:
    """``path`` relative to the project root when inside it (results are committed)."""
    root = Path(__file__).resolve().parents[2]
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path.resolve())


def write_results(results: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    return path
