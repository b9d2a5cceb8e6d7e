"""The eviction flags every ``sglang-evict`` subcommand shares (policy, compactor and
leases, per-request limits, admission) and the ``EvictionConfig`` they build: one
definition, so ``simulate``, ``demo`` and ``serve`` read a flag the same way."""

from __future__ import annotations

import argparse

from compactor_service.health import DEFAULT_SOCKET
from sglang_evict.admission import ADMISSIONS
from sglang_evict.config import (
    COMPACTION_STRATEGIES,
    COMPACTOR_FALLBACKS,
    COMPACTORS,
    DEFAULT_PASS_GRAPH_POOL_MIB,
    DEFAULT_SCORER,
    LEASE_STORES,
    MAX_PASS_GRAPH_POOL_MIB,
    MAX_PASS_GROUP_STEPS,
    MAX_QUERY_WINDOW_TOKENS,
    MAX_REQUEST_TOKENS,
    MAX_SINK_TOKENS,
    EvictionConfig,
)
from sglang_evict.passes.grouping import AUTO, AUTO_MAX_GROUP_STEPS
from sglang_evict.scorers import SCORERS, needs_calibration

# The largest value any integer flag takes. SGLang's token positions and request-to-token
# rows are int32 (config.MAX_REQUEST_TOKENS), so no token count can exceed 2**31 - 1,
# and neither can a sensible step count, timeout or model size; a larger value is a typo
# that would otherwise pass the flag checks (Python integers have no bound) and overflow
# later, in a tensor or in SGLang.
MAX_INT_FLAG = MAX_REQUEST_TOKENS


def int_flag(low: int, high: int = MAX_INT_FLAG):
    """An argparse ``type``: an integer in ``[low, high]``, else argparse's one-line error
    naming the flag and the range."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"{text:.40} is out of range; allowed: [{low}, {high}]"
            )
        return value

    return parse


def float_flag(low: float, high: float):
    """An argparse ``type``: a finite number in ``[low, high]``, else argparse's one-line
    error naming the flag and the range."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
        if not low <= value <= high:  # also refuses nan
            raise argparse.ArgumentTypeError(
                f"{text:.40} is out of range; allowed: [{low:g}, {high:g}]"
            )
        return value

    return parse


def group_steps_flag(text: str) -> int | str:
    """``--kv-pass-group-steps``: ``auto`` or an integer in ``[1, MAX_PASS_GROUP_STEPS]``."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return int_flag(1, MAX_PASS_GROUP_STEPS)(text)
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"{error} (or auto)") from None


# The tier's flags besides --kv-tier-bits: (flag, config field, type, metavar, help).
# Their defaults are the config's; given without --kv-tier-bits they are refused, since
# no tier would run.
TIER_DETAIL_FLAGS = (
    ("--kv-tier-group", "tier_group_tokens", int, "G", "tokens quantized together"),
    ("--kv-tier-value-group", "tier_value_group_channels", int, "C",
     "channels sharing a value range"),
    ("--kv-tier-outliers", "tier_outlier_tokens", int, "N",
     "outlier tokens per group and KV head kept in full precision (OTT)"),
    ("--kv-tier-tokens", "tier_max_tokens", int, "TOKENS",
     "the most tokens one request's tier holds (whole groups)"),
    ("--kv-tier-pool-share", "tier_pool_share", float, "SHARE",
     "the share of the KV memory the tier's arena takes"),
)  # fmt: skip


def add_policy_flags(parser: argparse.ArgumentParser, default_budget: int | None = None) -> None:
    """The eviction flags, named as ``sglang-evict serve`` takes them."""
    parser.add_argument(
        "--kv-budget",
        type=int_flag(1),
        required=default_budget is None,
        default=default_budget,
        help="tokens kept after a pass",
    )
    parser.add_argument("--kv-cadence", type=int_flag(1), default=128, help="tokens between passes")
    parser.add_argument(
        "--kv-pass-group-steps",
        type=group_steps_flag,
        default=1,
        metavar="N|auto",
        help="run passes on every N-th decode step only, one pass for every request due "
        "since the last (fewer, larger passes; a request may hold N-1 more tokens); auto: "
        "the server picks N to keep passes under 1%% of decode-step time (at most "
        f"{AUTO_MAX_GROUP_STEPS})",
    )
    parser.add_argument(
        "--kv-pass-cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay passes as CUDA graphs, one per bucketed pass shape (default: on where "
        "the KV pool is on a GPU and SGLang's CUDA graphs are on)",
    )
    parser.add_argument(
        "--kv-pass-graph-pool-mib",
        type=int_flag(1, MAX_PASS_GRAPH_POOL_MIB),
        default=DEFAULT_PASS_GRAPH_POOL_MIB,
        metavar="MIB",
        help="the most memory the pass CUDA graphs may hold, taken out of the KV pool when "
        "they are on; pass shapes past it run eagerly (default: %(default)s)",
    )
    tier = parser.add_argument_group(
        "quantized tier",
        "keep at low precision what a pass would evict, evict only beyond the tier "
        "(docs/architecture.md). eval-tier runs it, serve in SGLang's engine with "
        "--attention-backend torch_native (docs/serving.md), and demo beside eviction; "
        "simulate refuses these flags",
    )
    tier.add_argument(
        "--kv-tier-bits",
        type=int,
        default=None,
        metavar="BITS",
        help="2, 3, 4 or 8: the tier's bits per element (default: no tier)",
    )
    defaults = EvictionConfig.__dataclass_fields__
    for flag, field, kind, metavar, text in TIER_DETAIL_FLAGS:
        tier.add_argument(
            flag,
            type=kind,
            default=None,
            metavar=metavar,
            help=f"{text} (default: {defaults[field].default}; with --kv-tier-bits only)",
        )
    parser.add_argument(
        "--kv-sink-tokens",
        type=int_flag(0, MAX_SINK_TOKENS),
        default=4,
        help="attention sinks kept",
    )
    parser.add_argument(
        "--kv-protected-tokens", type=int_flag(0), default=0, help="e.g. system prompt"
    )
    parser.add_argument(
        "--kv-window", type=int_flag(0), default=128, help="recent tokens always kept"
    )
    parser.add_argument("--kv-scorer", default=DEFAULT_SCORER, help=f"one of {sorted(SCORERS)}")
    parser.add_argument(
        "--kv-scorer-stats", default=None, help="triattention: stats file from calibration"
    )
    parser.add_argument(
        "--kv-scorer-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a scorer parameter (repeatable), e.g. mode=last for window; VALUE is read as "
        "JSON when it parses, else as a string",
    )
    parser.add_argument(
        "--kv-query-window",
        type=int_flag(1, MAX_QUERY_WINDOW_TOKENS),
        default=EvictionConfig.__dataclass_fields__["query_window_tokens"].default,
        help="window/rkv: each request's latest queries captured inside the attention "
        "(memory: see docs/serving.md, Scorers)",
    )
    parser.add_argument(
        "--kv-query-slots",
        type=int_flag(1),
        default=None,
        help="window/rkv: requests whose queries are kept at once (default: as many as "
        "bounded admission lets run that a pass may read, KV pool // (--kv-budget + 1)); "
        "a request finding none free waits",
    )
    parser.add_argument(
        "--kv-evict-prompt",
        action="store_true",
        help="let passes evict the request's unshared prompt tokens (kept out of the radix "
        "tree: later requests do not reuse them); window/rkv score them with the last "
        "prompt queries at the first pass",
    )
    parser.add_argument(
        "--kv-compaction",
        default="hole_fill",
        choices=COMPACTION_STRATEGIES,
        help="strategy of the configured policy",
    )


def add_compactor_flags(parser: argparse.ArgumentParser) -> None:
    """Where passes copy KV (in-process or the sidecar) and where leases live."""
    from compactor_service.runtime_dir import DEFAULT_POOL_DIR

    parser.add_argument(
        "--kv-compactor",
        default="inprocess",
        choices=COMPACTORS,
        help="grpc: send passes to the compactor process at --kv-compactor-socket",
    )
    parser.add_argument("--kv-compactor-socket", default=DEFAULT_SOCKET)
    parser.add_argument(
        "--kv-compactor-fallback",
        default="inprocess",
        choices=COMPACTOR_FALLBACKS,
        help="when the sidecar cannot serve a pass: complete it in-process, or skip "
        "passes while it is down",
    )
    parser.add_argument("--kv-compactor-timeout-ms", type=int_flag(1), default=1000)
    parser.add_argument(
        "--kv-compactor-pool-dir",
        default=DEFAULT_POOL_DIR,
        help="private directory of CPU pool files; the compactor's --pool-dir",
    )
    parser.add_argument(
        "--kv-compactor-address", default=None, help="HOST:PORT of a TCP compactor (--tcp)"
    )
    parser.add_argument(
        "--kv-compactor-tls-ca", default=None, help="CA of the TCP compactor's certificate"
    )
    parser.add_argument("--kv-compactor-tls-cert", default=None, help="client cert (mTLS)")
    parser.add_argument("--kv-compactor-tls-key", default=None, help="client key (mTLS)")
    parser.add_argument(
        "--kv-lease-store",
        default="inprocess",
        choices=LEASE_STORES,
        help="where pass leases (fencing tokens) live; redis for multi-process deployments",
    )
    parser.add_argument("--kv-redis-url", default=None, help="redis://HOST:PORT/DB")
    parser.add_argument(
        "--kv-lease-namespace",
        default="default",
        help="Redis key namespace; distinct per scheduler sharing one Redis (e.g. the pod name)",
    )
    parser.add_argument(
        "--kv-lease-ttl-ms",
        type=int_flag(1),
        default=EvictionConfig.__dataclass_fields__["lease_ttl_ms"].default,
        help="lifetime of a pass's lease, taken around its moves only (with the sidecar "
        "at least twice --kv-compactor-timeout-ms)",
    )


def add_request_limit_flags(parser: argparse.ArgumentParser) -> None:
    """What a request may ask for itself (``custom_params["sglang_evict"]``; see
    ``sglang_evict.request_policy``)."""
    parser.add_argument(
        "--kv-request-max-budget",
        type=int_flag(1),
        default=None,
        metavar="N",
        help="largest budget a request may ask for (default: --kv-budget, so requests "
        "may only lower it)",
    )
    parser.add_argument(
        "--kv-request-max-cadence",
        type=int_flag(1),
        default=None,
        metavar="N",
        help="largest cadence a request may ask for (default: --kv-cadence)",
    )
    parser.add_argument(
        "--kv-request-allow-disable",
        action="store_true",
        help="let a request turn eviction off for itself",
    )


def add_admission_flags(parser: argparse.ArgumentParser) -> None:
    """How SGLang's scheduler counts an evicting request's KV (``sglang_evict.admission``)."""
    parser.add_argument(
        "--kv-admission",
        default="bounded",
        choices=ADMISSIONS,
        help="bounded: admit by the KV an evicting request can still add under its budget; "
        "sglang: SGLang's reservation for the rest of max_new_tokens",
    )
    parser.add_argument(
        "--kv-no-pressure-passes",
        action="store_true",
        help="when a decode step cannot allocate, let SGLang retract at once instead of "
        "compacting the most evictable requests first",
    )


def request_limit_fields(args: argparse.Namespace) -> dict:
    if not hasattr(args, "kv_request_max_budget"):
        return {}
    return dict(
        request_max_budget_tokens=args.kv_request_max_budget,
        request_max_cadence_tokens=args.kv_request_max_cadence,
        request_allow_disable=args.kv_request_allow_disable,
    )


def admission_fields(args: argparse.Namespace) -> dict:
    if not hasattr(args, "kv_admission"):
        return {}
    return dict(admission=args.kv_admission, pressure_passes=not args.kv_no_pressure_passes)


def tier_fields(args: argparse.Namespace) -> dict:
    if not hasattr(args, "kv_tier_bits"):
        return {}
    given = {
        flag: (field, getattr(args, flag[2:].replace("-", "_")))
        for flag, field, *_ in TIER_DETAIL_FLAGS
    }
    given = {flag: pair for flag, pair in given.items() if pair[1] is not None}
    if args.kv_tier_bits is None and given:
        flags = ", ".join(given)
        raise ValueError(
            f"{flags} without --kv-tier-bits: no tier runs without its bits; add "
            f"--kv-tier-bits 3 (2, 3, 4 or 8) or drop {flags}"
        )
    return dict(tier_bits=args.kv_tier_bits, **dict(given.values()))


def compactor_fields(args: argparse.Namespace) -> dict:
    if not hasattr(args, "kv_compactor"):
        return {}
    return dict(
        compactor=args.kv_compactor,
        compactor_socket=args.kv_compactor_socket,
        compactor_fallback=args.kv_compactor_fallback,
        compactor_timeout_ms=args.kv_compactor_timeout_ms,
        shm_dir=args.kv_compactor_pool_dir,
        compactor_address=args.kv_compactor_address,
        compactor_tls_ca=args.kv_compactor_tls_ca,
        compactor_tls_cert=args.kv_compactor_tls_cert,
        compactor_tls_key=args.kv_compactor_tls_key,
        lease_store=args.kv_lease_store,
        redis_url=args.kv_redis_url,
        lease_namespace=args.kv_lease_namespace,
        lease_ttl_ms=args.kv_lease_ttl_ms,
    )


def config_from_args(args: argparse.Namespace) -> EvictionConfig:
    if args.kv_scorer_stats and not needs_calibration(args.kv_scorer):
        raise ValueError(
            f"--kv-scorer-stats is read by the triattention scorer only, not --kv-scorer "
            f"{args.kv_scorer}; drop it or pass --kv-scorer triattention"
        )
    params = scorer_params(args.kv_scorer_param)
    if args.kv_scorer_stats:
        params["stats_path"] = args.kv_scorer_stats
    return EvictionConfig(
        kv_budget_tokens=args.kv_budget,
        cadence_tokens=args.kv_cadence,
        pass_group_steps=args.kv_pass_group_steps,
        pass_cuda_graph=args.kv_pass_cuda_graph,
        pass_graph_pool_mib=args.kv_pass_graph_pool_mib,
        sink_tokens=args.kv_sink_tokens,
        protected_tokens=args.kv_protected_tokens,
        window_tokens=args.kv_window,
        scorer=args.kv_scorer,
        scorer_params=params,
        compaction=args.kv_compaction,
        page_size=args.page_size,
        query_window_tokens=args.kv_query_window,
        query_slots=args.kv_query_slots,
        evict_prompt=args.kv_evict_prompt,
        **tier_fields(args),
        **compactor_fields(args),
        **request_limit_fields(args),
        **admission_fields(args),
    )


def scorer_params(pairs: list[str]) -> dict:
    """``--kv-scorer-param KEY=VALUE`` flags as a dict (VALUE as JSON when it parses)."""
    import json

    params = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--kv-scorer-param {pair!r}: expected KEY=VALUE, e.g. mode=last")
        try:
            params[key] = json.loads(value)
        except ValueError:
            params[key] = value
    return params


def refuse_tier_in_engine(config: EvictionConfig, command: str) -> None:
    """``simulate`` does not run the tier: it refuses ``--kv-tier-*`` in one line rather
    than ignore it."""
    if config.tier_bits is not None:
        raise ValueError(
            f"--kv-tier-bits: {command} does not run the quantized tier yet (sglang-evict "
            f"eval-tier, demo and serve --attention-backend torch_native do), so {command} "
            f"refuses it: drop --kv-tier-*"
        )
