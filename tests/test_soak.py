"""``benches/soak.py --short``: CI's form of the soak (2 minutes, the tiny model, faults
on: the supervised sidecar's server SIGKILLed and Redis restarted under load). It
asserts the invariants, never a timing: no 5xx, no request that never ends, only the
400s the bad requests ask for, every idle point clean (SGLang's idle check ran, the
plugin tracks nothing), and replayed greedy requests give the same tokens."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parents[1] / "benches"


@pytest.mark.engine
@pytest.mark.engine_group("soak")  # its own server, sidecar and Redis
def test_the_short_soak_holds_every_invariant_under_faults(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed; .ci/run installs it (apt-get)")
    result = subprocess.run(
        [sys.executable, str(BENCHES / "soak.py"), "--short", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["violations"] == []
    phases = {p["name"]: p for p in report["phases"]}
    assert list(phases) == ["warm-up", "load", "faults"]
    for phase in phases.values():
        assert phase["completed"] > 0 and not phase["5xx"] and not phase["never_ended"]
        assert not phase["unexpected_4xx"]
        (replica,) = phase["idle"]["replicas"]
        assert replica["idle_check_ran"] and replica["tracked_requests"] == 0
    # the bad requests were sent and refused, naming their field; streams were cut
    assert sum(sum(p["expected_4xx"].values()) for p in phases.values()) > 0
    assert sum(p["cancelled_by_client"] for p in phases.values()) > 0
    # both kinds of fault happened under load, and passes ran through them
    faults = [f["what"] for f in phases["faults"]["faults"]]
    assert any("SIGKILL compactor" in f for f in faults)
    assert any("restarted redis" in f for f in faults)
    assert phases["faults"]["metrics"]["passes_total"] > phases["load"]["metrics"]["passes_total"]
    assert report["replay"] and all(r["equal"] for r in report["replay"])
    assert 0 <= report["evicted_off_schedule"] < report["replay_candidates"]
    assert (tmp_path / "soak.png").stat().st_size > 0


def _soak_module():
    sys.path.insert(0, str(BENCHES))
    import soak

    return soak


def _phase(name: str, **overrides) -> dict:
    replica = {"replica": 0, "alive": True, "idle_check_ran": True, "tracked_requests": 0,
               "leak_in_log": False, "traceback_in_log": False}  # fmt: skip
    phase = {"name": name, "completed": 5, "5xx": [], "unexpected_4xx": [], "never_ended": 0,
             "client_errors": [], "idle": {"replicas": [replica], "rss_mib": 100.0}}  # fmt: skip
    phase.update(overrides)
    return phase


def test_every_broken_invariant_is_a_violation_and_a_clean_run_has_none():
    soak = _soak_module()
    settings = soak.Settings(max_rss_growth=0.05)
    clean = {"phases": [_phase("warm-up"), _phase("load")], "replay": [{"equal": True}],
             "rss_growth_after_warmup": 0.01}  # fmt: skip
    assert soak.violations(clean, settings) == []
    leaked = dict(_phase("load")["idle"]["replicas"][0], tracked_requests=2)
    broken = {
        "phases": [
            _phase("warm-up", **{"5xx": ["500 /generate: boom"]}),
            _phase("load", never_ended=1, idle={"replicas": [leaked], "rss_mib": 1.0}),
            _phase("faults", unexpected_4xx=["400 /generate: accepted scorer"]),
        ],
        "replay": [{"equal": False}],
        "rss_growth_after_warmup": 0.2,
    }
    found = "\n".join(soak.violations(broken, settings))
    for words in ("5xx", "never ended", "not idle and clean", "unexpected 4xx",
                  "other tokens", "RSS grew"):  # fmt: skip
        assert words in found
    # A replica killed behind the router: its requests' errors are what clients see.
    killed = {"phases": [_phase("faults", **{"5xx": ["502 /v1/completions"]},
                                client_errors=["ClientPayloadError"])],
              "replay": [], "rss_growth_after_warmup": 0.0}  # fmt: skip
    assert soak.violations(killed, soak.Settings(replicas=2, kill_replica=True)) == []
    assert soak.violations(killed, soak.Settings())  # not without the kill


def test_requests_a_fault_moved_are_not_replayed():
    """A request whose report shows a failed pass or a retraction evicted at other steps
    than it would alone: its tokens may differ by design, so it is not replayed."""
    sys.path.insert(0, str(BENCHES))
    from soak_stack import evicted_off_schedule

    report = {"passes": 3, "passes_failed": 0, "retractions": 0}
    assert not evicted_off_schedule({"report": report})
    assert evicted_off_schedule({"report": {**report, "passes_failed": 1}})
    assert evicted_off_schedule({"report": {**report, "retractions": 1}})
    assert not evicted_off_schedule({"report": None})  # eviction off: nothing to move


def test_a_tier_left_holding_tokens_at_an_idle_point_is_a_violation():
    soak = _soak_module()
    held = dict(_phase("load")["idle"]["replicas"][0], tier_tokens_held=32)
    result = {"phases": [_phase("warm-up"), _phase("load", idle={"replicas": [held],
              "rss_mib": 100.0})], "replay": [{"equal": True}],
              "rss_growth_after_warmup": 0.0}  # fmt: skip
    assert "not idle and clean" in "\n".join(soak.violations(result, soak.Settings()))
    # A soak of the tier in which no pass quantized anything did not soak the tier.
    clean = {"phases": [_phase("load", metrics={"tier_tokens_quantized_total": 0.0})],
             "replay": [{"equal": True}], "rss_growth_after_warmup": 0.0}  # fmt: skip
    assert soak.violations(clean, soak.Settings()) == []
    found = soak.violations(clean, soak.Settings(tier_bits=3))
    assert found == ["the tier is on, but no pass quantized a token into it"]
    clean["phases"][0]["metrics"]["tier_tokens_quantized_total"] = 64.0
    assert soak.violations(clean, soak.Settings(tier_bits=3)) == []


def test_the_tier_soaks_policies_are_what_the_server_accepts_and_refuses():
    """The soak's per-request tiers are valid for its server, and the bad ones it sends
    are refused by the server's own rule, naming ``tier_tokens``."""
    from sglang_evict.config import EvictionConfig
    from sglang_evict.request_policy import (
        RequestLimits,
        RequestPolicyError,
        default_policy,
        resolve_request_policy,
    )

    sys.path.insert(0, str(BENCHES))
    import random

    from soak_load import BAD_TIER_POLICIES, Settings, random_policy

    s = Settings(tier_bits=3)
    config = EvictionConfig(
        kv_budget_tokens=s.budget_tokens,
        cadence_tokens=s.cadence_tokens,
        window_tokens=s.window_tokens,
        sink_tokens=4,
        tier_bits=s.tier_bits,
        tier_group_tokens=s.tier_group_tokens,
        tier_max_tokens=s.tier_tokens,
    )
    limits = RequestLimits.of(config, ("streaming", "knorm"))
    rng = random.Random(0)
    asked = set()
    for _ in range(300):
        policy = random_policy(rng, s)
        resolved = resolve_request_policy(default_policy(config), policy, limits)
        asked.add(policy.get("tier_tokens"))
        assert resolved.tier_tokens == policy.get("tier_tokens", s.tier_tokens)
    assert {None, 0, s.tier_tokens} <= asked  # the server's tier, none, and between
    for policy, field in BAD_TIER_POLICIES:
        with pytest.raises(RequestPolicyError, match=field):
            resolve_request_policy(default_policy(config), policy, limits)
    assert all("tier_tokens" not in random_policy(rng, Settings()) for _ in range(100))
