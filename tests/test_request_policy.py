"""The per-request policy as a pure type: the server's defaults, a request's overrides
and the server's limits (``sglang_evict.request_policy``)."""

from __future__ import annotations

import pytest

from sglang_evict.config import EvictionConfig
from sglang_evict.request_policy import (
    RequestLimits,
    RequestPolicy,
    RequestPolicyError,
    default_policy,
    report_of,
    resolve_request_policy,
)

SCORERS = ("streaming", "knorm", "random")


def server(page_size: int = 1, **overrides) -> EvictionConfig:
    """The policy of the tests' servers (``tests.engine_harness.POLICY_SERVER``'s)."""
    fields = dict(
        kv_budget_tokens=48,
        cadence_tokens=16,
        sink_tokens=4,
        window_tokens=16,
        scorer="streaming",
        page_size=page_size,
        request_max_budget_tokens=4096,
        request_max_cadence_tokens=64,
        request_allow_disable=True,
    )
    return EvictionConfig(**{**fields, **overrides})


def resolve(overrides, config=None):
    config = config or server()
    return resolve_request_policy(
        default_policy(config), overrides, RequestLimits.of(config, SCORERS)
    )


def test_request_without_overrides_runs_the_servers_policy():
    expected = RequestPolicy(
        enabled=True, kv_budget_tokens=48, cadence_tokens=16, scorer="streaming"
    )
    assert resolve(None) == resolve({}) == expected


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"kv_budget_tokens": 21}, (True, 21, 16, "streaming")),
        ({"kv_budget_tokens": 4096}, (True, 4096, 16, "streaming")),
        ({"cadence_tokens": 1}, (True, 48, 1, "streaming")),
        ({"cadence_tokens": 64, "scorer": "knorm"}, (True, 48, 64, "knorm")),
        ({"enabled": False}, (False, 48, 16, "streaming")),
        ({"enabled": True, "kv_budget_tokens": 100}, (True, 100, 16, "streaming")),
    ],
)
def test_overrides_replace_only_the_fields_they_name(overrides, expected):
    policy = resolve(overrides)
    assert (policy.enabled, policy.kv_budget_tokens, policy.cadence_tokens, policy.scorer) == (
        expected
    )


B, C = "kv_budget_tokens", "cadence_tokens"


def _bad(case_id: str, overrides, field: str, words: str):
    """A refused value: the field the error names and words its message must hold."""
    return pytest.param(overrides, field, words, id=case_id)


BAD_VALUES = [
    _bad("budget-at-always-kept", {B: 20}, B, "allowed: [21, 4096]"),
    _bad("budget-above-max", {B: 4097}, B, "allowed: [21, 4096]"),
    _bad("budget-string", {B: "64"}, B, "must be an integer in [21, 4096]"),
    _bad("budget-float", {B: 64.0}, B, "must be an integer"),
    _bad("budget-bool", {B: True}, B, "must be an integer"),
    _bad("cadence-zero", {C: 0}, C, "allowed: [1, 64]"),
    _bad("cadence-above-max", {C: 65}, C, "allowed: [1, 64]"),
    _bad("scorer-unknown", {"scorer": "knrom"}, "scorer", "['streaming', 'knorm', 'random']"),
    _bad("scorer-needs-stats", {"scorer": "triattention"}, "scorer", "not served per request"),
    _bad("enabled-string", {"enabled": "no"}, "enabled", "must be true or false"),
    _bad("unknown-field", {"budget": 64}, "budget", "allowed: ['enabled', 'kv_budget_tokens'"),
    _bad("not-an-object", [64], "sglang_evict", "must be an object"),
]


@pytest.mark.parametrize(("overrides", "field", "words"), BAD_VALUES)
def test_bad_value_is_refused_naming_the_field_and_what_is_allowed(overrides, field, words):
    with pytest.raises(RequestPolicyError) as refused:
        resolve(overrides)
    assert refused.value.field == field
    message = str(refused.value)
    assert words in message
    assert "custom_params.sglang_evict" in message


def test_by_default_a_request_may_only_lower_what_it_holds():
    """No limit flag: the server's budget and cadence are the maxima, eviction stays on."""
    config = EvictionConfig(kv_budget_tokens=48, cadence_tokens=16, window_tokens=16)
    assert resolve({"kv_budget_tokens": 48, "cadence_tokens": 16}, config).kv_budget_tokens == 48
    for overrides, words in (
        ({"kv_budget_tokens": 49}, "allowed: [21, 48]"),
        ({"cadence_tokens": 17}, "allowed: [1, 16]"),
        ({"enabled": False}, "--kv-request-allow-disable"),
    ):
        with pytest.raises(RequestPolicyError, match=words.replace("[", r"\[")):
            resolve(overrides, config)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("request_max_budget_tokens", 47, "--kv-request-max-budget"),
        ("request_max_cadence_tokens", 15, "--kv-request-max-cadence"),
        ("request_max_budget_tokens", 0, "out of range"),
        ("request_allow_disable", "yes", "true or false"),
    ],
)
def test_server_limits_below_the_servers_own_policy_are_refused(field, value, words):
    with pytest.raises(ValueError, match=words):
        EvictionConfig(kv_budget_tokens=48, cadence_tokens=16, window_tokens=16, **{field: value})


def test_report_is_the_last_entry_sglang_delivers():
    report = {"passes": 2, "tokens_evicted": 32, "peak_kv_tokens": 64}
    assert report_of({"sglang_evict": [None, None, report]}) == report
    assert report_of({"prompt_tokens": 3}) is None
