"""Calibration of the ``triattention`` scorer: per-(layer, head) statistics of a model's
pre-RoPE queries over a text (``sglang-evict calibrate``), and the check that a stats
file fits a model (``sglang-evict calibrate --check``).

Each attention layer's ``q_proj`` output is the query before RoPE. Split into complex
pairs under the model's RoPE pairing, the statistics are the mean pair (``q_mean_real``,
``q_mean_imag``) and the mean pair magnitude (``q_abs_mean``) per (layer, head,
frequency), accumulated in float64 over every token of the text.

HF Llama-family models pair dimension i with i + head_dim/2 (``rotate_half``): the
``half`` style. Frequency scaling (YaRN and similar) is not derived: ``freq_scale`` is 1.

The model folder is checked before anything is loaded (``check_model_folder``): a
readable ``config.json`` naming a ``model_type``, and safetensors weights whose headers
cover their files. Pickle weights (``*.bin``, ``*.pt``) are refused: loading them can
run code.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from sglang_evict.scorers.triattention import split_rope_pairs
from sglang_evict.scorers.triattention_stats import TriAttentionStats, model_shape_of

DEFAULT_CHUNK_TOKENS = 512
PICKLE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SAFETENSORS_INDEX = "model.safetensors.index.json"


def _folder_error(model_path: Path, problem: str) -> ValueError:
    return ValueError(f"--model-path {model_path}: {problem}")


def first_line(error: BaseException) -> str:
    """A library's error, on one line (transformers' messages run to many)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def read_config_json(model_path: Path) -> dict:
    """``config.json`` of a model folder, checked to be a readable JSON object: else a
    one-line ``ValueError`` naming the folder and the file (transformers reports a file
    that is not JSON as an ``OSError``, and one that is not an object as a traceback)."""
    config_path = model_path / "config.json"
    if not config_path.is_file():
        raise _folder_error(model_path, "not an HF-format model folder (no config.json)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise _folder_error(model_path, f"config.json is not valid JSON ({error})") from None
    except OSError as error:
        raise _folder_error(model_path, f"cannot read config.json ({error.strerror})") from None
    if not isinstance(config, dict):
        raise _folder_error(
            model_path,
            f"config.json must be a JSON object, got {_json_kind(config)}; is this the folder "
            f"save_pretrained wrote?",
        )
    return config


def _json_kind(value: object) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")


def read_model_config(model_path: Path) -> dict:
    """``config.json`` of an HF-format model folder, checked to be a JSON object naming
    its ``model_type``."""
    config = read_config_json(model_path)
    if not isinstance(config.get("model_type"), str):
        raise _folder_error(
            model_path,
            'config.json must be a JSON object naming the architecture ("model_type": '
            '"llama", ...); is this the folder save_pretrained wrote?',
        )
    return config


def safetensors_files(model_path: Path) -> list[Path]:
    """The folder's safetensors weight files, each checked to be readable and complete
    (the header covers the whole file); no safetensors weights is an error that says
    whether pickle weights were found instead."""
    from safetensors import safe_open

    index = model_path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise _folder_error(
                model_path, f"{SAFETENSORS_INDEX} is not a safetensors index (no weight_map)"
            ) from None
        files = [model_path / name for name in names]
    else:
        files = sorted(model_path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in model_path.iterdir() if p.suffix in PICKLE_WEIGHT_SUFFIXES)
        if pickles:
            raise _folder_error(
                model_path,
                f"holds only pickle weights ({', '.join(pickles)}), which can run code when "
                f"loaded; convert them to safetensors where you trust them "
                f"(model.save_pretrained(DIR) writes model.safetensors) and calibrate from that",
            )
        raise _folder_error(model_path, "no weights (model.safetensors) in the folder")
    for file in files:
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as error:  # safetensors raises its own error types
            raise _folder_error(
                model_path, f"{file.name} is not a readable safetensors file ({error})"
            ) from None
    return files


def read_hf_config(model_path: Path):
    """The folder's HF config (its text part, for multimodal configs), as transformers
    reads it."""
    read_model_config(model_path)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_path)).get_text_config()
    except (OSError, ValueError, KeyError) as error:
        raise _folder_error(
            model_path, f"transformers cannot read config.json ({first_line(error)})"
        ) from None


def load_model(model_path: Path):
    """The folder's causal LM in float32, after ``read_model_config`` and
    ``safetensors_files`` have checked it; never reads pickle weights."""
    read_model_config(model_path)
    safetensors_files(model_path)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    # transformers' own load report (a multi-line table of missing keys) would come
    # before the one-line error below; the error names what matters, so the report is
    # silenced for the load and the caller's verbosity restored after it.
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=torch.float32, use_safetensors=True, output_loading_info=True
        )
    except (OSError, ValueError, RuntimeError, KeyError) as error:
        raise _folder_error(
            model_path, f"transformers cannot load it as a causal LM ({first_line(error)})"
        ) from None
    finally:
        transformers_logging.set_verbosity(verbosity)
    missing = sorted(loading.get("missing_keys") or ())
    if missing:  # transformers fills them with random values: statistics of noise
        raise _folder_error(
            model_path,
            f"the weights lack {len(missing)} tensor(s) config.json asks for (first: "
            f"{missing[0]}); does config.json belong to these weights?",
        )
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers or not all(hasattr(layer.self_attn, "q_proj") for layer in layers):
        raise _folder_error(
            model_path,
            f"{type(model).__name__} has no per-layer self_attn.q_proj (the Llama-family "
            f"layout calibration reads); fused-QKV models are not supported yet",
        )
    return model


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
    shape = model_shape_of(model.config)
    if shape.rope_theta is None:
        raise ValueError("the model's config names no rope_theta: triattention needs a RoPE model")
    num_heads, head_dim = shape.num_q_heads, shape.head_dim
    layers = model.model.layers
    sums_shape = (len(layers), num_heads, head_dim // 2)
    sum_real = torch.zeros(sums_shape, dtype=torch.float64)
    sum_imag = torch.zeros(sums_shape, dtype=torch.float64)
    sum_abs = torch.zeros(sums_shape, dtype=torch.float64)
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
        rope_theta=shape.rope_theta,
        head_dim=head_dim,
    )


def check_stats_fit_model(stats: TriAttentionStats, model_config, model_path: str) -> None:
    """``ValueError`` naming both shapes unless ``stats`` were computed for a model of
    this config's shape (layers, query heads, head_dim, RoPE base); what the server's
    startup and ``serve --dry-run`` check too."""
    shape = model_shape_of(model_config)
    if shape.rope_theta is None:
        raise ValueError(
            f"the model at {model_path} names no rope_theta in its config: triattention "
            f"needs a RoPE model; use another --kv-scorer"
        )
    stats.check_model(
        num_layers=shape.num_layers,
        num_q_heads=shape.num_q_heads,
        head_dim=shape.head_dim,
        rope_theta=shape.rope_theta,
        model_path=model_path,
    )


@dataclass(frozen=True)
class HeldOutAgreement:
    """How far a stats file's mean queries are from the same statistics over another
    text: per (layer, head), ``|q̄_file - q̄_text| / |q̄_text|`` over the frequencies."""

    median: float
    worst: float
    worst_head: tuple[int, int]  # (layer, head)

    def describe(self) -> str:
        layer, head = self.worst_head
        return (
            f"mean-query relative difference against the held-out text: median "
            f"{self.median:.3f}, worst {self.worst:.3f} (layer {layer}, head {head})"
        )


def held_out_agreement(stats: TriAttentionStats, held_out: TriAttentionStats) -> HeldOutAgreement:
    """Agreement of ``stats`` with statistics of the same model over a held-out text."""
    difference = torch.hypot(
        stats.q_mean_real - held_out.q_mean_real, stats.q_mean_imag - held_out.q_mean_imag
    )
    scale = torch.hypot(held_out.q_mean_real, held_out.q_mean_imag)
    per_head = difference.norm(dim=-1) / scale.norm(dim=-1).clamp_min(1e-12)
    worst = int(per_head.argmax())
    return HeldOutAgreement(
        median=float(per_head.median()),
        worst=float(per_head.max()),
        worst_head=divmod(worst, per_head.shape[1]),
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

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    except (OSError, ValueError, KeyError) as error:
        raise _folder_error(
            model_path,
            f"its tokenizer cannot be loaded ({first_line(error)}); or pass --byte-tokens",
        ) from None
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.int64)


def read_text(text_path: Path) -> str:
    """The calibration text (``--text``): an existing, non-empty UTF-8 file."""
    if not text_path.is_file():
        raise FileNotFoundError(f"--text {text_path}: text file does not exist")
    try:
        text = text_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"--text {text_path}: not UTF-8 text ({error.reason})") from None
    except OSError as error:
        raise ValueError(f"--text {text_path}: cannot read it ({error.strerror})") from None
    if not text.strip():
        raise ValueError(f"--text {text_path}: text file is empty")
    return text
