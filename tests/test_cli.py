"""The sglang-evict console script, run as a user runs it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from sglang_evict.cli.main import main


def test_console_script_help_runs():
    exe = shutil.which("sglang-evict")
    command = [exe, "--help"] if exe else [sys.executable, "-m", "sglang_evict.cli.main", "--help"]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    assert "simulate" in result.stdout


def test_simulate_shows_compaction_freeing_what_eviction_alone_cannot(capsys):
    assert (
        main(["simulate", "--tokens", "1600", "--kv-budget", "160", "--kv-window", "16", "--json"])
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["pages_before"] == 100 and result["survivors"] == 160
    assert result["pages_freed_without_compaction"] < 90
    for strategy in ("repack", "hole_fill"):
        assert result["strategies"][strategy]["pages_freed"] == 90


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--kv-budget", "10"], "must exceed"),
        (["simulate", "--kv-budget", "500", "--kv-scorer", "knrom"], "unknown scorer"),
        (
            [
                "simulate",
                "--kv-budget",
                "500",
                "--kv-scorer",
                "triattention",
                "--kv-scorer-stats",
                "/nonexistent.safetensors",
            ],
            "does not exist",
        ),
    ],
)
def test_bad_flags_exit_2_with_a_message(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.engine
@pytest.mark.engine_group("demo")  # its own two engines: beside the shared ones
def test_demo_runs_sglangs_engine_with_and_without_eviction_and_plots_kv_held(capsys, tmp_path):
    """The README's main job, shortened: two real engines side by side. The evicting
    engine's passes go to a real compactor sidecar (``--kv-compactor grpc``; in-process
    compaction is what every other engine test runs), and the demo says how many the
    sidecar did: as many ``Compact`` calls as the sidecar itself counted."""
    from compactor_service.v1 import compactor_pb2
    from tests.compactor_process import CompactorProcess, call

    plot = tmp_path / "kv.png"
    pool_dir = tmp_path / "pools"
    sidecar = CompactorProcess(tmp_path / "compactor", pool_dir=str(pool_dir)).start()
    argv = [
        "demo",
        *("--model", "tiny"),  # the random-weight model: fast (the default is SmolLM2)
        "--requests",
        "2",
        "--prompt-tokens",
        "24",
        "--new-tokens",
        "160",
        "--page-size",
        "1",  # page sizes > 1 run in the other engine tests (Triton's interpreter: slow)
        "--kv-budget",
        "64",
        "--kv-cadence",
        "32",
        "--kv-window",
        "16",
        "--plot",
        str(plot),
        "--log-dir",
        str(tmp_path),
        *("--kv-compactor", "grpc", "--kv-compactor-socket", str(sidecar.socket)),
        *("--kv-compactor-pool-dir", str(pool_dir)),
    ]
    try:
        assert main(argv) == 0
        _, _, stats = call(sidecar.target, "Stats", compactor_pb2.StatsRequest())
    finally:
        sidecar.stop()
    out = capsys.readouterr().out
    served = compactor_pb2.StatsResponse.FromString(stats).passes
    line = re.search(
        r"^compactor: (\d+) passes by the sidecar, (\d+) completed in-process$", out, re.M
    )
    assert line is not None, out
    assert int(line.group(1)) == served >= 2 and int(line.group(2)) == 0
    passes = int(out.split("passes ")[1].split(",")[0])
    assert passes >= 2 * 2  # budget 64 + cadence 32: passes at 96 and 128 tokens per request
    held = int(re.search(r"^ +with eviction +(\d+)", out, re.M).group(1))
    full = int(re.search(r"^ +without \(plain SGLang\) +(\d+)", out, re.M).group(1))
    assert held < full
    # Each engine's log is SGLang's own; the numbers come from its #token lines: one per
    # decode step, and the first of the 160 tokens comes out of the prefill.
    assert (tmp_path / "demo-evicting.log").read_text().count("Decode batch") >= 159
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.engine
@pytest.mark.engine_group("demo")  # its own three engines
def test_demo_runs_the_tier_beside_eviction_and_plain_sglang(capsys, tmp_path):
    """``demo --kv-tier-bits 3``: a third real engine with the quantized tier; its
    passes demote rather than only evict, it holds fewer full-precision tokens than
    plain SGLang, and every engine's KV bytes per request are printed."""
    argv = [
        "demo",
        *("--model", "tiny"),
        *("--requests", "2", "--prompt-tokens", "24", "--new-tokens", "128"),
        *("--page-size", "1", "--kv-budget", "32", "--kv-cadence", "32", "--kv-window", "16"),
        *("--kv-tier-bits", "3", "--kv-tier-group", "16"),
        *("--plot", str(tmp_path / "kv.png"), "--log-dir", str(tmp_path)),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "with eviction, with the quantized tier and without" in out
    tier_passes = re.search(r"^with the tier: passes (\d+), tokens evicted (\d+)", out, re.M)
    assert tier_passes is not None and int(tier_passes.group(1)) >= 2, out
    held = {
        name: int(re.search(rf"^ +{name} +(\d+)", out, re.M).group(1))
        for name in ("with eviction", "with the tier", r"without \(plain SGLang\)")
    }
    assert held["with the tier"] < held[r"without \(plain SGLang\)"]
    fractions = re.search(
        r"^peak KV bytes per request .*: with eviction ([\d.]+), with the tier ([\d.]+)$",
        out,
        re.M,
    )
    assert fractions is not None, out
    assert 0 < float(fractions.group(1)) < 1 and 0 < float(fractions.group(2)) < 1
    assert (tmp_path / "demo-tier.log").read_text().count("Decode batch") >= 127


def test_serve_checks_eviction_flags_before_loading_sglang(capsys):
    assert main(["serve", "--kv-budget", "5", "--model-path", "dummy"]) == 2
    assert "kv_budget_tokens=5" in capsys.readouterr().err


def test_other_commands_reject_unknown_flags():
    with pytest.raises(SystemExit):
        main(["simulate", "--kv-budget", "500", "--bogus"])
