"""EvictionConfig: defaults, freezing, and errors that name the field and the range."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sglang_evict.config import EvictionConfig


def test_defaults_follow_the_documented_flags():
    config = EvictionConfig(kv_budget_tokens=1024)
    assert (config.cadence_tokens, config.sink_tokens, config.protected_tokens) == (128, 4, 0)
    assert (config.window_tokens, config.evict_prompt) == (128, False)
    assert config.trigger_tokens == 1024 + 128


def test_config_and_its_scorer_params_are_frozen():
    config = EvictionConfig(kv_budget_tokens=512, scorer="window", scorer_params={"mode": "last"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.kv_budget_tokens = 10  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.scorer_params["mode"] = "sum"  # type: ignore[index]
    assert config.make_scorer().mode == "last"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(kv_budget_tokens=132), r"kv_budget_tokens=132 .* must exceed .* = 132"),
        (dict(kv_budget_tokens=200, protected_tokens=100), r"4 \+ 100 \+ 128"),
        (dict(cadence_tokens=0), r"cadence_tokens=0 is out of range; allowed: >= 1"),
        (dict(sink_tokens=-1), r"sink_tokens=-1 is out of range"),
        (dict(window_tokens=1.5), r"window_tokens must be an integer"),
        (dict(page_size=0), r"page_size=0 is out of range; allowed: \[1, 4096\]"),
        (dict(scorer="knrom"), r"unknown scorer 'knrom'; known: \['knorm'"),
        (dict(compaction="slide"), r"unknown compaction 'slide'; known: \['repack', 'hole_fill'\]"),
        (dict(scorer="window", scorer_params={"mode": "all"}), r"unknown window mode 'all'"),
        (dict(scorer="triattention"), r"needs stats_path \(--kv-scorer-stats\)"),
        (dict(evict_prompt="yes"), r"evict_prompt must be true or false"),
        (dict(pass_group_steps=0), r"pass_group_steps=0 is out of range; allowed: \[1, 4096\]"),
    ],
)
def test_invalid_configs_name_the_field_and_the_allowed_values(overrides, message):
    values = {"kv_budget_tokens": 1024, **overrides}
    with pytest.raises(ValueError, match=message):
        EvictionConfig(**values)


def test_missing_stats_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="sglang-evict calibrate"):
        EvictionConfig(
            kv_budget_tokens=1024,
            scorer="triattention",
            scorer_params={"stats_path": str(tmp_path / "absent.safetensors")},
        )


REDIS_URL = "redis://:hunter2@redis:6379/0"


def test_repr_shows_the_redis_url_without_its_password():
    config = EvictionConfig(kv_budget_tokens=1024, lease_store="redis", redis_url=REDIS_URL)
    shown = repr(config)
    assert "hunter2" not in shown and "redis_url='redis://:***@redis:6379/0'" in shown
    assert shown.startswith("EvictionConfig(kv_budget_tokens=1024, cadence_tokens=128")


def test_policy_json_leaves_the_redis_url_to_its_own_variable():
    config = EvictionConfig(kv_budget_tokens=1024, lease_store="redis", redis_url=REDIS_URL)
    fields = json.loads(config.to_json())
    assert "redis_url" not in fields and "page_size" not in fields
    assert fields["lease_store"] == "redis"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://:hunter2@host:port/0", r"redis_url: malformed Redis URL 'redis://:\*\*\*@"),
        ("http://redis:6379", r"redis_url: 'http://redis:6379' is not a Redis URL"),
        (6379, r"redis_url must be a string"),
    ],
)
def test_malformed_redis_url_is_refused_without_showing_the_password(url, message):
    with pytest.raises(ValueError, match=message) as refused:
        EvictionConfig(kv_budget_tokens=1024, lease_store="redis", redis_url=url)
    assert "hunter2" not in str(refused.value)
