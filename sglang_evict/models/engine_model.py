"""The small model the project builds offline for SGLang's real engine: a Llama-architecture
checkpoint in Hugging Face format plus a byte-level BPE tokenizer trained with the
``tokenizers`` package, both deterministic (same bytes on every build), float32.

Nothing is downloaded: the weights come from a seed (``build_tiny_llama``), the
tokenizer from a fixed text in this module. The weights are random, so the text it
writes is noise, but greedy decoding is deterministic and its attention reads and writes
SGLang's KV pool like any Llama's: what the engine tests, the demo and the CPU serving
example need.

    sglang-evict build-model --out DIR     # or build_engine_model(DIR)

The folder holds ``config.json``, ``generation_config.json``, ``model.safetensors``,
``tokenizer.json`` and ``tokenizer_config.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

# One definition of the model's shape; change MODEL_VERSION when anything here changes
# (the cache folder is keyed by it).
MODEL_VERSION = 1
VOCAB_SIZE = 512
MODEL_SHAPE = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
)
# The variant with head dim 64 (the tier's kernels hold 64 and 128): the tier's engine
# tests. Same tokenizer and vocabulary.
HEAD_DIM_64_SHAPE = dict(
    hidden_size=128,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=256,
)
# Head dim 64 with two KV heads (grouped queries): the tier under tensor parallelism,
# each of two ranks holding one KV head (``tests/test_engine_tensor_parallel.py``).
HEAD_DIM_64_KV2_SHAPE = dict(
    hidden_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=512,
)
SHAPES = {
    "base": MODEL_SHAPE,
    "head_dim64": HEAD_DIM_64_SHAPE,
    "head_dim64_kv2": HEAD_DIM_64_KV2_SHAPE,
}
SEED = 0
BOS, EOS, UNK = "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (UNK, BOS, EOS)  # ids 0, 1, 2

# The tokenizer's training text: a few paragraphs about the project's own subject, so
# common words of prompts become single tokens. Fixed: it defines the vocabulary.
_CORPUS = """\
Long reasoning traces make the KV cache, not the weights, what runs out of memory.
Eviction bounds the tokens a request keeps: a scorer ranks the cached tokens, the
survivors are chosen under a budget, and compaction moves them into whole pages so that
the paged allocator can free the pages left behind. The radix cache shares the prefix
of a system prompt between requests; a shared prefix is never moved or freed.
You are a helpful assistant. Answer the question step by step and explain your reasoning.
Question: what is the capital of France? Answer: the capital of France is Paris.
Question: how many pages does a request hold after a pass? Answer: the budget divided by
the page size, rounded up, plus the pages of its protected prompt.
The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16.
def main(): print("hello world") return 0 if __name__ == "__main__": main()
User: hello! Assistant: hello, how can I help you today? User: tell me a story.
Once upon a time there was a server with a small cache and many long requests.
"""


def build_tokenizer():
    """A byte-level BPE ``PreTrainedTokenizerFast`` of ``VOCAB_SIZE`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    if tokenizer.get_vocab_size() > VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} > {VOCAB_SIZE} tokens")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )


def build_engine_model(out: str | os.PathLike, variant: str = "base") -> Path:
    """Write the model (``SHAPES[variant]``) and tokenizer to ``out`` (created);
    returns the folder."""
    from sglang_evict.models.reference_model import build_tiny_llama

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_tiny_llama(seed=SEED, vocab_size=VOCAB_SIZE, **SHAPES[variant])
    config = model.config
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.max_position_embeddings = 8192
    if model.generation_config is not None:
        model.generation_config.bos_token_id = tokenizer.bos_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # No chat template of its own: SGLang's OpenAI routes then use a plain one.
    (out / "BUILD.json").write_text(
        json.dumps({"model_version": MODEL_VERSION, "files": folder_digests(out)}, indent=1) + "\n"
    )
    return out


def folder_digests(folder: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.iterdir())
        if path.is_file() and path.name != "BUILD.json"
    }


def default_model_dir(variant: str = "base") -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    name = "engine-model" if variant == "base" else f"engine-model-{variant}"
    return Path(base) / "sglang-evict" / f"{name}-v{MODEL_VERSION}"


def ensure_engine_model(folder: str | os.PathLike | None = None, variant: str = "base") -> Path:
    """The model folder, built on first use (reused when its files are intact);
    ``variant``: one of ``SHAPES``."""
    import fcntl

    folder = Path(folder) if folder is not None else default_model_dir(variant)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time (a demo, a server and test workers may ask at once): the
    # others wait, then find the folder intact instead of reading half-written files.
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        manifest = folder / "BUILD.json"
        if manifest.is_file():
            try:
                recorded = json.loads(manifest.read_text())
                if recorded.get("model_version") == MODEL_VERSION and recorded.get(
                    "files"
                ) == folder_digests(folder):
                    return folder
            except (ValueError, OSError):
                pass
        return build_engine_model(folder, variant)
