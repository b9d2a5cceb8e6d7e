"""Long reasoning under a per-request KV budget, with self-consistency voting over forks.

What it shows: a frontend program (``sglang.lang``) forks one question into several
reasoning paths (``s.fork(n)``). The paths share the question's KV through the
server's radix cache; each path is its own request that reasons at length under a
per-request budget (``gen(..., kv_budget_tokens=...)``), so each evicts only its own
tokens and never the shared question. Each path then picks an answer with
``sgl.select`` and the most frequent answer wins. Every path prints what eviction did
to it (``meta_info["sglang_evict"]``): passes, tokens evicted, the most KV it held.

Run it against a server started with the plugin, e.g. on CPU with the project's tiny
random-weight model (its text is gibberish: this shows the mechanics, not reasoning)::

    MODEL=$(sglang-evict demo-model)
    sglang-evict serve --kv-budget 64 --kv-cadence 16 --kv-window 16 \\
        --kv-request-max-budget 512 \\
        --model-path "$MODEL" --device cpu --model-impl transformers \\
        --attention-backend torch_native --dtype float32 --sleep-on-idle \\
        --sampling-backend pytorch --grammar-backend none --port 30000 &
    python examples/reasoning_vote.py --url http://127.0.0.1:30000

On a GPU server drop the CPU flags and use a real reasoning model; raise
``--think-tokens`` and ``--budget`` (e.g. 8192 and 2048) and the server's
``--kv-request-max-budget`` with them.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import sglang as sgl

from sglang_evict.request_policy import report_of
from sglang_evict.srt.frontend import EvictingEndpoint, gen

CHOICES = ["A", "B", "C", "D"]


@sgl.function
def reasoning_vote(s, question, num_paths, think_tokens, budget):
    s += "Question: " + question + "\n"
    paths = s.fork(num_paths)
    for i, path in enumerate(paths):
        path += f"Reasoning path {i + 1}: "
        path += gen(
            "reasoning",
            max_tokens=think_tokens,
            ignore_eos=True,
            kv_budget_tokens=budget,
        )
        path += "\nAnswer: "
        path += sgl.select("answer", choices=CHOICES)
    reports = [report_of(path.get_meta_info("reasoning")) for path in paths]
    answers = [path["answer"] for path in paths]
    paths.join()
    s.set_var("answers", answers)
    s.set_var("reports", reports)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--paths", type=int, default=3, help="reasoning paths (forks)")
    parser.add_argument("--think-tokens", type=int, default=160, help="tokens per path")
    parser.add_argument("--budget", type=int, default=48, help="per-request KV budget")
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args(argv)

    state = reasoning_vote.run(
        question="A train leaves at 9:00 at 80 km/h; when has it covered 200 km? "
        "A) 11:30 B) 11:00 C) 12:00 D) 10:30",
        num_paths=args.paths,
        think_tokens=args.think_tokens,
        budget=args.budget,
        temperature=args.temperature,  # the sampling default of every gen of the run
        backend=EvictingEndpoint(args.url),
    )
    if state.error() is not None:
        raise SystemExit(f"reasoning_vote failed: {state.error()}")
    answers, reports = state["answers"], state["reports"]
    for i, (answer, report) in enumerate(zip(answers, reports, strict=True)):
        print(f"path {i + 1}: answer {answer}; eviction: {json.dumps(report, sort_keys=True)}")
    winner, votes = Counter(answers).most_common(1)[0]
    print(f"vote: {winner} ({votes} of {len(answers)} paths)")
    summary = {"answers": answers, "winner": winner, "reports": reports}
    print("summary " + json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
