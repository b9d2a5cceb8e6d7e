"""Calibration of the ``triattention`` scorer: per-(layer, head) statistics of a model's
pre-RoPE queries over a text (``sglang-evict calibrate``).

Each attention layer's ``q_proj`` output is the query before RoPE. Split into complex
pairs under the model's RoPE pairing, the statistics are the mean pair (``q_mean_real``,
``q_mean_imag``) and the mean pair magnitude (``q_abs_mean``) per (layer, head,
frequency), accumulated in float64 over every token of the text.

HF Llama-family models pair dimension i with i + head_dim/2 (``rotate_half``): the
``half`` style. Frequency scaling (YaRN and similar) is not derived: ``freq_scale`` is 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

from sglang_evict.scorers.triattention import split_rope_pairs
from sglang_evict.scorers.triattention_stats import TriAttentionStats

DEFAULT_CHUNK_TOKENS = 512


def rope_theta_of(config) -> float:
    """RoPE base of an HF config (transformers 5 keeps it in ``rope_parameters``)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    theta = parameters.get("rope_theta") if isinstance(parameters, dict) else None
    theta = theta or getattr(config, "rope_theta", None)
    if theta is None:
        raise ValueError("the model config names no rope_theta; is this a RoPE model?")
    return float(theta)


@torch.no_grad()
def calibrate(
    model,
    token_ids: Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    rope_style: str = "half",
    progress: Iterable | None = None,
) -> TriAttentionStats:
    """Statistics of ``model``'s pre-RoPE queries over ``token_ids`` (1-D), run in
    independent chunks of ``chunk_tokens``."""
    if token_ids.dim() != 1 or token_ids.numel() == 0:
        raise ValueError("calibration needs a non-empty 1-D sequence of token ids")
    config = model.config
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    layers = model.model.layers
    shape = (len(layers), num_heads, head_dim // 2)
    sum_real = torch.zeros(shape, dtype=torch.float64)
    sum_imag = torch.zeros(shape, dtype=torch.float64)
    sum_abs = torch.zeros(shape, dtype=torch.float64)
    count = [0]

    def make_hook(layer_index: int):
        def hook(_module, _inputs, output: Tensor) -> None:
            q = output.reshape(-1, num_heads, head_dim).double()
            real, imag = split_rope_pairs(q, rope_style)
            sum_real[layer_index] += real.sum(dim=0)
            sum_imag[layer_index] += imag.sum(dim=0)
            sum_abs[layer_index] += torch.hypot(real, imag).sum(dim=0)
            if layer_index == 0:
                count[0] += q.shape[0]

        return hook

    handles = [
        layer.self_attn.q_proj.register_forward_hook(make_hook(i)) for i, layer in enumerate(layers)
    ]
    try:
        model.eval()
        device = next(model.parameters()).device
        starts = range(0, token_ids.numel(), chunk_tokens)
        for start in progress(starts) if progress is not None else starts:
            chunk = token_ids[start : start + chunk_tokens].to(device)
            model(input_ids=chunk[None], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    n = float(count[0])
    return TriAttentionStats(
        q_mean_real=(sum_real / n).float(),
        q_mean_imag=(sum_imag / n).float(),
        q_abs_mean=(sum_abs / n).float(),
        freq_scale=torch.ones(head_dim // 2),
        rope_style=rope_style,
        rope_theta=rope_theta_of(config),
        head_dim=head_dim,
    )


def tokenize_text(model_path: Path, text: str, vocab_size: int, byte_tokens: bool) -> Tensor:
    """Token ids of ``text``: the model's tokenizer, or UTF-8 bytes mod the vocabulary
    when ``byte_tokens`` (for models built without a tokenizer)."""
    if byte_tokens:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64) % vocab_size
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any((model_path / name).exists() for name in tokenizer_files):
        raise ValueError(
            f"{model_path} has no tokenizer ({', '.join(tokenizer_files)}); add one, or pass "
            f"--byte-tokens to feed the text's UTF-8 bytes as token ids"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.int64)
