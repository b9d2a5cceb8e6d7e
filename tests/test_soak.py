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
    assert (tmp_path / "soak.png").stat().st_size > 0
