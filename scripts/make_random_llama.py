"""A random-weight Llama (HF folder, bf16 safetensors) for timing SGLang's engine on a
GPU machine, where no weights can be fetched. Its outputs mean nothing; its shapes set
the decode step's cost.

    python3 scripts/make_random_llama.py /tmp/llama_156m                       # 156M
    python3 scripts/make_random_llama.py /tmp/llama_1b --hidden 2048 --layers 22 \\
        --heads 32 --kv-heads 8 --intermediate 5632                             # ~1.2B
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args(argv)
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=32768,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    config.dtype = torch.bfloat16
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"model {args.out}: {params / 1e6:.0f}M parameters, {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
