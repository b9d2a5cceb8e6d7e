"""The committed gRPC code is what the pinned grpcio-tools generates from protos/."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gen_protos.py"


def check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--check", "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_committed_generated_code_matches_the_protos():
    result = check(ROOT)
    assert result.returncode == 0, result.stderr


def test_the_drift_check_catches_an_edited_proto(tmp_path):
    shutil.copytree(ROOT / "protos", tmp_path / "protos")
    shutil.copytree(ROOT / "compactor_service" / "v1", tmp_path / "compactor_service" / "v1")
    proto = tmp_path / "protos" / "compactor_service" / "v1" / "compactor.proto"
    proto.write_text(
        proto.read_text().replace(
            "message StatsRequest {}", "message StatsRequest {\n  bool verbose = 1;\n}"
        )
    )
    result = check(tmp_path)
    assert result.returncode == 1
    assert "out of date" in result.stderr and "compactor_pb2.py" in result.stderr
