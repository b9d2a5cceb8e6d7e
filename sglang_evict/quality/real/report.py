"""Tables and a plot of ``eval-real`` results (``<out>/results.json``).

``results.md``: needle accuracy per method and budget (every context size together, and
per size) next to plain SGLang's on the same prompts; perplexity per method and budget
next to the full cache's; kvpress's presses in the same tables when they ran.
``results.png``: accuracy against budget (left) and perplexity relative to the full
cache against budget (right), one line per method.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from sglang_evict.quality.real.needle_engine import PLAIN, summarise


def needle_rows(results: dict) -> list[dict]:
    settings = results.get("settings") or {}
    rows = summarise(
        results.get("needle_answers") or {},
        settings.get("scorers", ()),
        settings.get("fractions", ()),
    )
    kvpress = results.get("kvpress") or {}
    for entry in kvpress.get("entries", []):
        if entry["task"] != "needle":
            continue
        by_context = defaultdict(list)
        for row in entry["rows"]:
            by_context[row["context_tokens"]].append(row["found"])
        everything = [f for found in by_context.values() for f in found]
        for context, found in [*sorted(by_context.items()), (None, everything)]:
            rows.append(
                {
                    "task": "needle",
                    "engine": "kvpress",
                    "method": entry["method"],
                    "budget_fraction": entry["budget"],
                    "context_tokens": context,
                    "accuracy": sum(found) / len(found),
                    "num_prompts": len(found),
                    "mean_peak_kv_tokens": None,
                }
            )
    return rows


def perplexity_rows(results: dict) -> list[dict]:
    rows = [dict(r, engine="sglang-evict") for r in (results.get("perplexity") or {}).values()]
    kvpress = results.get("kvpress") or {}
    for entry in kvpress.get("entries", []):
        if entry["task"] == "perplexity":
            rows.append(
                {
                    "engine": "kvpress",
                    "method": entry["method"],
                    "budget_tokens": entry["budget"],
                    "perplexity": entry["perplexity"],
                    "mean_peak_kv_tokens": entry["peak_kv_tokens"],
                }
            )
    full = {r["engine"]: r["perplexity"] for r in rows if r["method"] in ("full", "kvpress:none")}
    for row in rows:
        reference = full.get(row["engine"])
        row["relative"] = row["perplexity"] / reference if reference else None
    return rows


def _fmt(value, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def markdown(results: dict) -> str:
    lines = [f"Model: {results.get('weights', '')}. Greedy decoding.", ""]
    needle = needle_rows(results)
    if needle:
        contexts = sorted({r["context_tokens"] for r in needle if r["context_tokens"]})
        header = ["engine", "method", "budget (of the prompt)", "all", *map(str, contexts)]
        lines += [
            "Needle retrieval accuracy (answer contains the code), SGLang's engine, "
            "`--kv-evict-prompt`, page size 16; columns: every prompt, then by haystack "
            "size in tokens:",
            "",
            "| " + " | ".join(header) + " |",
            "| " + " | ".join(["---"] * 3 + ["---:"] * (len(header) - 3)) + " |",
        ]
        cells = defaultdict(dict)
        for row in needle:
            key = (row["engine"], row["method"], row["budget_fraction"])
            cells[key][row["context_tokens"]] = row
        for (engine, method, fraction), by_context in cells.items():
            budget = "full" if method in (PLAIN, "kvpress:none") else f"{fraction:g}"
            every = by_context.get(None)
            values = [
                f"{every['accuracy']:.2f} ({every['num_prompts']})" if every else "—",
                *(_fmt(by_context[c]["accuracy"]) if c in by_context else "—" for c in contexts),
            ]
            lines.append(f"| {engine} | {method} | {budget} | " + " | ".join(values) + " |")
        lines.append("")
    ppl = perplexity_rows(results)
    if ppl:
        lines += [
            "Decode-time perplexity (text fed one token per decode step, passes at the "
            "cadence), relative to the full cache of the same engine:",
            "",
            "| engine | method | budget (tokens) | perplexity | relative | peak KV tokens |",
            "| --- | --- | ---: | ---: | ---: | ---: |",
        ]
        for row in sorted(ppl, key=lambda r: (r["engine"], r["method"], r["budget_tokens"] or 0)):
            budget = row["budget_tokens"] if row["budget_tokens"] else "full"
            lines.append(
                f"| {row['engine']} | {row['method']} | {budget} | {_fmt(row['perplexity'])} | "
                f"{_fmt(row['relative'], 3)} | {_fmt(row['mean_peak_kv_tokens'], 0)} |"
            )
        lines.append("")
    kvpress = results.get("kvpress") or {}
    for skip in kvpress.get("skipped", []):
        lines.append(f"kvpress {skip['task']} {skip['method']} not run: {skip['reason']}")
    if results.get("wall_s") is not None:
        lines.append(
            f"Wall time of the run(s) that wrote these results: {results['wall_s']:.0f} s."
        )
    return "\n".join(lines).rstrip() + "\n"


def plot(results: dict, path: Path) -> Path | None:
    from sglang_evict.plotting import pyplot_or_none, save_figure

    plt = pyplot_or_none()
    if plt is None:
        return None
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    lines = defaultdict(list)
    plain = None
    for row in needle_rows(results):
        if row["context_tokens"] is not None:
            continue
        if row["method"] in (PLAIN, "kvpress:none"):
            plain = row["accuracy"] if row["method"] == PLAIN else plain
            continue
        lines[(row["engine"], row["method"])].append((row["budget_fraction"], row["accuracy"]))
    for (engine, method), points in sorted(lines.items()):
        points.sort()
        style = "-o" if engine == "sglang-evict" else "--x"
        left.plot(
            *zip(*points, strict=True), style, label=f"{method}" if engine != "kvpress" else method
        )
    if plain is not None:
        left.axhline(plain, color="black", linewidth=1, label="plain SGLang (full cache)")
    left.set_xlabel("budget (fraction of the prompt)")
    left.set_ylabel("needle accuracy")
    left.set_ylim(-0.02, 1.02)
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    left.set_title("needle in SGLang's engine (--kv-evict-prompt)")
    curves = defaultdict(list)
    for row in perplexity_rows(results):
        if row["budget_tokens"] and row["relative"] is not None:
            curves[(row["engine"], row["method"])].append((row["budget_tokens"], row["relative"]))
    for (engine, method), points in sorted(curves.items()):
        points.sort()
        style = "-o" if engine == "sglang-evict" else "--x"
        right.plot(*zip(*points, strict=True), style, label=method)
    right.axhline(1.0, color="black", linewidth=1, label="full cache")
    right.set_xscale("log", base=2)
    right.set_xlabel("budget (tokens)")
    right.set_ylabel("perplexity / full cache's")
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    right.set_title("decode-time perplexity")
    figure.suptitle(results.get("weights", ""), fontsize=9)
    save_figure(plt, figure, path)
    return path


def render(out: Path) -> tuple[Path, Path | None, str]:
    import json

    results = json.loads((out / "results.json").read_text())
    table = markdown(results)
    (out / "results.md").write_text(table, encoding="utf-8")
    png = plot(results, out / "results.png")
    return out / "results.md", png, table


def best_scorer(results: dict, scorers) -> str:
    """Of ``scorers``, the one the real-model results rank first: the highest needle
    accuracy averaged over every evicting budget (each budget's accuracy over every
    prompt), ties broken by the lower perplexity relative to the full cache averaged
    over every perplexity budget, then by name. This rule chose ``config.DEFAULT_SCORER``;
    it was written before the full results it is applied to were seen."""
    scorers = sorted(scorers)
    needle = [
        r
        for r in needle_rows(results)
        if r["engine"] == "sglang-evict" and r["context_tokens"] is None
    ]
    ppl = [r for r in perplexity_rows(results) if r["engine"] == "sglang-evict"]
    missing = sorted(set(scorers) - {r["method"] for r in needle})
    if missing:
        raise ValueError(f"the results hold no needle entries for scorer(s) {missing}")

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else float("inf")

    def key(scorer: str) -> tuple[float, float, str]:
        accuracy = mean([r["accuracy"] for r in needle if r["method"] == scorer])
        relative = mean(
            [r["relative"] for r in ppl if r["method"] == scorer and r["relative"] is not None]
        )
        return (-accuracy, relative, scorer)

    return min(scorers, key=key)
