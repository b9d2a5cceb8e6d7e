"""``sglang-evict demo``: generation with and without eviction, side by side in one run."""

from __future__ import annotations

import argparse

import torch

from sglang_evict.cli import _config_from_args, _use_triton_interpreter_without_gpu


def run(args: argparse.Namespace) -> int:
    _use_triton_interpreter_without_gpu()
    from tqdm import tqdm

    from sglang_evict.reference_loop import GenerationRequest, generate
    from sglang_evict.reference_model import PagedLlama, build_tiny_llama
    from sglang_evict.srt.cpu_driver import MemoryDriver

    config = _config_from_args(args)
    hf_model = build_tiny_llama(seed=args.seed)
    model_config = hf_model.config
    model = PagedLlama(hf_model)
    page_size = config.page_size
    num_slots = args.requests * (args.prompt_tokens + args.new_tokens + 2 * page_size) + 64

    def make_driver(policy):
        return MemoryDriver.for_model(
            model,
            page_size=page_size,
            num_tokens=num_slots,
            config=policy,
            max_context=args.prompt_tokens + args.new_tokens + 8,
        )

    generator = torch.Generator().manual_seed(args.seed)
    vocab = model_config.vocab_size
    system = torch.randint(vocab, (args.prompt_tokens // 2,), generator=generator).tolist()
    requests = [
        GenerationRequest(
            f"r{i}",
            system
            + torch.randint(
                vocab, (args.prompt_tokens - len(system),), generator=generator
            ).tolist(),
            args.new_tokens,
        )
        for i in range(args.requests)
    ]
    print(
        f"demo: {args.requests} requests sharing a {len(system)}-token system prompt, "
        f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens each; page size "
        f"{page_size}, budget {config.kv_budget_tokens}, cadence {config.cadence_tokens}, "
        f"scorer {config.scorer}, compaction {config.compaction}"
    )
    bar = tqdm(total=args.new_tokens, desc="with eviction", unit="step", leave=False)
    shown = [0]

    def on_step(step: int, result) -> None:
        bar.update(1)
        for rid, at, done in result.passes[shown[0] :]:
            bar.write(
                f"step {at:>5}  {rid:<4} pass: {done.tokens_before} -> {done.tokens_after} "
                f"tokens, evicted {done.tokens_evicted}, pages freed {done.pages_freed}, "
                f"slot copies {done.slot_copies}"
            )
        shown[0] = len(result.passes)

    evicting = generate(make_driver(config), model, requests, on_step=on_step)
    bar.close()
    bar = tqdm(total=args.new_tokens, desc="full cache (no plugin)", unit="step", leave=False)
    full = generate(make_driver(None), model, requests, on_step=lambda *_: bar.update(1))
    bar.close()
    passes = [p for _, _, p in evicting.passes]
    print(
        f"passes {len(passes)}, tokens evicted {sum(p.tokens_evicted for p in passes)}, "
        f"pages freed {sum(p.pages_freed for p in passes)}"
    )
    held, held_full = max(evicting.held_tokens), max(full.held_tokens)
    print(
        f"peak KV held (running requests + radix tree): {held} tokens "
        f"({-(-held // page_size)} pages) with eviction vs {held_full} tokens "
        f"({-(-held_full // page_size)} pages) without: {held / held_full:.2f} of the full cache"
    )
    return 0
