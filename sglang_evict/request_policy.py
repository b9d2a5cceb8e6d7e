"""One request's eviction policy: the server's defaults with the request's own
overrides, checked against the server's limits. Pure: no SGLang, no state.

A request carries its overrides in SGLang's sampling parameters, under one key of
``custom_params`` (read and attached by ``sglang_evict.srt.request_policy``)::

    "sampling_params": {"custom_params": {"sglang_evict": {
        "kv_budget_tokens": 256, "cadence_tokens": 32, "scorer": "knorm"}}}
    "sampling_params": {"custom_params": {"sglang_evict": {"enabled": false}}}
    "sampling_params": {"custom_params": {"sglang_evict": {"tier_tokens": 0}}}

Every field is optional; what a request leaves out comes from the server's flags. The
server's flags also set the limits (``RequestLimits``):

    field              allowed                                        server flag
    enabled            true / false (false only with the flag)        --kv-request-allow-disable
    kv_budget_tokens   sinks + protected + window < budget <= max     --kv-request-max-budget
    cadence_tokens     1 <= cadence <= max                            --kv-request-max-cadence
    scorer             the scorers this server serves per request     --kv-scorer (+ server_scorers)
    tier_tokens        0 <= tokens <= the server's, whole groups      --kv-tier-tokens (a server
                       (0: no tier: the request's cold tokens are     with --kv-tier-bits only)
                       evicted)

By default (no flag) a request may lower its budget and cadence and choose another
scorer, but not hold more KV than the server's own policy allows: raising either
maximum, or allowing eviction off, is the operator's decision.

Each response's ``meta_info["sglang_evict"]`` reports what eviction did to the request
(``report_of``): its resolved policy, ``passes``, ``tokens_evicted`` and
``peak_kv_tokens``, the most KV slots it held; ``passes_failed``, its passes that
failed (a lease store or compactor down: it kept its KV and evicted later);
``retractions``, the times SGLang retracted it (re-prefilled from its tokens);
``kv_tokens_held``, the full-precision tokens it held when it ended; on a server with
the quantized tier also ``tier_tokens_held``, its tier tokens then. A request with a
failed pass or a retraction evicted at other steps than it would have alone, so its
greedy tokens may differ from a run without them.

``bounded_kv_tokens`` is the KV a request can hold at most under its policy, from its
lengths alone: what budget-aware admission reserves for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The key of SGLang's ``custom_params`` that holds a request's overrides.
CARRIER_KEY = "sglang_evict"
FIELDS = ("enabled", "kv_budget_tokens", "cadence_tokens", "scorer", "tier_tokens")
# The key of a response's meta_info holding what eviction did to the request.
REPORT_KEY = "sglang_evict"
REPORT_FIELDS = ("passes", "tokens_evicted", "peak_kv_tokens", "passes_failed", "retractions")


class RequestPolicyError(ValueError):
    """A request's overrides are refused; ``field`` names the offending one as the
    client wrote it (``custom_params.sglang_evict.<field>``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class RequestPolicy:
    """What eviction does to one request.

    Attributes:
        enabled: False: the request is never evicted (it holds its whole KV).
        kv_budget_tokens: tokens the request keeps after a pass.
        cadence_tokens: a pass runs once a pass would evict at least this many tokens.
        scorer: the registered scorer ranking its tokens.
        tier_tokens: the most tokens its quantized tier holds (0: no tier; what a pass
            does not keep is evicted).
    """

    enabled: bool
    kv_budget_tokens: int
    cadence_tokens: int
    scorer: str
    tier_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The fields (``tier_tokens`` only on a request with a tier)."""
        return {
            name: getattr(self, name)
            for name in FIELDS
            if name != "tier_tokens" or self.tier_tokens
        }


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of this server (from its flags)."""

    min_budget_tokens: int  # sinks + protected + window + 1
    max_budget_tokens: int
    max_cadence_tokens: int
    scorers: tuple[str, ...]
    allow_disable: bool
    max_tier_tokens: int = 0  # the server's --kv-tier-tokens (0: the server runs no tier)
    tier_group_tokens: int = 0

    @classmethod
    def of(cls, config, scorers: tuple[str, ...]) -> RequestLimits:
        """The limits of a server running ``config`` (an ``EvictionConfig``) whose
        requests may choose among ``scorers``."""
        always_kept = config.sink_tokens + config.protected_tokens + config.window_tokens
        return cls(
            min_budget_tokens=always_kept + 1,
            max_budget_tokens=config.request_max_budget,
            max_cadence_tokens=config.request_max_cadence,
            scorers=tuple(scorers),
            allow_disable=config.request_allow_disable,
            max_tier_tokens=config.tier_max_tokens if config.tier_bits is not None else 0,
            tier_group_tokens=config.tier_group_tokens,
        )


def default_policy(config) -> RequestPolicy:
    """The policy of a request that overrides nothing: the server's."""
    return RequestPolicy(
        enabled=True,
        kv_budget_tokens=config.kv_budget_tokens,
        cadence_tokens=config.cadence_tokens,
        scorer=config.scorer,
        tier_tokens=config.tier_max_tokens if config.tier_bits is not None else 0,
    )


def _name(field: str) -> str:
    return f"custom_params.{CARRIER_KEY}.{field}"


def _integer(overrides: Mapping, field: str, low: int, high: int, why: str) -> int | None:
    value = overrides.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestPolicyError(
            field, f"{_name(field)} must be an integer in [{low}, {high}] ({why}), got {value!r}"
        )
    if not low <= value <= high:
        raise RequestPolicyError(
            field, f"{_name(field)}={value} is out of range; allowed: [{low}, {high}] ({why})"
        )
    return value


def resolve_request_policy(
    defaults: RequestPolicy, overrides: Any, limits: RequestLimits
) -> RequestPolicy:
    """The policy of a request whose ``custom_params["sglang_evict"]`` is ``overrides``
    (None: the defaults). Raises ``RequestPolicyError`` naming the field and its
    allowed values; nothing is half-applied."""
    if overrides is None:
        return defaults
    if not isinstance(overrides, Mapping):
        raise RequestPolicyError(
            CARRIER_KEY,
            f"custom_params.{CARRIER_KEY} must be an object with any of {list(FIELDS)}, got "
            f"{type(overrides).__name__}",
        )
    unknown = sorted(str(key) for key in overrides if key not in FIELDS)
    if unknown:
        raise RequestPolicyError(
            unknown[0],
            f"custom_params.{CARRIER_KEY} has no field(s) {unknown}; allowed: {list(FIELDS)}",
        )
    enabled = overrides.get("enabled", True)
    if not isinstance(enabled, bool):
        raise RequestPolicyError(
            "enabled", f"{_name('enabled')} must be true or false, got {enabled!r}"
        )
    if not enabled and not limits.allow_disable:
        raise RequestPolicyError(
            "enabled",
            f"{_name('enabled')}=false is not allowed by this server; allowed: true (the "
            f"server turns it on with --kv-request-allow-disable)",
        )
    budget = _integer(
        overrides,
        "kv_budget_tokens",
        limits.min_budget_tokens,
        limits.max_budget_tokens,
        "above the server's sinks + protected + window, at most --kv-request-max-budget",
    )
    cadence = _integer(
        overrides,
        "cadence_tokens",
        1,
        limits.max_cadence_tokens,
        "at most --kv-request-max-cadence",
    )
    scorer = overrides.get("scorer")
    if scorer is not None and scorer not in limits.scorers:
        raise RequestPolicyError(
            "scorer",
            f"{_name('scorer')}={scorer!r} is not served per request here; allowed: "
            f"{list(limits.scorers)}",
        )
    tier = overrides.get("tier_tokens")
    if tier is not None:
        if not limits.max_tier_tokens:
            raise RequestPolicyError(
                "tier_tokens",
                f"{_name('tier_tokens')}: this server runs no quantized tier (the operator "
                f"turns it on with --kv-tier-bits)",
            )
        g = limits.tier_group_tokens
        tier = _integer(
            overrides,
            "tier_tokens",
            0,
            limits.max_tier_tokens,
            f"whole groups of {g} tokens, at most --kv-tier-tokens",
        )
        if tier % g:
            raise RequestPolicyError(
                "tier_tokens",
                f"{_name('tier_tokens')}={tier}: the tier holds whole groups of {g} tokens; "
                f"allowed: multiples of {g} in [0, {limits.max_tier_tokens}]",
            )
    return RequestPolicy(
        enabled=enabled,
        kv_budget_tokens=defaults.kv_budget_tokens if budget is None else budget,
        cadence_tokens=defaults.cadence_tokens if cadence is None else cadence,
        scorer=defaults.scorer if scorer is None else scorer,
        tier_tokens=defaults.tier_tokens if tier is None else tier,
    )


def bounded_kv_tokens(
    policy: RequestPolicy, config, *, prompt_len: int, max_new_tokens: int
) -> int:
    """The most KV tokens (whole pages) a request can hold under ``policy`` on a server
    running ``config``, from its lengths alone.

    Derivation (``sglang_evict.passes.batch.counts``): the protected tokens are at most
    ``lead + window``, ``lead`` being the sinks + protected prefix, the prompt (unless
    ``evict_prompt``) and the radix-tree prefix (``cache_protected_len``: whole pages of
    the prompt, so at most the prompt rounded down to a page); so a pass keeps at most
    ``kept = max(budget, lead + window)``. A pass is
    due once it would evict ``cadence`` tokens, checked before each decode step
    allocates its slot, so the request holds at most ``kept + cadence``, or its prompt
    plus the first decoded token (no pass runs before the second decode step). Never
    more than the whole request, ``prompt + max_new_tokens``; rounded up to whole pages.
    Under a tier (``tier_tokens`` > 0) a pass is due once ``max(cadence, G)`` tokens
    are cold; the tier's own bytes live in its arena, outside the pool this counts.
    A ``repack`` pass also claims staging pages for the duration of the pass
    (``PassCounts.staging_pages``), returned before it ends. (A retracted request is
    re-prefilled from its prompt and output, which count as its prompt from then on.)
    """
    if prompt_len < 0 or max_new_tokens < 0:
        raise ValueError(
            f"prompt_len={prompt_len}, max_new_tokens={max_new_tokens}: need both >= 0"
        )
    page = config.page_size
    whole = prompt_len + max_new_tokens
    if policy.enabled:
        lead = max(
            config.sink_tokens + config.protected_tokens,
            0 if config.evict_prompt else prompt_len,
            prompt_len // page * page,
        )
        kept = max(policy.kv_budget_tokens, lead + config.window_tokens)
        cadence = policy.cadence_tokens
        if policy.tier_tokens:  # a pass is due once a whole group is cold (tier.policy)
            cadence = max(cadence, config.tier_group_tokens)
        whole = min(whole, max(kept + cadence, prompt_len + 1))
    return -(-whole // page) * page


def report_of(meta_info: Mapping) -> dict | None:
    """The eviction report of a response's ``meta_info`` (None: the server sent none).
    SGLang delivers it as a per-output-token list whose last non-null entry is the
    report (``sglang_evict.srt.request_policy``)."""
    values = meta_info.get(REPORT_KEY) or []
    return next((value for value in reversed(values) if value is not None), None)
