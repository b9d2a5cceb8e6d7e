"""Why the observation window (`window`, SnapKV's signal) loses needles on the real model:
what the needle prompt's last queries attend to, and which reduction of the per-head
weights to one keep-set per token would keep the needle's code.

    python3 benches/quality/real/diagnose_needle.py [--samples 4] [--fraction 0.25]

For each needle prompt (development indexes, from 0: never the evaluation's, which start
at ``real_eval.EVAL_FIRST_INDEX``), one float32 forward of SmolLM2-135M-Instruct
(4-bit weights dequantised) prints:

- how far the `window` scorer's weights (the plugin's own ``weights_from_logits`` over
  queries and keys captured by the paged reference model) are from Hugging Face's
  eager attention summed over the same last W queries: a defect would show here;
- the largest share of one (layer, head)'s attention that lands on the code's digit
  tokens, and the share on the words that introduce the needle;
- how many of the code's digit tokens a keep-set of ``fraction`` of the prompt keeps,
  for reductions over (layer, head): the plugin's (z-score per head, then mean or
  max), raw weights (mean or max), and raw weights max-pooled over neighbouring tokens
  first (SnapKV's clustering, kernel 7 and 15).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

QUERY_WINDOW = 32


def digit_positions(tokenizer, ids: list[int], code: str) -> list[int]:
    """Positions of the tokens that spell ``code`` (SmolLM2 spells digits one a token)."""
    pieces = [tokenizer.decode([t]).strip() for t in ids]
    for start in range(len(ids) - len(code) + 1):
        if "".join(pieces[start : start + len(code)]) == code:
            return list(range(start, start + len(code)))
    return []


def phrase_positions(tokenizer, ids: list[int], phrase: str) -> list[int]:
    words = set(phrase.lower().split())
    return [i for i, t in enumerate(ids) if tokenizer.decode([t]).strip().lower() in words]


def kept(score: torch.Tensor, positions: list[int], budget: int) -> int:
    top = set(torch.topk(score, budget).indices.tolist())
    return sum(p in top for p in positions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--context", type=int, default=1000)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_evict.models.real_model import ensure_real_model, ensure_real_text
    from sglang_evict.models.reference_model import KVBuffers, PagedLlama
    from sglang_evict.quality.real.needle import build_samples
    from sglang_evict.scorers.window import weights_from_logits

    torch.manual_seed(0)
    model_path = ensure_real_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    hf = AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    paged = PagedLlama(hf)
    samples = build_samples(
        ensure_real_text().read_text(encoding="utf-8"),
        tokenizer,
        context_sizes=(args.context,),
        depths=(0.1, 0.3, 0.5, 0.7, 0.9),
        per_depth=1,
    )[: args.samples]
    print(
        f"SmolLM2-135M-Instruct (4-bit Q4_1 weights dequantised to float32); "
        f"{len(samples)} needle prompts of ~{args.context} tokens (development indexes); "
        f"last {QUERY_WINDOW} queries; keep-set {args.fraction:g} of the prompt"
    )
    totals: dict[str, int] = {}
    for sample in samples:
        ids = list(sample.prompt_ids)
        n = len(ids)
        code = digit_positions(tokenizer, ids, sample.needle.code)
        # The needle's own words before its code ("secret code of the <place> archive").
        words = f"secret code {sample.needle.place} archive"
        first = min(code or [n])
        intro = [p for p in phrase_positions(tokenizer, ids, words) if first - 12 <= p < first]
        layers, kv_heads, head_dim = paged.num_layers, paged.num_kv_heads, paged.head_dim
        keys = [torch.zeros(n, kv_heads, head_dim) for _ in range(layers)]
        values = [torch.zeros(n, kv_heads, head_dim) for _ in range(layers)]
        queries: list[torch.Tensor] = []
        positions = torch.arange(n)
        with torch.no_grad():
            paged.forward(
                torch.tensor(ids),
                positions,
                positions,
                positions,
                positions,
                KVBuffers(k=keys, v=values),
                capture_queries=queries,
            )
            group = paged.num_heads // kv_heads
            logits = torch.stack(
                [
                    torch.einsum(
                        "whd,nhd->hwn",
                        queries[layer][-QUERY_WINDOW:],
                        keys[layer].repeat_interleave(group, dim=1),
                    )
                    / math.sqrt(head_dim)
                    for layer in range(layers)
                ]
            )
            weights = weights_from_logits(logits, positions, positions[-QUERY_WINDOW:], "sum", 1)
            attentions = hf(torch.tensor([ids]), output_attentions=True).attentions
        reference = torch.stack([a[0, :, -QUERY_WINDOW:, :].sum(dim=1) for a in attentions])
        share = weights[:, :, code].sum(-1) / weights.sum(-1)
        intro_share = weights[:, :, intro].sum(-1) / weights.sum(-1) if intro else share * 0
        budget = round(args.fraction * n)
        z = (weights - weights.mean(-1, keepdim=True)) / (
            weights.std(-1, keepdim=True, unbiased=False) + 1e-6
        )
        flat = weights.reshape(-1, 1, n)
        variants = {
            "z-score, mean (the plugin's default)": z.mean((0, 1)),
            "z-score, max": z.amax((0, 1)),
            "raw, mean": weights.mean((0, 1)),
            "raw, max": weights.amax((0, 1)),
            "raw pooled 7, mean": F.max_pool1d(flat, 7, 1, 3).reshape_as(weights).mean((0, 1)),
            "raw pooled 15, mean": F.max_pool1d(flat, 15, 1, 7).reshape_as(weights).mean((0, 1)),
        }
        print(
            f"\n{sample.key}: {n} tokens, code {sample.needle.code} at {code[:1]}, budget "
            f"{budget}; window vs HF attention max |diff| "
            f"{(weights - reference).abs().max().item():.2e}; largest head share on the "
            f"digits {share.max().item():.3%}, on the needle's words "
            f"{intro_share.max().item():.3%}"
        )
        for name, score in variants.items():
            count = kept(score, code, budget)
            totals[name] = totals.get(name, 0) + count
            print(f"  {name:<38} keeps {count}/{len(code)} digits")
    digits = sum(len(s.needle.code) for s in samples)
    print("\ndigits kept over all prompts:")
    for name, count in totals.items():
        print(f"  {name:<38} {count}/{digits}")


if __name__ == "__main__":
    main()
