"""The server side of the policy: how it reaches SGLang's processes, and which SGLang
flags the plugin refuses (by flag, with the reason and the fix)."""

from __future__ import annotations

from sglang_evict.config import EvictionConfig
from sglang_evict.srt.tp import RANK_INDEPENDENT_SCORERS, TP_REDUCED_SCORERS

BACKEND_NAME = "sglang-evict"
# The policy reaches SGLang's scheduler processes through the environment (they inherit
# it from `sglang-evict serve`): a JSON object of EvictionConfig fields, page size excluded.
CONFIG_ENV = "SGLANG_EVICT_CONFIG"


def config_from_env(page_size: int, environ: dict | None = None) -> EvictionConfig:
    """Read the policy that `sglang-evict serve` put in ``SGLANG_EVICT_CONFIG``."""
    import json
    import os

    raw = (environ if environ is not None else os.environ).get(CONFIG_ENV)
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
    try:
        return EvictionConfig(**fields, page_size=page_size)
    except TypeError as error:
        raise ValueError(f"{CONFIG_ENV}: {error}") from None


def unsupported_server_args(server_args, scorer: str | None = None) -> list[str]:
    """Messages naming each SGLang flag this plugin cannot run with (empty if fine)."""
    problems = []
    refusals = (
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
    )
    for attribute, is_set, flag, why in refusals:
        if is_set(getattr(server_args, attribute, None)):
            problems.append(f"{flag} is not supported with sglang-evict yet ({why}); remove it")
    tp_size = getattr(server_args, "tp_size", 1) or 1
    supported_under_tp = RANK_INDEPENDENT_SCORERS + TP_REDUCED_SCORERS
    if tp_size > 1 and scorer is not None and scorer not in supported_under_tp:
        problems.append(
            f"--tp-size {tp_size} with --kv-scorer {scorer} is not supported yet (each rank "
            f"holds different KV heads and this scorer's per-rank inputs are not split "
            f"yet); use --kv-scorer {' or '.join(supported_under_tp)}, or --tp-size 1"
        )
    return problems


def parse_server_args(argv: list[str]):
    """SGLang's own parsing of ``sglang.launch_server`` arguments into ``ServerArgs``."""
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(list(argv))
