"""The ``eval``, ``eval-real``, ``eval-tier`` and ``eval-gate`` subcommands of
``sglang-evict``.

``add_quality_commands(commands)`` registers both on the main parser's subparsers;
handlers raise ``ValueError``/``FileNotFoundError`` for bad input, which the main
command prints as ``sglang-evict <command>: error: ...`` with exit status 2.

    sglang-evict eval --out benches/quality/results [--kvpress]
    sglang-evict eval-gate --results benches/quality/results/results.json --floor 0.9 \\
        --scorer knorm --budget 0.5

``eval-gate`` exit status: 0 when every checked entry holds the floor, 1 when one
does not (each is listed), 2 on bad input.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sglang_evict.models.real_model import weights_note_of
from sglang_evict.triton_env import use_triton_interpreter_without_gpu

DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[2] / "benches" / "quality" / "checkpoint"


def _parse_budget(text: str) -> float:
    """``0.25`` or ``25%``."""
    text = text.strip()
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ValueError(
            f"budget {text!r} is neither a fraction (0.25) nor a percentage (25%)"
        ) from None


def _parse_page_size(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"page size {text!r} is not an integer") from None


def _eval(args: argparse.Namespace) -> int:
    import dataclasses
    import time

    if args.render_only:
        return _render(Path(args.out), wall_s=None)
    use_triton_interpreter_without_gpu()  # before SGLang is imported
    from sglang_evict.quality.reference import harness

    scorers = tuple(harness.parse_scorer_entry(s) for s in args.scorers.split(",") if s.strip())
    if not scorers:
        raise ValueError("--scorers names no scorer")
    base = harness.QUICK_SETTINGS if args.quick else {}
    spec = base.get("spec", harness.TaskSpec())
    if args.facts or args.distractors or args.chain_steps:
        spec = harness.TaskSpec(
            num_facts=args.facts or spec.num_facts,
            num_distractors=args.distractors
            if args.distractors is not None
            else spec.num_distractors,
            chain_steps=args.chain_steps or spec.chain_steps,
        )
    policy = base.get("policy", harness.EvalPolicy())
    policy = dataclasses.replace(
        policy,
        **{
            k: v
            for k, v in (
                ("sink_tokens", args.kv_sink_tokens),
                ("window_tokens", args.kv_window),
                ("cadence_tokens", args.kv_cadence),
            )
            if v is not None
        },
    )
    settings = harness.EvalSettings(
        spec=spec,
        variants=tuple(args.variants.split(",")),
        num_sequences=args.sequences or base.get("num_sequences", 12),
        seed=args.seed,
        budget_fractions=tuple(_parse_budget(b) for b in args.budgets.split(",")),
        page_sizes=tuple(_parse_page_size(p) for p in args.page_sizes.split(",")),
        scorers=scorers,
        policy=policy,
        triattention_stats=args.triattention_stats,
    )
    out = Path(args.out)
    start = time.perf_counter()
    print(
        f"eval: {len(settings.variants)} variants x {settings.num_sequences} sequences of "
        f"{settings.spec.total_tokens} tokens; budgets {list(settings.budget_fractions)} -> "
        f"{[settings.budget_tokens(f) for f in settings.budget_fractions]} tokens; page sizes "
        f"{list(settings.page_sizes)}; scorers {[s.label for s in scorers]}"
    )
    results = harness.run_eval(args.checkpoint, settings, out, progress=not args.no_progress)
    harness.write_results(results, out / "results.json")  # kept if the kvpress part fails
    if args.kvpress:
        results["kvpress"] = _run_kvpress(args, settings, out, results)
    results["wall_s"] = round(time.perf_counter() - start, 1)
    harness.write_results(results, out / "results.json")
    return _render(out, wall_s=results["wall_s"])


def _render(out: Path, wall_s: float | None) -> int:
    """results.png and results.md from ``out/results.json``; prints the table. ``wall_s``:
    this run's eval wall time, None when only redrawing (nothing was run or written
    to results.json)."""
    from sglang_evict.quality.reference import report

    results = report.load_results(out / "results.json", for_rendering=True)
    png_path = report.plot(results, out / "results.png")
    table = report.markdown_table(results)
    (out / "results.md").write_text(table, encoding="utf-8")
    print(table)
    for skip in results["skipped"]:
        print(
            f"skipped {skip['engine']} {skip['method']} budget {skip['budget_fraction']}: "
            f"{skip['reason']}"
        )
    if wall_s is None:
        print(f"redrew {png_path} and {out / 'results.md'} from {out / 'results.json'}")
    else:
        print(
            f"wrote {out / 'results.json'}, {png_path}, {out / 'results.md'} "
            f"(eval wall time {wall_s:.0f} s)"
        )
    return 0


def _run_kvpress(args, settings, out: Path, results: dict) -> dict:
    from sglang_evict.quality import kvpress_bridge
    from sglang_evict.quality.reference.kvpress import PEER_MODULE, write_job
    from sglang_evict.quality.reference.kvpress_peer import MODES, PRESSES

    venv = Path(args.kvpress_venv) if args.kvpress_venv else kvpress_bridge.default_venv()
    try:
        print(f"kvpress: environment {venv} (created if missing)")
        versions = kvpress_bridge.ensure_venv(venv, create=not args.kvpress_no_setup)
        job = write_job(
            out / "kvpress_job.json",
            checkpoint=Path(args.checkpoint),
            samples=settings.samples(),
            budgets=[(f, settings.budget_tokens(f)) for f in settings.budget_fractions],
            presses=list(PRESSES),
            modes=list(MODES),
            cadence_tokens=settings.policy.cadence_tokens,
            sink_tokens=settings.policy.sink_tokens,
        )
        peer = kvpress_bridge.run_peer(
            venv,
            job,
            out / "kvpress_results.json",
            module=PEER_MODULE,
            progress=not args.no_progress,
        )
    except kvpress_bridge.KVPressUnavailable as error:
        print(f"kvpress: not run: {error}")
        return {"status": "not run", "reason": str(error)}
    results["entries"].extend(peer["entries"])
    results["skipped"].extend(peer["skipped"])
    return {"status": "ok", "venv": str(venv), "versions": peer["versions"] | versions}


def _fractions(text: str, flag: str = "--budgets") -> tuple[float, ...]:
    """``1/8,1/4`` or ``0.125,25%``."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if "/" in part:
            numerator, _, denominator = part.partition("/")
            try:
                values.append(float(numerator) / float(denominator))
            except (ValueError, ZeroDivisionError):
                raise ValueError(f"{flag}: {part!r} is not a fraction like 1/4") from None
        elif part:
            values.append(_parse_budget(part))
    return tuple(values)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of integers") from None


def _positive_ints(text: str, flag: str) -> tuple[int, ...]:
    values = _ints(text, flag)
    if not values or min(values) < 1:
        raise ValueError(f"{flag}: {text!r}: give positive integers, comma-separated")
    return values


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of numbers") from None


def _eval_real(args: argparse.Namespace) -> int:
    import dataclasses
    import time

    from sglang_evict.quality.real import evaluation as real_eval
    from sglang_evict.quality.real import report as real_report

    out = Path(args.out)
    if args.render_only:
        table_path, png, table = real_report.render(out)
        print(table)
        print(f"redrew {table_path} and {png} from {out / 'results.json'}")
        return 0
    use_triton_interpreter_without_gpu()  # page size 16 on CPU, before SGLang
    base = dict(real_eval.QUICK) if args.quick else {}
    fields = dict(
        scorers=tuple(s.strip() for s in args.scorers.split(",") if s.strip()),
        tasks=tuple(t.strip() for t in args.tasks.split(",") if t.strip()),
        kvpress=args.kvpress,
    )
    for name, value in (
        ("fractions", args.budgets and _fractions(args.budgets)),
        (
            "kvpress_fractions",
            args.kvpress_budgets and _fractions(args.kvpress_budgets, "--kvpress-budgets"),
        ),
        ("contexts", args.contexts and _ints(args.contexts, "--contexts")),
        ("depths", args.depths and _floats(args.depths, "--depths")),
        ("per_depth", args.per_depth),
        ("ppl_budgets", args.ppl_budgets and _ints(args.ppl_budgets, "--ppl-budgets")),
        ("ppl_length", args.ppl_length),
        ("ppl_sequences", args.ppl_sequences),
    ):
        if value:
            base[name] = value
    settings = dataclasses.replace(real_eval.RealEvalSettings(), **base, **fields)
    model, text, stats = _real_inputs(args, settings)
    print(
        f"eval-real: {model} ({weights_note_of(model)}); tasks {list(settings.tasks)}; "
        f"scorers {list(settings.scorers)}; needle budgets {list(settings.fractions)} of "
        f"haystacks {list(settings.contexts)}; perplexity budgets {list(settings.ppl_budgets)} "
        f"of {settings.ppl_sequences} x {settings.ppl_length} tokens; kvpress "
        f"{f'at {list(settings.kvpress_fractions)}' if settings.kvpress else 'off'}; "
        f"results in {out} (resumed when present)"
    )
    start = time.perf_counter()
    real_eval.run(
        model,
        text,
        out,
        settings,
        stats=stats,
        progress=not args.no_progress,
        kvpress_venv=Path(args.kvpress_venv) if args.kvpress_venv else None,
    )
    table_path, png, table = real_report.render(out)
    print(table)
    print(
        f"wrote {out / 'results.json'}, {table_path}, {png} ({time.perf_counter() - start:.0f} s)"
    )
    return 0


class _NoScorers:
    """``_real_inputs``'s settings for a run that needs no triattention statistics."""

    scorers: tuple[str, ...] = ()


_NO_SCORERS = _NoScorers()


def _real_inputs(args, settings):
    """The model folder, the text file and triattention's statistics, checked."""
    from sglang_evict.models.real_model import REAL_MODELS, ensure_real_model, ensure_real_text
    from sglang_evict.quality.real import evaluation as real_eval

    if args.model is None or args.model in REAL_MODELS:
        model = ensure_real_model(model=args.model or "smollm2")
    else:
        model = Path(args.model)
    real_eval.check_model(model)
    text = Path(args.text) if args.text else ensure_real_text()
    if not text.is_file():
        raise ValueError(f"--text {text}: no such file")
    stats = args.triattention_stats
    if stats is None and "triattention" in settings.scorers:
        default = real_eval.DEFAULT_STATS
        if args.model is None and default.is_file():
            stats = str(default)
    if stats is not None and not Path(stats).is_file():
        raise ValueError(f"--triattention-stats {stats}: no such file")
    return model, text, stats


def _eval_tier(args: argparse.Namespace) -> int:
    import dataclasses
    import time

    from sglang_evict.quality.real import frontier_report
    from sglang_evict.quality.real import frontier_run as frontier

    out = Path(args.out)
    if args.render_only:
        if not (out / "results.json").is_file():
            raise ValueError(f"--render-only: no {out / 'results.json'} to draw from")
        md, png = frontier_report.render(out)
        print(md.read_text())
        print(f"redrew {md} and {png} from {out / 'results.json'}")
        return 0
    use_triton_interpreter_without_gpu()  # page size 16 on CPU, before SGLang
    base = dict(frontier.QUICK) if args.quick else {}
    for name, value in (
        ("candidates", args.candidates and tuple(c.strip() for c in args.candidates.split(","))),
        ("fractions", args.fractions and _fractions(args.fractions, "--fractions")),
        ("contexts", args.contexts and _positive_ints(args.contexts, "--contexts")),
        ("kinds", args.kinds and tuple(k.strip() for k in args.kinds.split(","))),
        ("depths", args.depths and _floats(args.depths, "--depths")),
        ("per_depth", args.per_depth),
        ("max_new_tokens", args.max_new_tokens),
        ("ppl_length", args.ppl_length),
        ("first_index", args.first_index),
        (
            "peer_candidates",
            args.peer_candidates and tuple(c.strip() for c in args.peer_candidates.split(",")),
        ),
        (
            "engine_candidates",
            args.engine_candidates and tuple(c.strip() for c in args.engine_candidates.split(",")),
        ),
    ):
        if value:
            base[name] = value
    if args.no_ppl:
        base["ppl"] = False
    if args.peers is not None:
        base["peers"] = args.peers
    if args.kvpress is not None:
        base["kvpress"] = args.kvpress
    if args.engine:
        base["engine"] = True
    settings = dataclasses.replace(frontier.FrontierSettings(), **base)
    from sglang_evict.quality.real.needle import KINDS

    unknown = sorted(set(settings.kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"--kinds {unknown}: known needle kinds {list(KINDS)}")
    model, text, _ = _real_inputs(args, _NO_SCORERS)
    print(
        f"eval-tier: {model} ({weights_note_of(model)}); {len(settings.candidates)} "
        f"candidates at KV bytes {list(settings.fractions)}; needles {list(settings.kinds)}; "
        f"perplexity {'on' if settings.ppl else 'off'}; transformers' quantized cache "
        f"{'on' if settings.peers else 'off'}; kvpress {'on' if settings.kvpress else 'off'}; "
        f"SGLang's engine "
        f"{list(settings.engine_candidates) if settings.engine else 'off'}; "
        f"results in {out} (resumed when present)"
    )
    start = time.perf_counter()
    frontier.run(model, text, out, settings, progress=not args.no_progress)
    md, png = frontier_report.render(out)
    print(md.read_text())
    print(f"wrote {out / 'results.json'}, {md}, {png} ({time.perf_counter() - start:.0f} s)")
    return 0


def _eval_gate(args: argparse.Namespace) -> int:
    from sglang_evict.quality.reference import report

    results = report.load_results(args.results)
    checked, failures = report.gate(
        results,
        args.floor,
        scorers=args.scorer,
        budgets=[_parse_budget(b) for b in args.budget] if args.budget else None,
        page_sizes=args.page_size,
        engines=args.engine,
        full_cache_floor=args.full_cache_floor,
    )
    if failures:
        print(f"eval-gate: FAIL: {len(failures)} of {len(checked)} checked entries below the floor")
        for failure in failures:
            print(f"  {failure.describe()}")
        return 1
    print(
        f"eval-gate: ok: {len(checked)} entries at or above {args.floor:g} of the full cache's "
        f"step accuracy"
    )
    return 0


def add_quality_commands(commands) -> None:
    """Register ``eval``, ``eval-real`` and ``eval-gate`` on ``commands`` (argparse
    subparsers)."""
    from sglang_evict.quality.reference.harness import (
        DEFAULT_BUDGETS,
        DEFAULT_PAGE_SIZES,
        DEFAULT_SCORERS,
    )
    from sglang_evict.quality.reference.task import VARIANTS

    ev = commands.add_parser(
        "eval",
        help="scorer quality on the trained reference model through the real eviction path",
        description="Run the recall-chain task (benches/quality) on the reference model "
        "for every scorer x budget x page size through SGLang's memory classes and the "
        "plugin (CPU reference loop), with a full-cache reference; optionally kvpress on "
        "the same model and sequences. Writes results.json, results.png and results.md "
        "to --out.",
    )
    ev.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT), help="model folder")
    ev.add_argument("--out", default="quality-results", help="output folder")
    ev.add_argument("--quick", action="store_true", help="small task, 2 sequences per variant")
    ev.add_argument("--sequences", type=int, default=0, help="sequences per variant")
    ev.add_argument("--seed", type=int, default=0, help="held-out data seed")
    ev.add_argument(
        "--scorers",
        default=",".join(DEFAULT_SCORERS),
        help="comma-separated; name or name:param=value[:param=value]",
    )
    ev.add_argument(
        "--budgets",
        default=",".join(f"{b:g}" for b in DEFAULT_BUDGETS),
        help="fractions of the sequence (0.25 or 25%%)",
    )
    ev.add_argument("--page-sizes", default=",".join(map(str, DEFAULT_PAGE_SIZES)))
    ev.add_argument("--variants", default=",".join(VARIANTS))
    ev.add_argument("--facts", type=int, default=0, help="facts per sequence")
    ev.add_argument("--distractors", type=int, default=None, help="distractor tokens")
    ev.add_argument("--chain-steps", type=int, default=0, help="answer steps")
    ev.add_argument("--kv-sink-tokens", type=int, default=None)
    ev.add_argument("--kv-window", type=int, default=None)
    ev.add_argument("--kv-cadence", type=int, default=None)
    ev.add_argument(
        "--triattention-stats",
        default=None,
        help="stats file; default: calibrate from the checkpoint",
    )
    ev.add_argument("--kvpress", action="store_true", help="also run kvpress 0.5.5 as a peer")
    ev.add_argument("--kvpress-venv", default=None, help="kvpress environment folder")
    ev.add_argument(
        "--kvpress-no-setup",
        action="store_true",
        help="do not create the kvpress environment when it is missing",
    )
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    ev.add_argument(
        "--render-only",
        action="store_true",
        help="run nothing: redraw results.png and results.md from --out/results.json",
    )
    ev.set_defaults(handler=_eval)

    from sglang_evict.quality.real.evaluation import SERVER_SCORERS

    real = commands.add_parser(
        "eval-real",
        help="needle and perplexity on the real model: every scorer x budget vs the full cache",
        description="SmolLM2-135M-Instruct (sglang-evict real-model; 4-bit weights "
        "dequantised) on the Paul Graham essays (sglang-evict real-text): the needle task "
        "in SGLang's real engine with --kv-evict-prompt, and decode-time perplexity through "
        "the real decode path, for every server scorer and budget against the full cache "
        "on the same inputs; --kvpress adds kvpress 0.5.5's presses. Resumable; writes "
        "results.json, results.md and results.png to --out.",
    )
    real.add_argument("--out", default="real-model-quality", help="output folder")
    real.add_argument(
        "--model",
        default=None,
        help="a real model (smollm2, the default, or gemma3-270m: sglang-evict real-model) "
        "or a model folder",
    )
    real.add_argument("--text", default=None, help="haystack text (default: real-text)")
    real.add_argument("--quick", action="store_true", help="the whole matrix, small")
    real.add_argument("--tasks", default="needle,perplexity")
    real.add_argument("--scorers", default=",".join(SERVER_SCORERS))
    real.add_argument("--budgets", default=None, help="needle: fractions, default 1/8,1/4,1/2")
    real.add_argument("--contexts", default=None, help="needle haystacks (tokens): 1000,2000")
    real.add_argument("--depths", default=None, help="needle depths: 0.1,0.3,0.5,0.7,0.9")
    real.add_argument("--per-depth", type=int, default=None, help="needles per depth (2)")
    real.add_argument("--ppl-budgets", default=None, help="perplexity: 256,512,1024 tokens")
    real.add_argument("--ppl-length", type=int, default=None, help="tokens a sequence (2048)")
    real.add_argument("--ppl-sequences", type=int, default=None, help="sequences (1)")
    real.add_argument("--triattention-stats", default=None, help="the model's statistics")
    real.add_argument("--kvpress", action="store_true", help="also run kvpress 0.5.5")
    real.add_argument("--kvpress-venv", default=None, help="kvpress environment folder")
    real.add_argument(
        "--kvpress-budgets", default=None, help="kvpress's needle fractions, default 1/4,1/2"
    )
    real.add_argument("--no-progress", action="store_true")
    real.add_argument(
        "--render-only", action="store_true", help="redraw results.md/png from results.json"
    )
    real.set_defaults(handler=_eval_real)

    tier = commands.add_parser(
        "eval-tier",
        help="eviction and the quantized tier at equal KV bytes on the real model",
        description="SmolLM2-135M-Instruct (4-bit weights dequantised) on the Paul Graham "
        "essays, through the paged reference path: the needle task (four kinds of needle) "
        "and decode-time perplexity for eviction's scorers and the quantized tier's "
        "candidates (bits, group, outlier tokens) at the same KV bytes; the full cache on "
        "the same inputs. Resumable; writes results.json, results.md (with the rule that "
        "picks the tier's defaults) and results.png (the frontier) to --out.",
    )
    tier.add_argument("--out", default="tier-frontier", help="output folder")
    tier.add_argument(
        "--model",
        default=None,
        help="a real model (smollm2, the default, or gemma3-270m: sglang-evict real-model) "
        "or a model folder",
    )
    tier.add_argument("--text", default=None, help="haystack text (default: real-text)")
    tier.add_argument("--quick", action="store_true", help="three candidates, small")
    tier.add_argument(
        "--candidates",
        default=None,
        help="evict, evict:SCORER or BITS:GROUP[:OUTLIERS][/SCORER], comma-separated "
        "(default: the rule's candidates, docs/quality.md)",
    )
    tier.add_argument(
        "--peers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run transformers' QuantizedCache (quanto, HQQ) in its own environment, "
        "then the frontier's candidates at the bytes it held (default: on; off with --quick)",
    )
    tier.add_argument(
        "--kvpress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run kvpress's presses on the same prompts at the same fractions, in "
        "kvpress's own environment (default: on; off with --quick)",
    )
    tier.add_argument(
        "--peer-candidates",
        default=None,
        help="what runs at the peer's bytes (default: the rule's choice)",
    )
    tier.add_argument(
        "--first-index", type=int, default=None, help="first needle index (1000: evaluation)"
    )
    tier.add_argument("--fractions", default=None, help="KV bytes held: 0.25,0.125")
    tier.add_argument(
        "--contexts",
        default=None,
        help="haystack sizes in tokens (1000); a model with sliding windows needs room for "
        "its window in full precision beside the tier (Gemma 3: 4000 at 1/4 of the bytes)",
    )
    tier.add_argument("--kinds", default=None, help="needle kinds: code7,code5,word,time")
    tier.add_argument("--depths", default=None, help="needle depths: 0.2,0.5,0.8")
    tier.add_argument("--per-depth", type=int, default=None, help="needles per depth (2)")
    tier.add_argument("--max-new-tokens", type=int, default=None, help="answer tokens (24)")
    tier.add_argument("--ppl-length", type=int, default=None, help="perplexity tokens (1024)")
    tier.add_argument("--no-ppl", action="store_true", help="the needle task only")
    tier.add_argument(
        "--engine",
        action="store_true",
        help="also the needle task through SGLang's engine: plain, eviction and the tier",
    )
    tier.add_argument(
        "--engine-candidates",
        default=None,
        help="the engine's candidates, one tier among them (default: evict:rkv,3:32/rkv)",
    )
    tier.add_argument("--no-progress", action="store_true")
    tier.add_argument(
        "--render-only", action="store_true", help="redraw results.md/png from results.json"
    )
    tier.set_defaults(handler=_eval_tier, triattention_stats=None)

    gate = commands.add_parser(
        "eval-gate",
        help="exit non-zero when a scorer/budget falls below a floor relative to full cache",
        description="Check an `sglang-evict eval` results file: every selected entry's "
        "step accuracy divided by its full-cache step accuracy must be >= --floor. Exit 0 "
        "when all hold, 1 listing the failures, 2 on bad input.",
    )
    gate.add_argument("--results", required=True, help="results.json from sglang-evict eval")
    gate.add_argument("--floor", type=float, required=True, help="e.g. 0.9")
    gate.add_argument("--scorer", action="append", help="only this scorer (repeatable)")
    gate.add_argument("--budget", action="append", help="only this budget (repeatable)")
    gate.add_argument("--page-size", type=int, action="append", help="only this page size")
    gate.add_argument("--engine", action="append", help="sglang-evict (default) or kvpress")
    gate.add_argument(
        "--full-cache-floor",
        type=float,
        default=None,
        help="also require the full cache's absolute step accuracy",
    )
    gate.set_defaults(handler=_eval_gate)
