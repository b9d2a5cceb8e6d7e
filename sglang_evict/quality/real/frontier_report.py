"""Tables and the frontier plot of ``eval-tier`` results (``<out>/results.json``), and the
rule that reads them (``docs/quality.md``: the tier's defaults).

``results.md``: per candidate and KV-bytes fraction, needle accuracy per kind and in all,
the bytes actually held, perplexity against the full cache's; the rule's verdict.
``results.png``: the frontier: needle accuracy (left) and perplexity relative to the
full cache (right) against KV bytes held, eviction and the tier on one axis.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

# The rule's thresholds (docs/quality.md, fixed before measuring).
RULE_FRACTION = 0.25
RULE_NEEDLE_MARGIN = 0.10
RULE_PPL_MARGIN = 0.02
RULE_TIE = 0.05


def paired_rows(results: dict) -> list[dict]:
    """The needle answers on the prompts every run at the same KV-bytes fraction (and
    the full cache) answered: each fraction's comparison stays on the same prompts while
    a run is partial or was resumed with other settings; the full cache's row is on the
    prompts of the rule's fraction (1/4) when it ran."""
    rows = [r for r in (results.get("needle") or {}).values() if "skipped" not in r]
    by_run: dict[tuple, set] = defaultdict(set)
    for row in rows:
        by_run[(row["candidate"], row["fraction"])].add(row["sample"])
    full = set.union(set(), *(v for (c, _), v in by_run.items() if c == "full"))
    common: dict[float | None, set] = {}
    for fraction in {f for (_, f) in by_run}:
        runs = [v for (c, f), v in by_run.items() if f == fraction and c != "full"]
        common[fraction] = set.intersection(full, *runs) if runs else full
    if None in common:  # the full cache: on the prompts of the rule's fraction
        common[None] = common.get(RULE_FRACTION, common[None])
    return [row for row in rows if row["sample"] in common[row["fraction"]]]


def needle_table(results: dict) -> list[dict]:
    """One row per (candidate, fraction): accuracy per kind and in all, mean bytes held
    (over ``paired_rows``)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in paired_rows(results):
        groups[(row["candidate"], row["fraction"])].append(row)
    table = []
    for (candidate, fraction), rows in groups.items():
        by_kind = defaultdict(list)
        for row in rows:
            by_kind[row["kind"]].append(row["found"])
        table.append(
            {
                "candidate": candidate,
                "fraction": fraction,
                "accuracy": sum(r["found"] for r in rows) / len(rows),
                "by_kind": {k: sum(v) / len(v) for k, v in sorted(by_kind.items())},
                "held_fraction": sum(r["held_fraction"] for r in rows) / len(rows),
                "prompts": len(rows),
            }
        )
    return sorted(table, key=lambda r: (r["fraction"] or 1.0, r["candidate"]))


def perplexity_table(results: dict) -> list[dict]:
    rows = [r for r in (results.get("perplexity") or {}).values() if "skipped" not in r]
    full = next((r["perplexity"] for r in rows if r["candidate"] == "full"), None)
    table = []
    for row in rows:
        table.append(
            {
                **row,
                "relative": None if full is None else row["perplexity"] / full,
            }
        )
    return sorted(table, key=lambda r: (r["fraction"] or 1.0, r["candidate"]))


def _bits_group_outliers(name: str) -> tuple[int, int, int]:
    """``tier 3b G32 o3`` (``tier 3b G64 rkv``, ``tier 2b G32 o3 rkv``) -> (3, 32, 3)."""
    parts = name.split()
    bits = int(parts[1].rstrip("b"))
    group = int(parts[2][1:])
    outliers = next((int(p[1:]) for p in parts[3:] if p[:1] == "o" and p[1:].isdigit()), 0)
    return bits, group, outliers


def peer_tables(results: dict) -> tuple[list[dict], list[dict], list[str]]:
    """transformers' quantized cache (``results["peers"]``) with the frontier's rows at
    the fractions it held: needle rows, perplexity rows (each with ``at``: the fraction
    they are compared at), and the peer's skipped runs."""
    from sglang_evict.quality.real import qcache

    peer = (results.get("peers") or {}).get("quantized_cache") or {}
    if peer.get("status") != "ok":
        return [], [], [peer["reason"]] if peer.get("reason") else []
    needles = _beside(
        [r for r in qcache.needle_rows(peer) if r["candidate"] != "hf-full"],
        needle_table(results),
        lambda r: r,
    )
    ppl = _beside(
        [r for r in qcache.perplexity_rows(peer) if r["candidate"] != "hf-full"],
        perplexity_table(results),
        lambda r: {**r, "held_fraction": r["spent_fraction"]},
    )
    skipped = [f"{s['task']} {s['method']}: {s['reason']}" for s in peer.get("skipped", [])]
    return needles, ppl, skipped


def kvpress_tables(results: dict) -> tuple[list[dict], list[dict], str | None]:
    """kvpress's presses (``results["peers"]["kvpress"]``) as frontier rows: needle rows
    (accuracy per kind; bytes held = tokens kept / prompt tokens, every kept token in
    bfloat16), perplexity rows (relative to kvpress's own full cache); or why it did
    not run."""
    peer = (results.get("peers") or {}).get("kvpress") or {}
    if peer.get("status") != "ok":
        return [], [], peer.get("reason")
    samples = {r["sample"]: r for r in (results.get("needle") or {}).values() if "kind" in r}
    needles = []
    for entry in peer.get("entries", []):
        if entry["task"] != "needle" or entry["method"] == "kvpress:none":
            continue
        rows = [r for r in entry["rows"] if r["key"] in samples]
        if not rows:
            continue
        by_kind = defaultdict(list)
        for row in rows:
            by_kind[samples[row["key"]]["kind"]].append(row["found"])
        held = [r["kept_tokens"] / samples[r["key"]].get("prompt_tokens", 1) for r in rows]
        needles.append(
            {
                "candidate": entry["method"],
                "fraction": entry["budget"],
                "accuracy": sum(r["found"] for r in rows) / len(rows),
                "by_kind": {k: sum(v) / len(v) for k, v in sorted(by_kind.items())},
                "held_fraction": sum(held) / len(held),
                "prompts": len(rows),
            }
        )
    entries = [e for e in peer.get("entries", []) if e["task"] == "perplexity"]
    full = next((e["perplexity"] for e in entries if e["method"] == "kvpress:none"), None)
    length = (results.get("settings") or {}).get("ppl_length") or 1
    ppl = [
        {
            "candidate": e["method"],
            "held_fraction": e["budget"] / length,
            "perplexity": e["perplexity"],
            "relative": None if full is None else e["perplexity"] / full,
        }
        for e in entries
        if e["method"] != "kvpress:none"
    ]
    key = lambda r: (r["held_fraction"], r["candidate"])  # noqa: E731
    return sorted(needles, key=key), sorted(ppl, key=key), None


def _beside(peer_rows: list[dict], ours: list[dict], shaped) -> list[dict]:
    """Per fraction the peer's rows held (``qcache.at_bytes``), then the frontier's rows
    that ran there, each with ``at``."""
    from sglang_evict.quality.real import qcache

    out = []
    fractions = sorted({qcache.at_bytes(r["held_fraction"]) for r in peer_rows})
    for at in fractions:
        peers = [r for r in peer_rows if qcache.at_bytes(r["held_fraction"]) == at]
        out += [{**r, "at": at, "peer": True} for r in sorted(peers, key=lambda r: r["candidate"])]
        out += [{**shaped(r), "at": at} for r in ours if r["fraction"] == at]
    return out


def _kvpress_markdown(results: dict) -> list[str]:
    needles, ppl, reason = kvpress_tables(results)
    if reason:
        return ["", "## kvpress at the same bytes", "", f"Not run: {reason}"]
    if not (needles or ppl):
        return []
    lines = [
        "",
        "## kvpress at the same bytes",
        "",
        "kvpress's presses on the same token ids (its own environment): a press keeping a "
        "fraction of the tokens in bfloat16 holds that fraction of the bytes. Needles: the "
        "prompt compressed at the end of its prefill; perplexity: `DecodingPress` every 32 "
        "steps. Perplexity against kvpress's own full cache.",
    ]
    if needles:
        kinds = sorted({k for r in needles for k in r["by_kind"]})
        lines += [
            "",
            "| press | bytes held | accuracy | " + " | ".join(kinds) + " | prompts |",
            "| --- | ---: | ---: | " + " | ".join("---:" for _ in kinds) + " | ---: |",
        ]
        for r in needles:
            per_kind = " | ".join(f"{r['by_kind'].get(k, float('nan')):.2f}" for k in kinds)
            lines.append(
                f"| {r['candidate']} | {r['held_fraction']:.3f} | {r['accuracy']:.2f} | "
                f"{per_kind} | {r['prompts']} |"
            )
    if ppl:
        lines += ["", "| press | bytes | perplexity | vs full |", "| --- | ---: | ---: | ---: |"]
        for r in ppl:
            relative = "" if r["relative"] is None else f"{r['relative']:.3f}"
            lines.append(
                f"| {r['candidate']} | {r['held_fraction']:.3f} | {r['perplexity']:.3f} | "
                f"{relative} |"
            )
    return lines


def _peer_markdown(results: dict) -> list[str]:
    needles, ppl, skipped = peer_tables(results)
    if not (needles or ppl or skipped):
        return []
    peer = results["peers"]["quantized_cache"]
    lines = [
        "",
        "## transformers' quantized cache at equal bytes",
        "",
        "The peer (`QuantizedCache`, quanto and HQQ backends, groups of 64, a residual of 128 "
        "full-precision tokens: its defaults) on the same token ids, then the frontier's own "
        "candidates at exactly the bytes it held. Its perplexity is against its own full "
        "cache (HF's SDPA attention). Its bytes are read off its tensors where the frontier "
        "reads its own: right after the prompt (needles), at the sequence's end "
        "(perplexity). *at bytes*: the peer's bytes rounded down to 0.01, where the "
        "frontier's candidates ran.",
    ]
    if peer.get("versions"):
        lines.append(
            "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(peer["versions"].items())) + "."
        )
    if needles:
        kinds = sorted({k for r in needles for k in r["by_kind"]})
        lines += [
            "",
            "| at bytes | method | bytes held | accuracy | " + " | ".join(kinds) + " | prompts |",
            "| ---: | --- | ---: | ---: | " + " | ".join("---:" for _ in kinds) + " | ---: |",
        ]
        for r in needles:
            per_kind = " | ".join(f"{r['by_kind'].get(k, float('nan')):.2f}" for k in kinds)
            name = f"**{r['candidate']}**" if r.get("peer") else r["candidate"]
            lines.append(
                f"| {r['at']:.2f} | {name} | {r['held_fraction']:.3f} | {r['accuracy']:.2f} | "
                f"{per_kind} | {r['prompts']} |"
            )
    if ppl:
        lines += [
            "",
            "| at bytes | method | bytes held | perplexity | vs full |",
            "| ---: | --- | ---: | ---: | ---: |",
        ]
        for r in ppl:
            name = f"**{r['candidate']}**" if r.get("peer") else r["candidate"]
            relative = "" if r["relative"] is None else f"{r['relative']:.3f}"
            lines.append(
                f"| {r['at']:.2f} | {name} | {r['held_fraction']:.3f} | "
                f"{r['perplexity']:.3f} | {relative} |"
            )
    if skipped:
        lines += ["", "The peer could not run:", "", *[f"- {line}" for line in skipped]]
    return lines


def apply_rule(results: dict) -> dict:
    """The rule of ``docs/quality.md`` on these results: the eligible tier candidates at
    1/4 of the bytes (needle accuracy within 0.10 of the full cache on every kind,
    perplexity within 2 %), the choice, and whether any was eligible."""
    needles = {r["candidate"]: r for r in needle_table(results) if r["fraction"] == RULE_FRACTION}
    full = next((r for r in needle_table(results) if r["candidate"] == "full"), None)
    ppl = {r["candidate"]: r for r in perplexity_table(results) if r["fraction"] == RULE_FRACTION}
    verdicts = []
    for name, row in needles.items():
        if not name.startswith("tier ") or full is None:
            continue
        kinds_ok = all(
            row["by_kind"].get(kind, 0.0) >= acc - RULE_NEEDLE_MARGIN
            for kind, acc in full["by_kind"].items()
        )
        relative = ppl.get(name, {}).get("relative")
        ppl_ok = relative is not None and relative <= 1 + RULE_PPL_MARGIN
        verdicts.append(
            {
                "candidate": name,
                "accuracy": row["accuracy"],
                "perplexity_relative": relative,
                "eligible": kinds_ok and ppl_ok,
            }
        )
    eligible = [v for v in verdicts if v["eligible"]]
    pool = eligible or verdicts
    choice = None
    if pool:
        best = max(v["accuracy"] for v in pool)
        near = [v for v in pool if v["accuracy"] >= best - RULE_TIE]

        def cheaper(v):
            bits, group, outliers = _bits_group_outliers(v["candidate"])
            return (bits, -group, outliers)

        choice = min(near, key=cheaper)["candidate"]
    return {"verdicts": verdicts, "choice": choice, "met": bool(eligible)}


def render_markdown(results: dict) -> str:
    lines = [
        "# The quantized tier against eviction at equal KV bytes",
        "",
        f"Model: {results.get('model')} ({results.get('weights')}). Paged reference path "
        "(SGLang's memory classes on CPU, the plugin's passes, attention merging the tier). "
        "KV bytes held: a fraction of the full cache's, bfloat16 accounting.",
        "",
        "## Needle task",
        "",
    ]
    table = needle_table(results)
    kinds = sorted({k for r in table for k in r["by_kind"]})
    lines.append(
        "| candidate | bytes asked | bytes held | accuracy | " + " | ".join(kinds) + " | prompts |"
    )
    lines.append("| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in kinds) + " | ---: |")
    for r in table:
        asked = "1" if r["fraction"] is None else f"{r['fraction']:g}"
        per_kind = " | ".join(f"{r['by_kind'].get(k, float('nan')):.2f}" for k in kinds)
        lines.append(
            f"| {r['candidate']} | {asked} | {r['held_fraction']:.3f} | {r['accuracy']:.2f} | "
            f"{per_kind} | {r['prompts']} |"
        )
    if results.get("engine_needle"):
        from sglang_evict.quality.real import frontier_engine

        new_tokens = (results.get("settings") or {}).get("max_new_tokens", 24)
        lines += [
            "",
            "### The same prompts through SGLang's engine",
            "",
            "`eval-tier --engine`: plain SGLang, and one plugin engine with the tier on in "
            "which every request brings its own split of the bytes (`custom_params`); "
            "bytes held read off each request's report when it ends "
            "(`quality.real.frontier_engine`).",
            "",
            frontier_engine.markdown(
                frontier_engine.summarise(results["engine_needle"], new_tokens)
            ),
        ]
    lines += ["", "## Decode-time perplexity", ""]
    if not results.get("perplexity"):
        lines.append("Not measured in this run (`--no-ppl`).")
    else:
        lines.append("| candidate | bytes | perplexity | vs full | budget | tier bound |")
        lines.append("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in perplexity_table(results):
        asked = "1" if r["fraction"] is None else f"{r['spent_fraction']:.3f}"
        relative = "" if r["relative"] is None else f"{r['relative']:.3f}"
        lines.append(
            f"| {r['candidate']} | {asked} | {r['perplexity']:.3f} | {relative} | "
            f"{r.get('budget_tokens') or ''} | {r.get('tier_tokens') or ''} |"
        )
    skipped = sorted(
        {
            f"{r['candidate']} at {r['fraction']:g}: {r['skipped']}"
            for task in ("needle", "perplexity")
            for r in (results.get(task) or {}).values()
            if "skipped" in r
        }
    )
    if skipped:
        lines += ["", "Not run (too few bytes):", "", *[f"- {line}" for line in skipped]]
    lines += _peer_markdown(results)
    lines += _kvpress_markdown(results)
    rule = apply_rule(results)
    lines += ["", "## The rule (docs/quality.md)", ""]
    if not results.get("perplexity"):
        lines.append("Not applied: the rule reads perplexity too, not measured in this run.")
    elif rule["choice"] is None:
        lines.append("No tier candidate at 1/4 of the bytes in these results.")
    else:
        verdict = "eligible" if rule["met"] else "none eligible: the most accurate"
        lines.append(f"Choice: **{rule['choice']}** ({verdict}).")
        eligible = [v["candidate"] for v in rule["verdicts"] if v["eligible"]]
        lines.append(f"Eligible: {', '.join(eligible) or 'none'}.")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> bool:
    """The frontier: eviction's scorers and the rule's choice as lines over the bytes
    held, every other tier candidate as a grey dot, the full cache dashed."""
    from sglang_evict.plotting import pyplot_or_none, save_figure

    plt = pyplot_or_none()
    if plt is None:
        return False
    choice = apply_rule(results)["choice"]
    peer_needles, peer_ppl, _ = peer_tables(results)
    peer_rows = {False: peer_needles, True: peer_ppl}
    kv_needles, kv_ppl, _ = kvpress_tables(results)
    kvpress_rows = {False: kv_needles, True: kv_ppl}
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (
        (left, needle_table(results), "held_fraction", "accuracy", "needles found"),
        (right, perplexity_table(results), "spent_fraction", "relative", "perplexity / full's"),
    )
    for axis, table, x_name, y_name, label in panels:
        lines: dict[str, list] = defaultdict(list)
        widest = 0.0
        for row in table:
            if row[y_name] is None:
                continue
            if row["candidate"] == "full":
                axis.axhline(row[y_name], color="black", linestyle="--", label="full cache")
                continue
            widest = max(widest, row[x_name])
            if row["candidate"].startswith("evict") or row["candidate"] == choice:
                lines[row["candidate"]].append((row[x_name], row[y_name]))
            else:
                axis.scatter(row[x_name], row[y_name], color="0.75", s=12)
        axis.scatter([], [], color="0.75", s=12, label="other tier candidates")
        peers = [r for r in peer_rows[axis is right] if r.get("peer") and r[y_name] is not None]
        if peers:
            axis.scatter(
                [r["held_fraction"] for r in peers],
                [r[y_name] for r in peers],
                marker="x",
                color="tab:red",
                label="transformers QuantizedCache",
            )
            widest = max(widest, *(r["held_fraction"] for r in peers))
        presses = [r for r in kvpress_rows[axis is right] if r[y_name] is not None]
        if presses:
            axis.scatter(
                [r["held_fraction"] for r in presses],
                [r[y_name] for r in presses],
                marker="^",
                color="tab:purple",
                s=18,
                label="kvpress presses",
            )
        engine = _engine_points(results) if axis is left else []
        if engine:
            for name, x, y in engine:
                axis.scatter([x], [y], marker="D", s=30, facecolors="none", edgecolors="tab:green")
                axis.annotate(f"{name} (engine)", (x, y), fontsize=6, color="tab:green")
            axis.scatter(
                [],
                [],
                marker="D",
                facecolors="none",
                edgecolors="tab:green",
                label="through SGLang's engine",
            )
            widest = max(widest, *(x for _, x, _ in engine))
        if axis is right:  # a peer far above is drawn at the top with its value
            top = max([1.2] + [row[y_name] for row in table if row[y_name] is not None])
            axis.set_ylim(0.98, top + 0.02)
            above = sorted((r for r in peers if r[y_name] > top), key=lambda r: r["candidate"])
            if above:
                text = "off the scale:\n" + "\n".join(
                    f"{r['candidate']} at {r['held_fraction']:.2f}: {r[y_name]:.1f}x" for r in above
                )
                x = above[0]["held_fraction"]
                axis.annotate(text, (x, top), fontsize=7, color="tab:red", va="top")
                axis.scatter([x], [top], marker="^", color="tab:red")
        for name, points in sorted(lines.items()):
            points.sort()
            style = "o-" if name.startswith("tier") else "s--"
            axis.plot([p[0] for p in points], [p[1] for p in points], style, label=name)
        axis.set_xlim(0, max(widest * 1.25, 0.1))
        axis.set_xlabel("KV bytes held (fraction of the full cache's)")
        axis.set_ylabel(label)
        axis.legend(fontsize=7)
    left.set_title("needle task")
    right.set_title("decode-time perplexity")
    figure.suptitle(f"eviction and the quantized tier at equal bytes ({results.get('weights')})")
    save_figure(plt, figure, path)
    return True


def _engine_points(results: dict) -> list[tuple[str, float, float]]:
    """``(candidate, bytes held at the end, needles)`` of the engine's evicting rows."""
    answers = results.get("engine_needle")
    if not answers:
        return []
    from sglang_evict.quality.real import frontier_engine

    new_tokens = (results.get("settings") or {}).get("max_new_tokens", 24)
    return [
        (row["candidate"], row["held_fraction_at_end"], row["needles"])
        for row in frontier_engine.summarise(answers, new_tokens)
        if row["candidate"] != "full"
    ]


def render(out: Path) -> tuple[Path, Path | None]:
    """``results.md`` and ``results.png`` next to ``results.json``."""
    import json

    results = json.loads((out / "results.json").read_text())
    md = out / "results.md"
    md.write_text(render_markdown(results), encoding="utf-8")
    png = out / "results.png"
    return md, (png if plot(results, png) else None)
