"""The server side of the policy: how it reaches SGLang's processes, which scorers a
server runs, and what the plugin refuses at startup.

``startup_problems`` is the one list of refusals. Two callers run it on the same inputs:

    caller                                   server args         model facts
    radix_cache_factory (each scheduler)     the server's        its ModelConfig + SGLang's
                                                                 hybrid/DSA verdicts
    sglang-evict serve (--dry-run too),      parsed by SGLang's  ModelConfig built from the
    before anything starts                   own parser          local folder's config.json

so a dry run passes exactly what a server starts with, on a machine without a GPU and
without the network.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from sglang_evict.config import EvictionConfig
from sglang_evict.scorers import SCORERS
from sglang_evict.srt.tp import RANK_INDEPENDENT_SCORERS, TP_REDUCED_SCORERS
from sglang_evict.srt.versioned import decode_cuda_graphs_off

BACKEND_NAME = "sglang-evict"
# The policy reaches SGLang's scheduler processes through the environment (they inherit
# it from `sglang-evict serve`): a JSON object of EvictionConfig fields, page size and
# the Redis URL excluded (that one travels in $SGLANG_EVICT_REDIS_URL).
CONFIG_ENV = "SGLANG_EVICT_CONFIG"

# Whether the server captures queries inside the engine's attention forward, which the
# query-reading scorers (``window``, ``rkv``) need: ``sglang_evict.srt.capture`` copies
# each layer's queries into the query ring from ``AttentionBackend.forward``.
SERVER_CAPTURES_QUERIES = True

# KV cache dtypes whose pools keep block scales beside the values (MHATokenToKVPoolMXFP8,
# MHATokenToKVPoolFP4): compaction moves the values only, so these are refused.
BLOCK_SCALED_KV_DTYPES = ("mxfp8", "nvfp4", "fp4_mx_block16", "fp4_e2m1")


def server_scorers() -> tuple[str, ...]:
    """The scorers a server runs: every registered one, less those reading captured
    queries while the server does not capture them."""
    return tuple(
        name for name, cls in SCORERS.items() if SERVER_CAPTURES_QUERIES or not cls.needs_queries
    )


def config_from_env(page_size: int, environ: dict | None = None) -> EvictionConfig:
    """Read the policy that `sglang-evict serve` put in ``SGLANG_EVICT_CONFIG`` (and the
    Redis URL in ``SGLANG_EVICT_REDIS_URL``)."""
    import json
    import os

    from compactor_service.secrets import resolve_redis_url

    environ = os.environ if environ is None else environ
    raw = environ.get(CONFIG_ENV)
    if not raw:
        raise ValueError(
            f"--radix-cache-backend {BACKEND_NAME} needs an eviction policy: start the server "
            f"with `sglang-evict serve --kv-budget N ...` (or set {CONFIG_ENV} to a JSON object "
            f'such as {{"kv_budget_tokens": 2048}})'
        )
    try:
        fields = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(f"{CONFIG_ENV} is not valid JSON: {error}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{CONFIG_ENV} must hold a JSON object of eviction settings")
    fields.pop("page_size", None)
    if fields.get("redis_url") is None:
        fields["redis_url"] = resolve_redis_url(environ=environ)
    try:
        return EvictionConfig(**fields, page_size=page_size)
    except TypeError as error:
        raise ValueError(f"{CONFIG_ENV}: {error}") from None


# --- what the plugin refuses -----------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    """What the startup checks need to know about the served model.

    Attributes:
        path: the model folder (or hub id) SGLang loads; named in messages.
        architectures: the config's ``architectures``.
        is_mla, is_hybrid_swa, is_hybrid_ssm, is_dsa: SGLang's verdicts (MLA attention,
            sliding-window/full hybrid, SSM/linear-attention hybrid, DeepSeek sparse
            attention), each of which selects a KV pool other than ``MHATokenToKVPool``.
        hf_text_config: the HF config the model's shape is read from (layers, heads,
            head_dim, RoPE base: ``triattention_stats.model_shape_of``); None when not
            known (a cache built without a model config, as unit tests build one).
    """

    path: str
    architectures: tuple[str, ...] = ()
    is_mla: bool = False
    is_hybrid_swa: bool = False
    is_hybrid_ssm: bool = False
    is_dsa: bool = False
    hf_text_config: object = None


def model_facts(
    model_config, *, is_hybrid_swa: bool, is_hybrid_ssm: bool, is_dsa: bool
) -> ModelFacts:
    """Facts from SGLang's ``ModelConfig`` plus the hybrid/DSA verdicts."""
    from sglang.srt.configs.model_config import AttentionArch

    return ModelFacts(
        path=str(model_config.model_path),
        architectures=tuple(getattr(model_config.hf_config, "architectures", None) or ()),
        is_mla=model_config.attention_arch == AttentionArch.MLA,
        is_hybrid_swa=is_hybrid_swa,
        is_hybrid_ssm=is_hybrid_ssm,
        is_dsa=is_dsa,
        hf_text_config=model_config.hf_text_config,
    )


def model_facts_of_context(ctx) -> ModelFacts:
    """The served model as a scheduler's radix-cache build context describes it."""
    verdicts = dict(
        is_hybrid_swa=bool(ctx.is_hybrid_swa),
        is_hybrid_ssm=bool(ctx.is_hybrid_ssm),
        is_dsa=bool(ctx.is_dsa),
    )
    if ctx.model_config is None:
        return ModelFacts(path=str(getattr(ctx.server_args, "model_path", "")), **verdicts)
    return model_facts(ctx.model_config, **verdicts)


def model_facts_from_server_args(server_args) -> ModelFacts:
    """Facts as a scheduler derives them, from SGLang's ``ModelConfig`` of the model
    (config.json only: no weights, tokenizer or, for a local folder, network). The
    hybrid and DSA verdicts are the expressions of SGLang 0.5.17's ``build_kv_cache``."""
    from sglang.srt.configs.hybrid_arch import (
        hybrid_gdn_config,
        hybrid_lightning_config,
        kimi_linear_config,
        linear_attn_model_spec,
        mamba2_config,
    )
    from sglang.srt.configs.model_config import ModelConfig, is_deepseek_dsa

    from sglang_evict.calibrate import first_line

    try:
        model_config = ModelConfig.from_server_args(server_args)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"--model-path {server_args.model_path}: SGLang cannot read the model's "
            f"config.json ({first_line(error)})"
        ) from None
    spec = linear_attn_model_spec(model_config)
    is_hybrid_ssm = any(
        (
            hybrid_gdn_config(model_config) is not None,
            mamba2_config(model_config) is not None,
            spec is not None and spec.uses_mamba_radix_cache,
            kimi_linear_config(model_config) is not None,
            hybrid_lightning_config(model_config) is not None,
        )
    )
    return model_facts(
        model_config,
        is_hybrid_swa=bool(model_config.is_hybrid_swa),
        is_hybrid_ssm=is_hybrid_ssm,
        is_dsa=bool(is_deepseek_dsa(model_config.hf_config)),
    )


_FLAG_REFUSALS = (
    (  # SGLang 0.5.23
        "enable_hisparse",
        bool,
        "--enable-hisparse",
        "hierarchical sparse attention keeps its own device subset of each request's KV",
    ),
    (  # SGLang 0.5.23
        "dcp_size",
        lambda v: v is not None and v > 1,
        "--dcp-size > 1",
        "decode context parallelism shards each request's pages across ranks",
    ),
    (
        "speculative_algorithm",
        lambda v: v is not None,
        "--speculative-algorithm",
        "speculative decoding derives draft positions from KV lengths",
    ),
    (
        "enable_mixed_chunk",
        bool,
        "--enable-mixed-chunk",
        "mixed chunks recompute running requests' KV lengths from token counts",
    ),
    (
        "enable_hierarchical_cache",
        bool,
        "--enable-hierarchical-cache",
        "the host-memory tier would offload compacted rows as if they were token rows",
    ),
    (
        "enable_streaming_session",
        bool,
        "--enable-streaming-session",
        "streaming sessions restore KV lengths from token counts across turns",
    ),
    (
        "strip_thinking_cache",
        bool,
        "--strip-thinking-cache",
        "it also rewrites which KV a finished request hands to the tree",
    ),
    ("enable_lmcache", bool, "--enable-lmcache", "it selects its own radix cache"),
    ("enable_flexkv", bool, "--enable-flexkv", "it selects its own radix cache"),
    (
        "kv_canary",
        lambda v: v not in (None, "none"),
        "--kv-canary",
        "it verifies row i against token i",
    ),
    (
        "pp_size",
        lambda v: v is not None and v > 1,
        "--pp-size > 1",
        "pipeline stages would each need the same survivors",
    ),
    (
        "disaggregation_mode",
        lambda v: v not in (None, "null"),
        "--disaggregation-mode",
        "transferred KV assumes token rows",
    ),
    (
        "kv_cache_dtype",
        lambda v: v in BLOCK_SCALED_KV_DTYPES,
        "--kv-cache-dtype " + "/".join(BLOCK_SCALED_KV_DTYPES),
        "block-scaled pools keep scales beside the values, which compaction does not move",
    ),
)

_MODEL_REFUSALS = (
    ("is_hybrid_swa", "sliding-window (hybrid SWA) models"),
    ("is_hybrid_ssm", "hybrid SSM/linear-attention models"),
    ("is_dsa", "DeepSeek sparse-attention models"),
)


def startup_problems(
    server_args, config: EvictionConfig, model: ModelFacts | None = None
) -> list[str]:
    """Every reason the plugin cannot run this server: one message per problem, naming
    the flag (or model property) and the fix; empty when it can. ``model`` None: the
    model is not known, so only the flags and the policy are checked."""
    problems = []
    for attribute, is_set, flag, why in _FLAG_REFUSALS:
        if is_set(getattr(server_args, attribute, None)):
            problems.append(f"{flag} is not supported with sglang-evict yet ({why}); remove it")
    if getattr(server_args, "disable_radix_cache", False):
        problems.append(
            "--disable-radix-cache turns off the cache sglang-evict works inside; remove it"
        )
    scorer = config.scorer
    runnable = server_scorers()
    if scorer not in runnable:
        problems.append(
            f"--kv-scorer {scorer} reads queries captured inside the attention forward, which "
            f"the server does not capture yet; use one of {list(runnable)}"
        )
    if SCORERS[scorer].needs_queries and getattr(server_args, "enable_torch_compile", False):
        problems.append(
            f"--enable-torch-compile with --kv-scorer {scorer} is not supported yet (query "
            f"capture inside the attention is not verified under torch.compile); remove "
            f"--enable-torch-compile or use one of "
            f"{[n for n in runnable if not SCORERS[n].needs_queries]}"
        )
    if config.pass_cuda_graph:
        device = getattr(server_args, "device", None)
        if decode_cuda_graphs_off(server_args):
            problems.append(
                "--kv-pass-cuda-graph replays passes beside SGLang's decode CUDA graphs, "
                "which --disable-cuda-graph (or --cuda-graph-backend-decode disabled) turns "
                "off; remove one of the two"
            )
        elif device not in (None, "cuda"):
            problems.append(
                f"--kv-pass-cuda-graph needs a CUDA device (the server runs on --device "
                f"{device}); remove it"
            )
        if config.tier_bits is not None:
            problems.append(
                "--kv-pass-cuda-graph with --kv-tier-bits: the tier's passes run eagerly (its "
                "demotion is not replayed as a CUDA graph yet); remove --kv-pass-cuda-graph"
            )
        if config.compactor == "grpc":
            problems.append(
                "--kv-pass-cuda-graph with --kv-compactor grpc: the sidecar's moves run "
                "outside any CUDA graph; remove --kv-pass-cuda-graph or use --kv-compactor "
                "inprocess"
            )
    tp_size = getattr(server_args, "tp_size", 1) or 1
    supported_under_tp = RANK_INDEPENDENT_SCORERS + TP_REDUCED_SCORERS
    if tp_size > 1 and scorer not in supported_under_tp:
        problems.append(
            f"--tp-size {tp_size} with --kv-scorer {scorer} is not supported yet (each rank "
            f"holds different KV heads and this scorer's per-rank inputs are not split "
            f"yet); use --kv-scorer {' or '.join(supported_under_tp)}, or --tp-size 1"
        )
    if config.tier_bits is not None:
        problems.extend(_tier_problems(server_args, config))
    if model is not None:
        problems.extend(_model_problems(server_args, config, model))
    return problems


# The attention backends whose decode output the tier's attention merges with
# (``sglang_evict.srt.tier``).
TIER_BACKENDS = ("torch_native", "triton")
# Of those, the ones proven only in SGLang's engine on CPU (``triton`` under Triton's
# interpreter: tests/test_engine_tier_triton.py); on a GPU, with its CUDA graphs, they
# have not passed yet, and are refused there until they have.
TIER_BACKENDS_CPU_ONLY = ("triton",)
# ``1`` in the server's environment starts those backends with the tier on a GPU anyway,
# to prove them there (the GPU test in tests/test_engine_tier_triton.py sets it); not
# for serving.
TIER_GPU_TRIAL_ENV = "SGLANG_EVICT_TIER_GPU_TRIAL"


def tier_backend_refused(backend: str | None, device: str) -> bool:
    """Whether the tier with ``backend`` on ``device`` is refused: a CPU-only backend
    off the CPU, unless ``TIER_GPU_TRIAL_ENV`` asks to try it."""
    return (
        backend in TIER_BACKENDS_CPU_ONLY
        and device != "cpu"
        and os.environ.get(TIER_GPU_TRIAL_ENV) != "1"
    )


# KV cache dtypes the tier quantizes from (block-scaled and fp8 pools are not read yet).
TIER_KV_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32")


def _tier_problems(server_args, config: EvictionConfig) -> list[str]:
    """Why this server cannot run the quantized tier (``--kv-tier-bits``)."""
    problems = []
    backend = getattr(server_args, "attention_backend", None)
    if backend not in TIER_BACKENDS:
        chosen = f"--attention-backend {backend}" if backend else "SGLang's default backend"
        problems.append(
            f"--kv-tier-bits with {chosen}: the tier's attention merges with SGLang's "
            f"{' or '.join(TIER_BACKENDS)} backends only so far; pass --attention-backend "
            f"torch_native or drop --kv-tier-*"
        )
    for field in ("decode_attention_backend", "prefill_attention_backend"):
        # One backend for the whole server: a hybrid of two is none the tier merges with.
        other = getattr(server_args, field, None)
        if other is not None and other != backend and backend in TIER_BACKENDS:
            flag = "--" + field.replace("_", "-")
            problems.append(
                f"--kv-tier-bits with {flag} {other}: the tier's attention merges with one "
                f"attention backend for the whole server, here --attention-backend "
                f"{backend}; drop {flag} or drop --kv-tier-*"
            )
    device = str(getattr(server_args, "device", None) or "cuda")
    if tier_backend_refused(backend, device):
        problems.append(
            f"--kv-tier-bits with --attention-backend {backend} on {device}: the tier's merge "
            f"with {backend}'s decode has run in SGLang's engine on CPU only, not yet on a GPU "
            f"or inside its CUDA graphs; pass --attention-backend torch_native or drop "
            f"--kv-tier-*"
        )
    kv_dtype = getattr(server_args, "kv_cache_dtype", "auto") or "auto"
    if kv_dtype not in TIER_KV_DTYPES:
        problems.append(
            f"--kv-tier-bits with --kv-cache-dtype {kv_dtype}: the tier quantizes from a "
            f"16- or 32-bit KV cache only; drop one of the two"
        )
    if config.compactor == "grpc" and device != "cpu" and os.environ.get(TIER_GPU_TRIAL_ENV) != "1":
        problems.append(
            f"--kv-tier-bits with --kv-compactor grpc on {device}: the tier's arena is shared "
            f"with the sidecar on CPU only so far (its CUDA IPC export has not run on a GPU "
            f"yet); use --kv-compactor inprocess or drop --kv-tier-*"
        )
    if getattr(server_args, "enable_torch_compile", False):
        problems.append(
            "--kv-tier-bits with --enable-torch-compile: the tier's merge inside the "
            "attention is not verified under torch.compile; remove one of the two"
        )
    return problems


# The architectures the engine tests run (``sglang_evict.models.families``: identity
# with the masked reference in SGLang's engine, with eviction and with the tier);
# another one starts with a warning naming these (``model_warnings``).
VALIDATED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "DeepseekV2ForCausalLM",  # MLA (tests/test_engine_mla.py)
)
# The decode backend windowed layers follow logical positions in (``srt.windows``).
WINDOWED_BACKENDS = ("torch_native",)


def model_windows(model: ModelFacts) -> tuple[int, ...]:
    """The windows of the model's windowed layers (empty: full attention everywhere),
    as SGLang gives them (``srt.windows.layer_windows``)."""
    if model.hf_text_config is None:
        return ()
    from sglang_evict.srt.windows import layer_windows

    return tuple(w for w in layer_windows(model.hf_text_config) if w >= 0)


def model_warnings(model: ModelFacts, config: EvictionConfig | None = None) -> list[str]:
    """What the plugin says about a model it runs without having validated it, and
    about a recent window (``config``) narrower than the model's sliding windows."""
    warnings = _window_warnings(model, config) if config is not None else []
    names = [a for a in model.architectures if a not in VALIDATED_ARCHITECTURES]
    if not names and model.architectures:
        return warnings
    shown = ", ".join(names) or f"no architectures in {model.path}/config.json"
    return [
        f"sglang-evict has not validated {shown} (its engine tests run "
        f"{', '.join(VALIDATED_ARCHITECTURES)}): check its answers with eviction against "
        f"plain SGLang's before serving it (docs/serving.md, Supported models)",
        *warnings,
    ]


def _window_warnings(model: ModelFacts, config: EvictionConfig) -> list[str]:
    """A recent window below the model's sliding window lets passes evict tokens its
    windowed layers attend (without the tier: with it, ``_window_problems`` refuses)."""
    windows = model_windows(model)
    if config.tier_bits is not None or not windows or config.window_tokens >= max(windows):
        return []
    names = ", ".join(model.architectures) or model.path
    layers = model.hf_text_config.num_hidden_layers
    return [
        f"--kv-window {config.window_tokens} on {names}: {len(windows)} of its "
        f"{layers} layers attend a sliding window of "
        f"{max(windows)} tokens, and passes may evict tokens inside it (on Gemma 3 270M "
        f"that cost the most perplexity: docs/quality.md); --kv-window {max(windows)} "
        f"keeps every windowed layer's window whole"
    ]


def _window_problems(server_args, config: EvictionConfig, model: ModelFacts) -> list[str]:
    windows = model_windows(model)
    if not windows:
        return []
    names = ", ".join(model.architectures) or model.path
    widest = max(windows)
    problems = []
    backend = getattr(server_args, "decode_attention_backend", None) or getattr(
        server_args, "attention_backend", None
    )
    if backend not in WINDOWED_BACKENDS:
        chosen = f"--attention-backend {backend}" if backend else "SGLang's default backend"
        problems.append(
            f"{names} has sliding-window layers (window {widest}): with {chosen} they would "
            f"be windowed by KV index, which after compaction reaches past the window; "
            f"sglang-evict makes windows follow logical positions under --attention-backend "
            f"{' or '.join(WINDOWED_BACKENDS)} only so far: pass it, or serve this model "
            f"without sglang-evict"
        )
    if config.tier_bits is not None and config.window_tokens < widest:
        problems.append(
            f"--kv-tier-bits with --kv-window {config.window_tokens} on {names}: its "
            f"windowed layers (window {widest}) do not read the tier, so the recent window "
            f"must cover theirs; pass --kv-window {widest} or more"
        )
    return problems


# The scorers that read an MLA pool's latent rows as they are: positions (``streaming``,
# ``random``) or each row's norm (``knorm``). The others score keys against queries (or
# against per-head RoPE statistics) in the MHA head space, which the latent rows are not.
LATENT_SCORERS = ("streaming", "knorm", "random")


def _mla_problems(config: EvictionConfig, model: ModelFacts) -> list[str]:
    """What an MLA model (one latent row a token a layer) cannot be served with yet."""
    names = ", ".join(model.architectures) or model.path
    problems = []
    if config.scorer not in LATENT_SCORERS:
        problems.append(
            f"--kv-scorer {config.scorer} on {names}: MLA keeps one latent row a token, and "
            f"this scorer reads per-head keys and queries; use --kv-scorer "
            f"{' or '.join(LATENT_SCORERS)}"
        )
    if config.tier_bits is not None:
        problems.append(
            f"--kv-tier-bits on {names}: the quantized tier has no layout for MLA's latent "
            f"rows yet; drop --kv-tier-*"
        )
    if config.compactor != "inprocess":
        problems.append(
            f"--kv-compactor {config.compactor} on {names}: the compactor sidecar maps MHA "
            f"pools only; MLA's latent rows are compacted in-process (--kv-compactor "
            f"inprocess)"
        )
    return problems


def _model_problems(server_args, config: EvictionConfig, model: ModelFacts) -> list[str]:
    from sglang_evict.calibrate import check_stats_fit_model

    refused = [what for attribute, what in _MODEL_REFUSALS if getattr(model, attribute)]
    if refused:
        names = ", ".join(model.architectures) or model.path
        return [
            f"sglang-evict does not support {' or '.join(refused)} yet ({names}): it needs an "
            f"MHA/GQA model whose KV lives in MHATokenToKVPool, or an MLA model in "
            f"MLATokenToKVPool (see docs/serving.md, Supported models)"
        ]
    if model.is_mla:
        problems = _mla_problems(config, model)
        if problems:
            return problems
    problems = _window_problems(server_args, config, model)
    if config.tier_bits is not None and model.hf_text_config is not None:
        problems.extend(_tier_model_problems(config, model))
    if problems:
        return problems
    stats = getattr(config.make_scorer(), "stats", None)
    if stats is None or model.hf_text_config is None:
        return []
    try:
        check_stats_fit_model(stats, model.hf_text_config, model.path)
    except ValueError as error:
        return [f"--kv-scorer-stats {config.scorer_params.get('stats_path')}: {error}"]
    return []


def _tier_model_problems(config: EvictionConfig, model: ModelFacts) -> list[str]:
    """The tier against the model's attention: its head dim and logit soft-capping."""
    from sglang_evict_kernels.tier_format import SUPPORTED_HEAD_DIMS

    text = model.hf_text_config
    names = ", ".join(model.architectures) or model.path
    problems = []
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (
        text.hidden_size // heads if heads and getattr(text, "hidden_size", None) else None
    )
    if head_dim is not None and head_dim not in SUPPORTED_HEAD_DIMS:
        problems.append(
            f"--kv-tier-bits on {names}: its head dim is {head_dim}, the tier's kernels hold "
            f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}; drop --kv-tier-*"
        )
    cap = getattr(text, "attn_logit_softcapping", None)
    if cap:
        problems.append(
            f"--kv-tier-bits on {names}: it caps attention logits (attn_logit_softcapping "
            f"{cap}) and the tier's attention has no logit cap yet; drop --kv-tier-*"
        )
    return problems


def check_startup(server_args, config: EvictionConfig, model: ModelFacts | None) -> None:
    """``ValueError`` listing ``startup_problems`` when there are any."""
    problems = startup_problems(server_args, config, model)
    if problems:
        raise ValueError("; ".join(problems))


# --- parsing sglang.launch_server's arguments -------------------------------------------


class _OneLineParser(argparse.ArgumentParser):
    """SGLang's parser with errors raised as ``ValueError`` (one line), not printed
    after a usage text of several hundred flags."""

    def error(self, message: str):
        raise ValueError(
            f"{message} (sglang.launch_server flags; see `python -m sglang.launch_server --help`)"
        )


def _raw_server_args(argv: list[str]) -> argparse.Namespace:
    from sglang.srt.server_args import ServerArgs

    parser = _OneLineParser(prog="sglang.launch_server", add_help=False)
    ServerArgs.add_cli_args(parser)
    if "--config" in argv:
        from sglang.srt.server_args_config_parser import ConfigArgumentMerger

        argv = ConfigArgumentMerger(parser).merge_config_with_args(list(argv))
    return parser.parse_args(list(argv))


def no_accelerator() -> bool:
    """True when SGLang would find no device to pick without ``--device``."""
    from sglang.srt.utils.common import get_device

    try:
        get_device()
    except RuntimeError:
        return True
    return False


def parse_server_args(
    argv: list[str], *, dry_run: bool = False, gpu_memory_mib: float | None = None
):
    """SGLang's own parsing of ``sglang.launch_server`` arguments into ``ServerArgs``,
    after the checks that would otherwise end in a traceback or a download: a flag
    SGLang's parser rejects, no accelerator and no ``--device``, and (``dry_run``) a
    model that is not a local folder; and selects the plugin's radix cache itself, so
    SGLang validates the exact command that will run. With ``gpu_memory_mib`` SGLang
    picks its memory defaults (``mem_fraction_static``, chunked prefill, graph batch
    sizes) for a GPU of that capacity instead of this device's. Raises ``ValueError``
    (one line)."""
    raw = _raw_server_args(argv)
    if raw.radix_cache_backend is not None:
        raise ValueError(
            f"sglang-evict serve selects --radix-cache-backend {BACKEND_NAME} itself; remove "
            f"--radix-cache-backend {raw.radix_cache_backend}"
        )
    if dry_run:
        folder = Path(raw.model_path)
        if not folder.is_dir():
            raise ValueError(
                f"--model-path {raw.model_path}: not a local folder; the dry run reads the "
                f"model's config.json and never downloads: pass a local model folder (e.g. "
                f"`hf download {raw.model_path} --include config.json --local-dir DIR`)"
            )
        if not (folder / "config.json").is_file():
            raise ValueError(f"--model-path {raw.model_path}: the folder has no config.json")
    if raw.device is None and no_accelerator():
        raise ValueError(
            "no accelerator (CUDA, XPU, HPU, NPU, MUSA, MPS) on this machine for SGLang to "
            "pick: add --device cpu to validate (or serve) on CPU, or run where the GPU is"
        )
    from sglang.srt.server_args import prepare_server_args

    from sglang_evict.calibrate import first_line

    environment = dict(os.environ)
    try:
        with _device_memory_mib(gpu_memory_mib):
            return prepare_server_args([*argv, *backend_flags()])
    except (ValueError, AssertionError, NotImplementedError, RuntimeError) as error:
        # SGLang's own validation of the combination (it asserts some of it).
        raise ValueError(f"SGLang refuses these arguments: {first_line(error)}") from None
    finally:
        # Parsing sets process-wide switches for the server it prepares (0.5.17 sets
        # SGLANG_ENABLE_CP_V2 for a Llama); the server sets them again in its own
        # process. Left here, they change what SGLang's classes do in this one (its
        # PrefillAdder then asks for a context-parallel group no one created).
        for key in set(os.environ) - set(environment):
            del os.environ[key]
        for key, value in environment.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


@contextlib.contextmanager
def _device_memory_mib(gpu_memory_mib: float | None):
    """SGLang's argument parsing reads this capacity (MiB) as the device's."""
    if gpu_memory_mib is None:
        yield
        return
    import importlib

    from sglang_evict.srt.versioned import DEVICE_MEMORY_READERS

    modules = [importlib.import_module(name) for name in DEVICE_MEMORY_READERS]
    real = [module.get_device_memory_capacity for module in modules]
    for module in modules:
        module.get_device_memory_capacity = lambda device=None: gpu_memory_mib
    try:
        yield
    finally:
        for module, function in zip(modules, real, strict=True):
            module.get_device_memory_capacity = function


def backend_flags() -> list[str]:
    """What `sglang-evict serve` appends to SGLang's arguments."""
    return ["--radix-cache-backend", BACKEND_NAME]
