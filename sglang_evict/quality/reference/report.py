"""Views of a results document: the plot, the Markdown table, and the accuracy gate.

All three read only the JSON that ``sglang-evict eval`` writes (``RESULTS_FORMAT``), so
they also work on a results file from another machine or an older run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from sglang_evict.quality.reference.harness import ENGINE, FULL_CACHE, RESULTS_FORMAT


def load_results(path: str | Path, *, for_rendering: bool = False) -> dict:
    """A results document; a missing file, bad JSON, another format or an entry field of
    the wrong type raise ``FileNotFoundError``/``ValueError`` saying which and how to get
    a good one. ``for_rendering`` also requires what the table and the plot read."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"results file {path} does not exist; write one with `sglang-evict eval --out DIR`"
        )
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"results file {path} is not valid JSON: {error}") from None
    if not isinstance(results, dict) or results.get("format") != RESULTS_FORMAT:
        raise ValueError(
            f"results file {path} is not an `sglang-evict eval` results document "
            f"(format {RESULTS_FORMAT!r} expected)"
        )
    entries = results.get("entries")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"results file {path} has no list of entries")
    for i, entry in enumerate(entries):
        fields = dict(_ENTRY_FIELDS)
        if for_rendering:
            fields |= _RENDERED_ENTRY_FIELDS
            fields |= _PEER_FIELDS if entry.get("engine") == "kvpress" else _PAGED_FIELDS
        missing = [k for k in fields if k not in entry]
        if missing:
            raise ValueError(f"results file {path}: entry {i} lacks {missing}")
        for name, (is_valid, expected) in {**fields, **_OPTIONAL_ENTRY_FIELDS}.items():
            if name in entry and not is_valid(entry[name]):
                raise ValueError(
                    f"results file {path}: entry {i} field {name!r} must be {expected}, got "
                    f"{entry[name]!r}; regenerate it with `sglang-evict eval --out DIR`"
                )
    settings = results.get("settings")
    task = settings.get("task") if isinstance(settings, dict) else None
    if for_rendering and not (
        isinstance(task, dict)
        and set(_TASK_FIELDS) <= set(task)
        and "num_sequences_per_variant" in settings
    ):
        raise ValueError(
            f"results file {path} lacks settings.task {list(_TASK_FIELDS)} or "
            f"settings.num_sequences_per_variant (what it measured); regenerate it with "
            f"`sglang-evict eval --out DIR`"
        )
    return results


def _number(low: float, high: float | None = None, *, low_open: bool = False):
    def is_valid(value) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        above = value > low if low_open else value >= low
        return math.isfinite(value) and above and (high is None or value <= high)

    return is_valid


def _string(value) -> bool:
    return isinstance(value, str)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# field -> (check, what it must be): what the gate reads, what the table and plot read.
_ENTRY_FIELDS = {
    "engine": (_string, "a string"),
    "method": (_string, "a string"),
    "budget_fraction": (_number(0, 1, low_open=True), "a number in (0, 1]"),
    "step_accuracy": (_number(0, 1), "a number in [0, 1]"),
    "relative_step_accuracy": (
        lambda v: v is None or _number(0)(v),
        "a number >= 0 or null (full cache scored 0)",
    ),
}
_TASK_FIELDS = ("variants", "num_facts", "num_distractors", "chain_steps", "total_tokens")
_RENDERED_ENTRY_FIELDS = {
    "budget_tokens": (_count, "an integer >= 0"),
    "exact_match": (_number(0, 1), "a number in [0, 1]"),
}
_PAGED_FIELDS = {
    "page_size": (lambda v: _count(v) and v >= 1, "an integer >= 1"),
    "peak_pages_held": (_number(0), "a number >= 0"),
    "pages_freed": (_number(0), "a number >= 0"),
}
_PEER_FIELDS = {"peak_tokens_held": (_number(0), "a number >= 0")}
_OPTIONAL_ENTRY_FIELDS = {
    "page_size": (lambda v: v is None or (_count(v) and v >= 1), "an integer >= 1 or null"),
    "budget_tokens": (_count, "an integer >= 0"),
}


def best_scorer(results: dict, scorers) -> str:
    """Of ``scorers``, the one with the highest step accuracy at the largest evicting
    budget the results hold (plugin engine, mean over page sizes); ties go to the name
    first in order. It chose ``config.DEFAULT_SCORER`` on the reference model's results
    until the real model's took over (``real_report.best_scorer``).

    Why that budget: it is where the scorers that need no calibration are usable at all
    in the committed results (at 25 % none of them answers more than 16 % of the steps,
    and their order there says little about a deployment that keeps enough KV)."""
    scorers = list(scorers)
    ours = [
        e
        for e in results["entries"]
        if e["engine"] == ENGINE and e["method"] in scorers and e["budget_fraction"] < 1
    ]
    missing = sorted(set(scorers) - {e["method"] for e in ours})
    if missing:
        raise ValueError(f"the results hold no evicting entries for scorer(s) {missing}")
    largest = max(e["budget_fraction"] for e in ours)

    def accuracy(scorer: str) -> float:
        values = [
            e["step_accuracy"]
            for e in ours
            if e["method"] == scorer and math.isclose(e["budget_fraction"], largest)
        ]
        if not values:
            raise ValueError(f"scorer {scorer} was not measured at budget {largest:g}")
        return sum(values) / len(values)

    return max(sorted(scorers), key=accuracy)


def scorer_of(method: str) -> str:
    """``window:mode=last`` -> ``window``; ``kvpress:SnapKVPress(decoding)`` unchanged."""
    return method if method.startswith("kvpress:") else method.split(":")[0]


# --- the gate ------------------------------------------------------------------------


@dataclass(frozen=True)
class GateFailure:
    entry: dict
    value: float
    floor: float

    def describe(self) -> str:
        e = self.entry
        page = e.get("page_size")
        where = f"page size {page}" if page is not None else "no pages"
        if math.isnan(self.value):
            return (
                f"{e['engine']} {e['method']} at budget {e['budget_fraction']:g}, {where}: the "
                f"full cache's step accuracy is 0, so no accuracy can be held relative to it "
                f"(is the checkpoint the trained reference model?)"
            )
        return (
            f"{e['engine']} {e['method']} at budget {e['budget_fraction']:g} "
            f"({e.get('budget_tokens', '?')} tokens), {where}: relative step accuracy "
            f"{self.value:.3f} < floor {self.floor:g} (step accuracy "
            f"{e['step_accuracy']:.3f})"
        )


def gate(
    results: dict,
    floor: float,
    *,
    scorers: list[str] | None = None,
    budgets: list[float] | None = None,
    page_sizes: list[int] | None = None,
    engines: list[str] | None = None,
    full_cache_floor: float | None = None,
) -> tuple[list[dict], list[GateFailure]]:
    """(checked entries, failures): entries whose step accuracy relative to the full
    cache of their engine and page size is below ``floor``. Filters narrow the entries;
    a filter naming something the results do not hold raises ``ValueError`` (a gate
    that silently checks nothing is no gate). ``full_cache_floor`` also checks the full
    cache's absolute step accuracy."""
    if not 0.0 <= floor <= 1.5:
        raise ValueError(f"floor={floor} is out of range; allowed: [0, 1.5]")
    entries = results["entries"]
    engines = engines or [ENGINE]
    candidates = [e for e in entries if e["engine"] in engines]
    known_engines = sorted({e["engine"] for e in entries})
    if not candidates:
        raise ValueError(f"no entries of engine(s) {engines}; the results hold {known_engines}")
    if scorers:
        known = sorted(
            {scorer_of(e["method"]) for e in candidates} | {e["method"] for e in candidates}
        )
        unknown = [s for s in scorers if s not in known]
        if unknown:
            raise ValueError(f"unknown scorer(s) {unknown}; the results hold {known}")
        candidates = [
            e for e in candidates if e["method"] in scorers or scorer_of(e["method"]) in scorers
        ]
    if budgets:
        known_budgets = sorted({e["budget_fraction"] for e in candidates})
        unknown = [b for b in budgets if not any(math.isclose(b, k) for k in known_budgets)]
        if unknown:
            raise ValueError(f"unknown budget(s) {unknown}; the results hold {known_budgets}")
        candidates = [
            e for e in candidates if any(math.isclose(e["budget_fraction"], b) for b in budgets)
        ]
    if page_sizes:
        known_pages = sorted({e.get("page_size") for e in candidates}, key=str)
        unknown = [p for p in page_sizes if p not in known_pages]
        if unknown:
            raise ValueError(f"unknown page size(s) {unknown}; the results hold {known_pages}")
        candidates = [e for e in candidates if e.get("page_size") in page_sizes]
    failures = []
    checked = []
    for entry in candidates:
        is_full = entry["method"] in (FULL_CACHE, "kvpress:none")
        if is_full:
            if full_cache_floor is not None:
                checked.append(entry)
                if entry["step_accuracy"] < full_cache_floor:
                    failures.append(GateFailure(entry, entry["step_accuracy"], full_cache_floor))
            continue
        checked.append(entry)
        value = entry["relative_step_accuracy"]
        if value is None:  # the full cache scored 0: no reference to hold
            failures.append(GateFailure(entry, float("nan"), floor))
        elif not float(value) >= floor:
            failures.append(GateFailure(entry, float(value), floor))
    if not checked:
        raise ValueError("the filters leave no evicting entry to check")
    return checked, failures


# --- the table -----------------------------------------------------------------------


def markdown_table(results: dict) -> str:
    """One row per engine/method/page size/budget: step accuracy (all, per variant),
    exact match, pages held and freed (tokens for kvpress, which has no pages)."""
    variants = results["settings"]["task"]["variants"]
    head = (
        "| engine | method | page | budget | step acc | "
        + " | ".join(f"{v}" for v in variants)
        + " | rel. to full | exact | peak pages held | pages freed |"
    )
    rule = "|" + "---|" * (head.count("|") - 1)
    rows = [head, rule]
    order = {"sglang-evict": 0, "kvpress": 1}
    entries = sorted(
        results["entries"],
        key=lambda e: (
            order.get(e["engine"], 2),
            e.get("page_size") or 0,
            e["method"] != FULL_CACHE and e["method"] != "kvpress:none",
            e["method"],
            -e["budget_fraction"],
        ),
    )
    for e in entries:
        per_variant = " | ".join(
            f"{e['by_variant'][v]['step_accuracy']:.3f}" if v in e.get("by_variant", {}) else "-"
            for v in variants
        )
        if e["engine"] == "kvpress":
            held = f"{e['peak_tokens_held']:.0f} tok"
            freed = "n/a"
            page = "-"
        else:
            held = f"{e['peak_pages_held']:.1f}"
            freed = f"{e['pages_freed']:.1f}"
            page = str(e["page_size"])
        budget = "full" if e["budget_fraction"] >= 1.0 else f"{e['budget_fraction'] * 100:g}%"
        rows.append(
            f"| {e['engine']} | {e['method']} | {page} | {budget} ({e['budget_tokens']}) | "
            f"{e['step_accuracy']:.3f} | {per_variant} | {_fmt(e['relative_step_accuracy'])} | "
            f"{e['exact_match']:.2f} | {held} | {freed} |"
        )
    return "\n".join(rows) + "\n"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


# --- the plot ------------------------------------------------------------------------


# One colour per scoring idea, shared by the plugin's scorer and kvpress's press.
_COLOURS = {
    "streaming": "tab:red",
    "StreamingLLMPress": "tab:red",
    "knorm": "tab:blue",
    "KnormPress": "tab:blue",
    "window": "tab:green",
    "SnapKVPress": "tab:green",
    "TOVAPress": "tab:olive",
    "triattention": "tab:purple",
    "ExpectedAttentionPress": "tab:purple",
    "rkv": "tab:orange",
    "random": "tab:gray",
}


def _colour(method: str) -> str | None:
    name = method.removeprefix("kvpress:").split("(")[0].split(":")[0]
    return _COLOURS.get(name)


def plot(results: dict, path: str | Path) -> Path:
    """Step accuracy vs budget, one line per method; a panel per page size, and one for
    kvpress (no pages) when its entries are present. PNG via matplotlib's Agg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = results["entries"]
    ours = [e for e in entries if e["engine"] == ENGINE]
    peers = [e for e in entries if e["engine"] == "kvpress"]
    page_sizes = sorted({e["page_size"] for e in ours})
    panels = [
        (f"sglang-evict (decode-time), page size {p}", [e for e in ours if e["page_size"] == p])
        for p in page_sizes
    ]
    if peers:
        panels.append(("kvpress 0.5.5 (solid: prefill, dashed: decoding)", peers))
    figure, axes = plt.subplots(
        1, len(panels), figsize=(5.0 * len(panels), 5.4), sharey=True, squeeze=False
    )
    budgets = sorted({e["budget_fraction"] for e in entries if e["budget_fraction"] < 1})
    for ax, (title, group) in zip(axes[0], panels, strict=True):
        full = [e for e in group if e["method"] in (FULL_CACHE, "kvpress:none")]
        if full:
            ax.axhline(full[0]["step_accuracy"], color="black", linestyle=":", label="full cache")
        methods = sorted({e["method"] for e in group} - {FULL_CACHE, "kvpress:none"})
        for method in methods:
            points = sorted(
                (e["budget_fraction"], e["step_accuracy"]) for e in group if e["method"] == method
            )
            ax.plot(
                [p[0] * 100 for p in points],
                [p[1] for p in points],
                "--" if "(decoding)" in method else "-",
                marker="o",
                color=_colour(method),
                label=method.removeprefix("kvpress:"),
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks([b * 100 for b in budgets], [f"{b * 100:g}%" for b in budgets])
        ax.set_xlabel("KV budget (share of the sequence's tokens)")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    axes[0][0].set_ylabel("answer step accuracy")
    task = results["settings"]["task"]
    figure.suptitle(
        f"recall-chain task ({task['num_facts']} facts, {task['num_distractors']} distractors, "
        f"{task['chain_steps']} steps, {task['total_tokens']} tokens); "
        f"{results['settings']['num_sequences_per_variant']} sequences x {len(task['variants'])} "
        f"variants",
        fontsize=10,
    )
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
