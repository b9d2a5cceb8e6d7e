"""A multi-turn chat whose system prompt is protected, later turns reusing its cache.

What it shows: a frontend program (``sglang.lang``) runs a chat turn by turn. Each turn
is one request whose prompt is the conversation so far; the plugin never evicts a
request's prompt (the system prompt included) nor a prefix the radix cache shares, and
evicts only what the turn generates, under the turn's own budget
(``gen(..., kv_budget_tokens=...)``). When a turn finishes, the radix cache keeps its
intact prefix (everything up to the first evicted token), so the next turn finds the
system prompt and the earlier turns already cached: ``meta_info["cached_tokens"]``
grows from turn to turn while each turn's ``meta_info["sglang_evict"]`` shows its own
passes and the most KV it held.

Run it against a server started with the plugin, e.g. on CPU with the project's tiny
random-weight model (its replies are gibberish: this shows the mechanics)::

    MODEL=$(sglang-evict demo-model)
    sglang-evict serve --kv-budget 64 --kv-cadence 16 --kv-window 16 \\
        --kv-request-max-budget 512 \\
        --model-path "$MODEL" --device cpu --model-impl transformers \\
        --attention-backend torch_native --dtype float32 --sleep-on-idle \\
        --sampling-backend pytorch --grammar-backend none --port 30000 &
    python examples/protected_chat.py --url http://127.0.0.1:30000

The system prompt is protected however long the chat gets; to also keep it when a
server evicts prompts, start the server with ``--kv-protected-tokens`` set to its
length in tokens.
"""

from __future__ import annotations

import argparse
import json

import sglang as sgl

from sglang_evict.request_policy import report_of
from sglang_evict.srt.frontend import EvictingEndpoint, gen

SYSTEM = (
    "You are a helpful assistant. Answer the question step by step and explain your "
    "reasoning. Long reasoning traces make the KV cache what runs out of memory."
)
QUESTIONS = (
    "Question: what is the capital of France?",
    "Question: how many pages does a request hold after a pass?",
    "Tell me a story about a server with a small cache.",
)


@sgl.function
def protected_chat(s, questions, reply_tokens, budget):
    s += sgl.system(SYSTEM)
    for turn, question in enumerate(questions):
        s += sgl.user(question)
        s += sgl.assistant(
            gen(
                f"reply_{turn}",
                max_tokens=reply_tokens,
                temperature=0,
                ignore_eos=True,
                kv_budget_tokens=budget,
            )
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--reply-tokens", type=int, default=96, help="tokens per reply")
    parser.add_argument("--budget", type=int, default=48, help="per-request KV budget")
    args = parser.parse_args(argv)

    state = protected_chat.run(
        questions=list(QUESTIONS),
        reply_tokens=args.reply_tokens,
        budget=args.budget,
        backend=EvictingEndpoint(args.url),
    )
    if state.error() is not None:
        raise SystemExit(f"protected_chat failed: {state.error()}")
    turns = []
    for turn in range(len(QUESTIONS)):
        meta = state.get_meta_info(f"reply_{turn}")
        turns.append(
            {
                "prompt_tokens": meta["prompt_tokens"],
                "cached_tokens": meta["cached_tokens"],
                "eviction": report_of(meta),
            }
        )
        print(
            f"turn {turn + 1}: prompt {meta['prompt_tokens']} tokens, "
            f"{meta['cached_tokens']} from the cache; eviction: "
            f"{json.dumps(turns[-1]['eviction'], sort_keys=True)}"
        )
    print("summary " + json.dumps({"turns": turns}, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
