"""A soak at the server's front door: ``sglang-evict serve`` (SGLang's real engine on
CPU) driven over HTTP for ``--minutes`` by an asyncio load generator, the way clients
use a server for hours, with what a leak or a corruption would show checked at every
idle point.

    python3 benches/soak.py                         # 10 min, the tiny model, no faults
    python3 benches/soak.py --model smollm2 --minutes 60 --faults
    python3 benches/soak.py --replicas 2 --kill-replica --minutes 10   # behind the router
    python3 benches/soak.py --short                 # CI's form: 2 min, tiny, faults on
    python3 benches/soak.py --kv-tier-bits 3 --faults   # the tier, the sidecar demoting

The load: ``/generate`` (streamed and not), ``/v1/completions`` and
``/v1/chat/completions`` streamed, at a concurrency above what the pool holds
un-evicted; shared system prompts, multi-turn chats (each turn the previous turn's
messages and answer plus a question), long and short generations; a random per-request
policy within the server's limits (budget, cadence, scorer); a share of streams
cancelled by the client mid-generation; a share of malformed or out-of-range
``custom_params.sglang_evict`` (a 400 naming the field is the expected answer). With
``--faults``: passes go to a supervised compactor sidecar (``--kv-compactor grpc``),
whose server is SIGKILLed at random intervals, and leases live in Redis
(``--kv-lease-store redis``), restarted at random intervals. With ``--kv-tier-bits``
the server runs the quantized tier (the tiny model's head-dim-64 variant), requests ask
for tiers of their own, some too large or not whole groups (a 400 naming
``tier_tokens``), every idle point also finds the tier empty, and the sidecar demotes
into the tier's arena under the same SIGKILLs. With ``--replicas 2``
requests go through ``sglang-evict router``; ``--kill-replica`` SIGKILLs one replica
halfway (then every request must complete or fail with an error its client sees).

Phases: warm-up, load, faults (load continues; faults only with ``--faults``), each
followed by a drain (no new requests; every one in flight ends or hits its deadline)
and an idle check (SGLang's idle memory check ran and passed, the plugin tracks no
request, RSS). Then a sample of completed greedy requests is replayed one at a time
with the same policy (``--replay``): each must give the same tokens. The sample is drawn
from the requests whose eviction report shows no failed pass and no retraction: a
fault that moves a request's passes (the lease store down: it keeps its KV and evicts
later) changes its tokens by design; how many it moved is recorded.

Recorded per phase: requests completed, 4xx by cause (only the expected ones), 5xx,
requests that never ended (a deadline per request), client-side errors, TTFT and
inter-token latency p50/p99, passes and failed passes by cause (``/metrics``), and a
series over time (running requests, KV tokens held, RSS, passes) -> ``soak.json`` and
``soak.png`` in ``--out``. The exit status is 0 only when every invariant holds; each
violation is printed. Every process started is stopped by its PID; traffic stays on
loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # soak_load, soak_stack

from soak_load import Load, Phase, Settings
from soak_stack import (
    Monitor,
    Stack,
    evicted_off_schedule,
    failures_by_cause,
    faults,
    idle_check,
    kill_replica,
    metric_samples,
    metric_sum,
    replay,
)

# --- the run -----------------------------------------------------------------------------------


def violations(result: dict, s: Settings) -> list[str]:
    """Every invariant the soak promises, broken (empty: all hold)."""
    bad = []
    for phase in result["phases"]:
        name = phase["name"]
        # A replica killed behind the router: its requests may fail, with an error the
        # client sees (a 5xx or a broken stream); none may hang.
        killed = s.kill_replica and name == "faults"
        if phase["5xx"] and not killed:
            bad.append(f"{name}: {len(phase['5xx'])} responses 5xx, e.g. {phase['5xx'][0]}")
        if phase["unexpected_4xx"]:
            bad.append(f"{name}: unexpected 4xx, e.g. {phase['unexpected_4xx'][0]}")
        if phase["never_ended"]:
            bad.append(f"{name}: {phase['never_ended']} requests never ended")
        errors = phase["client_errors"]
        if errors and not killed:
            bad.append(f"{name}: {len(errors)} client errors, e.g. {errors[0]}")
        for replica in phase["idle"].get("replicas", []):
            if not replica["alive"]:
                if not s.kill_replica:
                    bad.append(f"{name}: replica {replica['replica']} died")
                continue
            if (
                not replica["idle_check_ran"]
                or replica["tracked_requests"]
                or replica.get("tier_tokens_held")
            ):
                bad.append(f"{name}: replica {replica['replica']} not idle and clean: {replica}")
            if replica["leak_in_log"] or replica["traceback_in_log"]:
                bad.append(f"{name}: replica {replica['replica']}'s log holds a leak or traceback")
    if not any(p["completed"] for p in result["phases"]):
        bad.append("no request completed")
    quantized = [
        p.get("metrics", {}).get("tier_tokens_quantized_total", 0) for p in result["phases"]
    ]
    if s.tier_bits is not None and not any(quantized):
        bad.append("the tier is on, but no pass quantized a token into it")
    growth = result.get("rss_growth_after_warmup")
    if s.max_rss_growth is not None and growth is not None and growth > s.max_rss_growth:
        bad.append(f"server RSS grew {growth:.1%} after warm-up (at most {s.max_rss_growth:.0%})")
    for item in result["replay"]:
        if not item["equal"]:
            bad.append(f"a replayed greedy request gave other tokens: {item}")
    return bad


async def soak(s: Settings, stack: Stack, url: str) -> dict:
    rng = random.Random(s.seed)
    load = Load(url, s, rng)
    monitor = Monitor(stack)
    stop_monitor = asyncio.Event()
    watcher = asyncio.create_task(monitor.run(stop_monitor))
    marks: dict = {}
    idle_check(stack, marks, timeout_s=30)  # where each replica's counters stand
    phases = []
    for name, seconds in s.phase_s.items():
        phase = Phase(name, started_s=monitor.elapsed())
        load.phase = phase
        stop = asyncio.Event()
        side = []
        if name == "faults" and s.faults:
            side.append(asyncio.create_task(faults(stack, s, rng, stop, phase, monitor.t0)))
        if name == "faults" and s.kill_replica:
            side.append(asyncio.create_task(kill_replica(stack, seconds / 2, phase, monitor)))
        concurrency = max(2, s.concurrency // 4) if name == "warm-up" else s.concurrency
        print(f"soak: {name} for {seconds:.0f} s at concurrency {concurrency}", flush=True)
        await load.run_for(seconds, concurrency)
        stop.set()
        await asyncio.gather(*side)
        phase.idle = await asyncio.to_thread(idle_check, stack, marks)
        live = [r for r in stack.replicas if r.alive]
        samples = [metric_samples(r.url) for r in live]
        phase.metrics = {
            "passes_total": sum(metric_sum(m, "sglang_evict:passes_total") for m in samples),
            "pass_failures_by_cause": [failures_by_cause(m) for m in samples],
            "pass_forced_completions_total": sum(
                metric_sum(m, "sglang_evict:pass_forced_completions_total") for m in samples
            ),
            "compactor_fallbacks_total": sum(
                metric_sum(m, "sglang_evict:compactor_fallbacks_total") for m in samples
            ),
            # the tier's: tokens quantized into it and given up beyond it (0 without)
            "tier_tokens_quantized_total": sum(
                metric_sum(m, "sglang_evict:tier_tokens_quantized_total") for m in samples
            ),
            "tier_tokens_dropped_total": sum(
                metric_sum(m, "sglang_evict:tier_tokens_dropped_total") for m in samples
            ),
        }
        phases.append(phase.summary())
        print(
            f"soak: {name}: {phase.completed} completed, {sum(phase.expected_4xx.values())} "
            f"expected 400s, {len(phase.status_5xx)} 5xx, {phase.never_ended} never ended; "
            f"idle RSS {phase.idle['rss_mib']} MiB",
            flush=True,
        )
    stop_monitor.set()
    await watcher
    live = next(r for r in stack.replicas if r.alive)
    done = list(load.greedy_done)
    replayed = await asyncio.to_thread(
        replay, live.url if s.replicas == 1 else url, done, s.replay_samples, rng
    )
    return {
        "settings": asdict(s),
        "phases": phases,
        "series": monitor.series,
        "replay": replayed,
        "replay_candidates": len(done),
        "evicted_off_schedule": sum(evicted_off_schedule(item) for item in done),
    }


def plot(result: dict, path: Path) -> bool:
    from sglang_evict.plotting import pyplot_or_none, save_figure

    plt = pyplot_or_none()
    points = [p for p in result["series"] if "error" not in p]
    if plt is None or not points:
        return False
    figure, axes = plt.subplots(4, 1, figsize=(9, 9), sharex=True)
    t = [p["t_s"] for p in points]
    for axis, key, label in zip(
        axes,
        ("running", "kv_tokens", "rss_mib", "passes"),
        ("running requests", "KV tokens held", "server RSS (MiB)", "passes (cumulative)"),
        strict=True,
    ):
        axis.plot(t, [p[key] for p in points])
        axis.set_ylabel(label, fontsize=8)
        for phase in result["phases"]:
            axis.axvline(phase.get("started_s", 0), color="0.8", linestyle=":")
            for fault in phase["faults"]:
                axis.axvline(fault["t_s"], color="tab:red", alpha=0.3)
    axes[-1].set_xlabel("seconds (dotted: phase starts; red: faults)")
    s = result["settings"]
    figure.suptitle(
        f"soak: {s['model']} model, {s['minutes']} min, faults "
        f"{'on' if s['faults'] else 'off'}, {s['replicas']} replica(s)"
        + (f", tier {s['tier_bits']} bits" if s.get("tier_bits") else "")
    )
    save_figure(plt, figure, path)
    return True


def parse(argv) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=None)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--replicas", type=int, choices=(1, 2), default=1)
    parser.add_argument("--faults", action="store_true", help="SIGKILL the sidecar, restart Redis")
    parser.add_argument("--kill-replica", action="store_true", help="(2 replicas) SIGKILL one")
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--replay", type=int, default=6, metavar="N",
        help="completed greedy requests run again alone at the end (default 6)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-tier-bits", type=int, choices=(2, 3, 4, 8), default=None,
        help="the quantized tier on (with --faults the sidecar demotes, under SIGKILLs)",
    )  # fmt: skip
    parser.add_argument("--short", action="store_true", help="CI's form: 2 min, tiny, faults")
    parser.add_argument("--out", default="soak-out", help="folder for soak.json and soak.png")
    parser.add_argument(
        "--max-rss-growth", type=float, default=None, help="e.g. 0.05: a violation above it"
    )
    args = parser.parse_args(argv)
    if args.kill_replica and args.replicas != 2:
        parser.error("--kill-replica needs --replicas 2")
    if args.concurrency < 1 or (args.minutes is not None and args.minutes <= 0):
        parser.error("--concurrency and --minutes must be positive")
    if args.replay < 1:
        parser.error(f"--replay {args.replay}: replay at least one request")
    s = Settings(
        model=args.model,
        replicas=args.replicas,
        faults=args.faults or args.short,
        kill_replica=args.kill_replica,
        concurrency=args.concurrency,
        seed=args.seed,
        out=args.out,
        max_rss_growth=args.max_rss_growth,
        replay_samples=args.replay,
        tier_bits=args.kv_tier_bits,
    )
    if args.short:
        s.minutes, s.fault_interval_s, s.deadline_s = 2.0, (8.0, 15.0), 120.0
    if args.minutes is not None:
        s.minutes = args.minutes
    return s


def main(argv=None) -> int:
    s = parse(argv)
    if s.faults and shutil.which("redis-server") is None:
        print("soak: --faults needs redis-server (apt-get install redis-server)", file=sys.stderr)
        return 2
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="soak-", dir=out))
    stack = Stack(s, workdir)
    started = time.monotonic()
    try:
        url = stack.start()
        print(f"soak: serving at {url} (logs in {workdir})", flush=True)
        result = asyncio.run(soak(s, stack, url))
    finally:
        stack.close()
    result["wall_s"] = round(time.monotonic() - started, 1)
    idle_rss = [p["idle"]["rss_mib"] for p in result["phases"]]
    result["rss_growth_after_warmup"] = round(idle_rss[-1] / idle_rss[0] - 1, 4)
    result["violations"] = violations(result, s)
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    drawn = plot(result, out / "soak.png")
    print(
        f"soak: idle RSS per phase {idle_rss} MiB (after warm-up "
        f"{result['rss_growth_after_warmup']:+.1%}); replayed {len(result['replay'])} greedy "
        f"requests, {sum(r['equal'] for r in result['replay'])} equal (drawn from the "
        f"{result['replay_candidates'] - result['evicted_off_schedule']} of "
        f"{result['replay_candidates']} completed whose passes no fault moved)"
    )
    print(f"soak: wrote {out / 'soak.json'}" + (f" and {out / 'soak.png'}" if drawn else ""))
    for line in result["violations"]:
        print(f"soak: VIOLATION: {line}")
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
