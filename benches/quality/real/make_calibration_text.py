"""The real model's own text, for calibrating ``triattention`` on it: SmolLM2-135M-Instruct
(``sglang-evict real-model``) answering chat prompts of its own kind, sampled (temperature
0.7, seeded), until at least ``--tokens`` generated tokens. The prompts are written here
and share nothing with the evaluation's needle questions or essays.

    python3 benches/quality/real/make_calibration_text.py --out calibration.txt
    sglang-evict calibrate --model-path "$(sglang-evict real-model)" \\
        --text calibration.txt --out benches/quality/real/triattention-smollm2.safetensors
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from sglang_evict.models.prompts import chat_ids  # noqa: E402
from sglang_evict.models.real_model import ensure_real_model  # noqa: E402

TOPICS = (
    "how bread rises", "the life of a honeybee", "why the sky is blue", "how to learn a new "
    "language", "the rules of chess", "a day in a lighthouse", "how vaccines work", "the "
    "history of paper money", "planning a long hike", "how rainbows form", "the moon's "
    "phases", "writing a good letter", "how trains are built", "caring for a dog", "the "
    "invention of the telescope", "why leaves change colour", "a story about a lost key",
    "how to fix a flat tyre", "the causes of earthquakes", "a recipe for vegetable soup",
    "how computers store numbers", "the migration of birds", "a story about two friends "
    "and a boat", "how to save money", "the life cycle of a star", "why we sleep", "how "
    "glass is made", "a story set in a snowy village", "what makes music sound happy",
    "how to plant a tree",
)  # fmt: skip
FORMS = (
    "Explain {topic} in detail.",
    "Write a long, careful answer about {topic}.",
    "Tell me everything you know about {topic}, step by step.",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=12_000)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_path = ensure_real_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    torch.manual_seed(args.seed)
    texts, total = [], 0
    bar = tqdm(total=args.tokens, desc="generated", unit="token")
    prompts = [form.format(topic=t) for form in FORMS for t in TOPICS]
    for prompt in prompts:
        if total >= args.tokens:
            break
        ids = torch.tensor([chat_ids(tokenizer, [{"role": "user", "content": prompt}])])
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=args.max_new_tokens,
                do_sample=True,
                temperature=0.7,
                top_p=0.95,
                pad_token_id=tokenizer.eos_token_id,
            )
        new = out[0, ids.shape[1] :]
        texts.append(tokenizer.decode(new, skip_special_tokens=True).strip())
        total += len(new)
        bar.update(len(new))
    bar.close()
    Path(args.out).write_text("\n\n".join(texts) + "\n", encoding="utf-8")
    print(f"{total} generated tokens from {len(texts)} prompts -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
