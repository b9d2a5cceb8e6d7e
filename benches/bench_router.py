"""Evicting replicas behind SGLang's router: cache-aware routing against round-robin, on
the same workload, in one run.

Evicting replicas (``sglang-evict serve``, two by default) on this machine's CPU (the
project's small random-weight model: a routing and throughput figure, not a quality
one), and ``sglang-evict router`` in front of them, once per policy, with every
replica's radix cache flushed before each. The workload: conversations, each with a system prompt of
its own, several turns each (a turn's prompt is the previous turn's prompt, its answer
and a new question), conversations running side by side. Printed per policy: prompt
tokens SGLang found cached on follow-up turns (``meta_info.cached_tokens``), the share
of all prompt tokens cached, wall time and output tokens per second, and their ratios.

    python3 benches/bench_router.py [--conversations 8 --turns 4 --new-tokens 32]
    python3 benches/bench_router.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the test harness's server and router processes

POLICIES = ("cache_aware", "round_robin")
LEADS = ("Apples", "Bridges", "Comets", "Deserts", "Engines", "Forests", "Glaciers", "Harbors")


def system_prompt(topic: int, words: int) -> str:
    lead = LEADS[topic % len(LEADS)]
    return f"{lead} {topic}. " + " ".join(f"rule {topic}.{i} holds;" for i in range(words))


def conversation(url: str, topic: int, args) -> list[dict]:
    import requests

    text, turns = system_prompt(topic, args.system_words), []
    for turn in range(args.turns):
        text += f" Question {turn}: what follows?"
        body = {
            "text": text,
            "sampling_params": {
                "max_new_tokens": args.new_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        reply = requests.post(url + "/generate", json=body, timeout=900)
        reply.raise_for_status()
        reply = reply.json()
        meta = reply["meta_info"]
        turns.append(
            {
                "turn": turn,
                "prompt_tokens": meta["prompt_tokens"],
                "cached_tokens": meta.get("cached_tokens", 0),
                "completion_tokens": meta["completion_tokens"],
            }
        )
        text += reply["text"]
    return turns


def run_policy(policy: str, replicas, log_dir: Path, args) -> dict:
    from tests.router_harness import RouterProcess

    for replica in replicas:
        replica.get("/flush_cache")
    router = RouterProcess([r.url for r in replicas], log_dir / f"router-{policy}.log", policy)
    router.start()
    try:
        started = time.monotonic()
        with ThreadPoolExecutor(args.parallel) as pool:
            turns = list(
                pool.map(
                    lambda topic: conversation(router.url, topic, args), range(args.conversations)
                )
            )
        wall_s = time.monotonic() - started
    finally:
        router.stop()
    follow_ups = [t for conv in turns for t in conv if t["turn"] > 0]
    every = [t for conv in turns for t in conv]
    output = sum(t["completion_tokens"] for t in every)
    return {
        "policy": policy,
        "cached_per_follow_up": sum(t["cached_tokens"] for t in follow_ups) / len(follow_ups),
        "prompt_per_follow_up": sum(t["prompt_tokens"] for t in follow_ups) / len(follow_ups),
        "cached_share": sum(t["cached_tokens"] for t in every)
        / sum(t["prompt_tokens"] for t in every),
        "wall_s": wall_s,
        "output_tokens_per_s": output / wall_s,
        "turns": turns,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--system-words", type=int, default=40, help="system prompt length")
    parser.add_argument("--parallel", type=int, default=4, help="conversations at once")
    parser.add_argument("--replicas", type=int, default=2, help="evicting servers")
    parser.add_argument("--log-dir", default=".", help="where the servers' logs go")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if min(args.conversations, args.turns, args.new_tokens, args.parallel, args.replicas) < 1:
        parser.error(
            "--conversations, --turns, --new-tokens, --parallel and --replicas must be >= 1"
        )
    if args.turns < 2:
        parser.error("--turns must be >= 2: follow-up turns are what routing decides")

    from sglang_evict.models.engine_model import ensure_engine_model
    from tests.router_harness import start_replicas

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"starting {args.replicas} evicting replicas (sglang-evict serve, CPU) ...", flush=True)
    replicas = start_replicas(ensure_engine_model(), log_dir, args.replicas)
    try:
        results = [run_policy(policy, replicas, log_dir, args) for policy in POLICIES]
    finally:
        for replica in replicas:
            replica.stop()
    print(
        f"\n{args.conversations} conversations x {args.turns} turns, {args.new_tokens} new "
        f"tokens a turn, {args.parallel} at once, {args.replicas} replicas (SGLang's CPU "
        "engine, small random-weight model; each replica's pool 4,096 tokens)"
    )
    print(f"{'policy':<12} {'cached/follow-up':>17} {'prompt/follow-up':>17} "
          f"{'cached share':>13} {'wall s':>8} {'out tok/s':>10}")  # fmt: skip
    for r in results:
        print(
            f"{r['policy']:<12} {r['cached_per_follow_up']:>17.1f} "
            f"{r['prompt_per_follow_up']:>17.1f} {r['cached_share']:>13.2f} "
            f"{r['wall_s']:>8.1f} {r['output_tokens_per_s']:>10.1f}"
        )
    aware, spread = results
    if spread["cached_per_follow_up"] > 0:
        ratio = f"{aware['cached_per_follow_up'] / spread['cached_per_follow_up']:.2f}x"
    else:
        ratio = "round_robin cached none"
    print(
        f"cache_aware / round_robin: cached tokens per follow-up {ratio}, output tokens/s "
        f"{aware['output_tokens_per_s'] / spread['output_tokens_per_s']:.2f}x"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
