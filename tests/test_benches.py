"""Benchmark scripts: what can be checked without a GPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parents[1] / "benches"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_script_reads_step_times_off_sglangs_decode_log_lines():
    bench = load("engine_eviction")
    # The format of SGLang 0.5.17's metrics_reporter decode line (#token = KV in use;
    # gen throughput: tokens generated since the last line over the time since it).
    log = "\n".join(
        f"[2026-11-22 10:00:0{i}] Decode batch, #running-req: {r}, #token: {t}, "
        f"token usage: 0.01, cuda graph: True, gen throughput (token/s): {g}, #queue-req: 0"
        for i, (r, t, g) in enumerate(
            [(4, 1200, 2000.0), (4, 1650, 1000.0), (3, 1500, 3000.0), (0, 0, 0.0)]
        )
    )
    assert bench.decode_step_ms(log, batch=4) == [2.0, 4.0]  # only full-batch steps
    assert bench.decode_step_ms(log, batch=3) == [1.0]
    assert bench.peak_tokens(log) == 1650


def test_engine_script_modes_compare_pass_groups_in_one_run(capsys):
    bench = load("engine_eviction")
    assert bench.parse_modes("plain,off,on,on:1,on:32") == ["plain", "off", "on", "on:1", "on:32"]
    args = bench.argparse.Namespace(
        pass_group_steps=4, budget=512, cadence=64, scorer="knorm", compaction="hole_fill",
        window=32, paired=True, tier_bits=3, tier_group=32, tier_tokens=256,
    )  # fmt: skip
    assert [bench.group_steps(args, m) for m in ("on", "on:1", "on:32", "off")] == [4, 1, 32, 4]
    assert bench.policy_for(args, "plain") is None
    assert bench.policy_for(args, "on:32")["pass_group_steps"] == 32
    assert bench.policy_for(args, "on:32")["kv_budget_tokens"] == 512
    assert bench.policy_for(args, "off")["kv_budget_tokens"] > 1 << 20
    # --paired: the evicting servers let a request turn eviction off for itself
    assert bench.policy_for(args, "on:32")["request_allow_disable"] is True
    assert bench.policy_for(args, "off")["request_allow_disable"] is False
    # +tier: the same eviction with the quantized tier on
    assert bench.parse_modes("on,on+tier") == ["on", "on+tier"]
    assert bench.parse_modes("on+tier,on+tier-tensor") == ["on+tier", "on+tier-tensor"]
    tier = bench.policy_for(args, "on+tier")
    assert (tier["tier_bits"], tier["tier_group_tokens"], tier["tier_max_tokens"]) == (3, 32, 256)
    assert "tier_bits" not in bench.policy_for(args, "on")
    for bad in ("on:0", "on:x", "off:2", "evict", "on,on", "", "off+tier", "on+tier+graph"):
        with pytest.raises(ValueError, match="--modes"):
            bench.parse_modes(bad)
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--model", "/nonexistent", "--modes", bad])
        assert exit_.value.code == 2 and "--modes" in capsys.readouterr().err


def test_engine_script_help_runs_without_a_gpu():
    result = subprocess.run(
        [sys.executable, str(BENCHES / "engine_eviction.py"), "--help"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and "--page-size" in result.stdout


def smoke_table(script: str, *extra: str) -> tuple[str, str]:
    """The header and the one row a kernel bench's ``--smoke`` run prints last."""
    result = subprocess.run(
        [sys.executable, str(BENCHES / script), "--smoke", *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    header, row = result.stdout.strip().splitlines()[-2:]
    return header, row


def test_repack_bench_runs_its_smoke_configuration_on_cpu():
    header, row = smoke_table("bench_repack.py")
    assert "tri/copy" in header and "launch/copy" in header and len(row.split()) == 10


def test_tier_bench_runs_its_smoke_configuration_on_cpu():
    """``bench_tier.py --smoke``: both tier kernels, the attention's launch variants and
    the copy on one tiny configuration (Triton's interpreter); one row with every ratio."""
    variants = load("bench_tier").VARIANTS
    header, row = smoke_table("bench_tier.py")
    assert "attn/copy" in header and len(row.split()) == 9 + len(variants)


TIER_CPU_PARTS = {  # part: (words of its header, its row's leading cells, cells in all)
    "attention": (("kernel/SDPA", "tensor/kernel"), ["smollm2", "3", "2", "64", "1"], 10),
    "merge": (("split/fused", "tensor/fused"), ["smollm2", "3", "2", "64", "16", "1"], 11),
    "quantize": (("reference/kernel",), ["smollm2", "1", "1"], 6),
}


@pytest.mark.parametrize("part", sorted(TIER_CPU_PARTS))
def test_tier_cpu_bench_runs_its_smoke_configuration(part):
    """``bench_tier_cpu.py --smoke --part P``: each part's compiled kernel beside what it
    replaces on one small configuration; one row with its ratios."""
    from sglang_evict_kernels.tier_cpu import cpu_kernel_status

    if not cpu_kernel_status()[0]:
        pytest.skip(f"the tier's CPU kernel: {cpu_kernel_status()[1]}")
    header, row = smoke_table("bench_tier_cpu.py", "--part", part)
    words, lead, width = TIER_CPU_PARTS[part]
    assert all(word in header for word in words), header
    cells = row.split()
    assert cells[: len(lead)] == lead and len(cells) == width, row
    assert all(float(c) > 0 for c in cells[len(lead) :]), row


@pytest.mark.parametrize("strategy", ["hole_fill", "repack"])
def test_pass_bench_dispatches_as_many_operations_whatever_the_budget_and_due_requests(strategy):
    """``bench_pass.py``'s ``ops/pass`` column: the tensor operations one batched pass
    dispatches (on a GPU, the host's whole share of it) do not grow with the budget or
    the number of due requests."""
    result = subprocess.run(
        [
            sys.executable,
            str(BENCHES / "bench_pass.py"),
            *("--budgets", "256", "1024", "--due", "1", "5", "--cadence", "32"),
            *("--repeats", "1", "--old-requests", "1", "--strategy", strategy),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert "ops/pass" in lines[1]
    rows = [line.split() for line in lines[2:6]]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(256, 1), (256, 5), (1024, 1), (1024, 5)]
    assert len({int(r[5]) for r in rows}) == 1, lines
    # The second table: a replayed pass (capture emulated on CPU) dispatches at most 10
    # operations outside its replay, whatever the budget and the due requests.
    header = next(i for i, line in enumerate(lines) if "ops outside" in line)
    replayed = [line.split() for line in lines[header + 1 : header + 5]]
    assert [(int(r[0]), int(r[1])) for r in replayed] == [(256, 1), (256, 5), (1024, 1), (1024, 5)]
    assert all(0 < float(r[5]) <= float(r[3]) for r in replayed), lines  # outside <= whole
    assert all(float(r[6]) > 0 for r in replayed), lines  # the shape's pool growth
    outside = {int(r[-1]) for r in replayed}
    assert len(outside) == 1 and outside.pop() <= 10, lines


def test_step_hooks_bench_times_the_hooks_of_a_step_with_and_without_passes():
    """``bench_step_hooks.py --smoke``: the budget-off row and one row per due count,
    each step's host time at least its share outside the device body, at least the
    pass's own share; no pass where nothing is due."""
    result = subprocess.run(
        [sys.executable, str(BENCHES / "bench_step_hooks.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["mode", "due"])
    rows = [line.rsplit(maxsplit=4) for line in lines[header + 1 :]]
    assert [(r[0], int(r[1])) for r in rows] == [
        ("budget off", 0),
        ("evicting", 0),
        ("evicting", 2),
    ], lines
    for _, due, step_ms, outside_ms, pass_ms in rows:
        assert float(step_ms) >= float(outside_ms) >= float(pass_ms) >= 0, lines
        assert (float(pass_ms) > 0) == (int(due) > 0), lines


def test_scoring_bench_runs_its_smoke_configuration_on_cpu():
    result = subprocess.run(
        [sys.executable, str(BENCHES / "bench_scoring.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    header, row = result.stdout.strip().splitlines()[-2:]
    assert "triattention x" in header and len(row.split()) == 5


@pytest.mark.parametrize("extra", [[], ["--tier-bits", "3"]], ids=["moves", "demotions"])
def test_compactor_bench_runs_its_smoke_configuration_on_cpu(extra):
    """Starts a real compactor process and times both compactors on the same plans
    (with ``--tier-bits``, demotion passes into a tier arena shared with it)."""
    result = subprocess.run(
        [sys.executable, str(BENCHES / "bench_compactor.py"), "--smoke", *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines[-3:]] == ["in-process", "sidecar", "added"]
    assert ("groups of 16 demoted at 3 bits" in result.stdout) == bool(extra)


@pytest.mark.engine
@pytest.mark.engine_group("bench")  # its own four engines, one after another
def test_memory_bound_bench_runs_in_the_real_engine(tmp_path):
    """``bench_memory_bound.py``, shortened: four real engines (plain, eviction under
    SGLang's and bounded admission, the tier) over one pool and workload at the same
    per-request KV bytes; its JSON and plot are written and hold what the README table
    reads."""
    result = subprocess.run(
        [
            sys.executable,
            str(BENCHES / "bench_memory_bound.py"),
            "--requests", "8",
            "--new-tokens", "96",
            "--pool-requests", "2",
            "--check-alone", "1",
            "--kv-fraction", "0.5",
            "--json", str(tmp_path / "mb.json"),
            "--plot", str(tmp_path / "mb.png"),
            "--log-dir", str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "mb.json").read_text())
    runs = report["runs"]
    assert set(runs) == {"plain", "evict", "bounded", "tier"}
    assert all(run["completed"] == 8 and run["idle_check_ok"] for run in runs.values())
    assert runs["tier"]["retractions"] == 0 and runs["tier"]["tier_groups"] > 0
    assert runs["tier"]["tier_pool_tokens_after"] < report["pool_tokens"]  # the same pool
    assert runs["tier"]["kv_fraction"] <= 0.5 and runs["bounded"]["kv_fraction"] <= 0.5
    assert report["same_tokens"] and runs["bounded"]["same_alone"]
    assert runs["bounded"]["retractions"] == 0
    assert runs["bounded"]["peak_running"] > runs["evict"]["peak_running"]
    assert (tmp_path / "mb.png").stat().st_size > 0
    assert "bounded / plain: mean running" in result.stdout
    assert "tier / plain: mean running" in result.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--runs", "plain,fast"], "--runs plain,fast"),
        (["--runs", "tier,tier"], "--runs tier,tier"),
        (["--kv-fraction", "1.5"], "--kv-fraction 1.5"),
        (["--needles", "4"], "--needles: the needle task needs the real model"),
    ],
)
def test_memory_bound_bench_refuses_bad_flags_by_name(flags, message):
    result = subprocess.run(
        [sys.executable, str(BENCHES / "bench_memory_bound.py"), *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]


def _memory_bound_plans(monkeypatch, *argv):
    monkeypatch.syspath_prepend(str(BENCHES))  # the bench imports its sibling module
    bench = load("bench_memory_bound")
    setup = load("memory_bound_setup")
    from sglang_evict.quality.real.frontier import Shape

    args = bench.parse_args(list(argv))
    return setup.plan_runs(args, Shape(30, 3, 64), args.runs), args


@pytest.mark.parametrize("fraction", [0.125, 0.25, 0.5])
def test_memory_bound_plans_hold_eviction_and_the_tier_to_the_same_bytes(monkeypatch, fraction):
    """Both plans spend at most ``--kv-fraction`` of a full-length request's bytes (bf16
    accounting), and nearly all of it; the tier holds whole groups and its arena takes a
    share of the pool between 0 and 1."""
    plans, args = _memory_bound_plans(
        monkeypatch, "--model", "smollm2", "--kv-fraction", str(fraction)
    )
    length = args.prompt_tokens + args.new_tokens
    assert plans["plain"].config is None and plans["plain"].kv_fraction == 1.0
    for name in ("evict", "bounded", "tier"):
        assert 0.8 * fraction <= plans[name].kv_fraction <= fraction + 1e-9, name
    tier = plans["tier"]
    g = tier.config.tier_group_tokens
    assert tier.tier_tokens % g == 0 and tier.budget_tokens + tier.tier_tokens <= length
    assert 0 < tier.config.tier_pool_share < 1
    assert plans["bounded"].config.admission == "bounded"
    assert plans["evict"].config.admission == "sglang"


def test_memory_bound_ample_run_is_plain_sglang_on_a_whole_pool_asked_for_by_name(monkeypatch):
    plans, args = _memory_bound_plans(monkeypatch, "--model", "smollm2")
    assert "ample" not in args.runs and list(plans) == ["plain", "evict", "bounded", "tier"]
    plans, args = _memory_bound_plans(monkeypatch, "--runs", "tier,ample,plain")
    assert list(plans) == ["plain", "ample", "tier"]  # the bench's order, not the flag's
    assert plans["ample"].config is None and plans["ample"].whole_pool
    assert not plans["plain"].whole_pool and not plans["tier"].whole_pool


def test_memory_bound_plans_refuse_bytes_that_hold_no_tier_naming_the_flag(monkeypatch):
    with pytest.raises(SystemExit, match="--kv-fraction"):
        _memory_bound_plans(monkeypatch, "--new-tokens", "96", "--kv-fraction", "0.25")


def test_pass_memory_bench_runs_its_smoke_configuration_on_cpu():
    """``bench_pass_memory.py --smoke``: one pass per scorer, each in its own process,
    prints what it added to the peak resident size; a scorer that needs a query ring is
    refused by name."""
    script = str(BENCHES / "bench_pass_memory.py")
    result = subprocess.run(
        [sys.executable, script, "--smoke"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["knorm", "streaming", "random"]
    assert all(float(row[1]) >= 0 and row[2].endswith("x") for row in rows)
    refused = subprocess.run(
        [sys.executable, script, "--smoke", "--scorers", "window"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "invalid choice: 'window'" in refused.stderr


@pytest.mark.engine
@pytest.mark.engine_group("bench")
def test_engine_step_time_bench_runs_its_smoke_configuration_in_the_cpu_engine(tmp_path):
    """``engine_eviction.py --smoke`` (SGLang's CPU engine, the project's model; the GPU
    run is the real one): passes run, on every 4th decode step only (mode ``on:4``:
    ``--kv-pass-group-steps 4``), step times are read, the JSON is written; ``--paired``
    generates again in the same engine with eviction off per request: no pass there,
    and more KV held."""
    out = tmp_path / "ee.json"
    result = subprocess.run(
        [
            sys.executable,
            str(BENCHES / "engine_eviction.py"),
            "--smoke",
            "--modes", "on:4",
            "--paired",
            "--out", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    result = json.loads(out.read_text())["results"]["on:4"]
    assert result["pass_group_steps"] == 4
    summary = result["summary"]
    assert summary["steps"] > 0 and summary["step_ms_mean"] > 0
    assert summary["pass_steps"] > 0 and summary["pages_freed"] > 0
    assert summary["pass_host_ms_per_request"] > 0  # the pass lines carry duration_ms
    assert summary["passes_off_group"] == 0
    (off,) = result["paired_off_repeats"]
    assert off["steps"] > 0 and off["pass_steps"] == 0
    assert off["peak_tokens"] > summary["peak_tokens"]  # the evicting run held less KV
    assert summary["paired_step_ratio"] > 0


def test_router_bench_refuses_a_workload_without_follow_ups():
    """``bench_router.py`` (two replicas behind the router, per policy; its servers and
    router are ``tests/test_router.py``'s) parses its workload before starting anything."""
    result = subprocess.run(
        [sys.executable, str(BENCHES / "bench_router.py"), "--turns", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--turns must be >= 2: follow-up turns are what routing decides" in result.stderr
