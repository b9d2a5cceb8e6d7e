"""Per-(layer, head) query statistics for the ``triattention`` scorer: format and loader.

Calibration (``sglang-evict calibrate``) runs a model over text and records, for every
attention (query) head, statistics of the pre-RoPE query split into complex pairs, one
per RoPE frequency f:

    q_mean_real[l, h, f], q_mean_imag[l, h, f]   mean query  q̄_f = E[q_f]
    q_abs_mean[l, h, f]                          mean magnitude E|q_f|
    freq_scale[f] (optional, default 1)          RoPE frequency scaling s_f

Files are safetensors (tensors above + string metadata) or JSON (same names, nested
lists); never pickle, which executes code on load. Metadata: ``format``
(``sglang-evict/triattention-stats``), ``version`` (1), ``rope_style`` (``half`` for
HF Llama/NeoX pairing (i, i + D/2), ``interleaved`` for GPT-J pairing (2i, 2i + 1)),
``rope_theta``, ``head_dim``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

STATS_FORMAT = "sglang-evict/triattention-stats"
STATS_VERSION = 1
ROPE_STYLES = ("half", "interleaved")
_TENSOR_NAMES = ("q_mean_real", "q_mean_imag", "q_abs_mean")
_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")


@dataclass(frozen=True)
class TriAttentionStats:
    q_mean_real: Tensor  # float32 [layers, q_heads, head_dim // 2]
    q_mean_imag: Tensor
    q_abs_mean: Tensor
    freq_scale: Tensor  # float32 [head_dim // 2]
    rope_style: str
    rope_theta: float
    head_dim: int

    def __post_init__(self) -> None:
        if self.rope_style not in ROPE_STYLES:
            raise ValueError(f"unknown rope_style {self.rope_style!r}; known: {list(ROPE_STYLES)}")
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be a positive even number")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"rope_theta={self.rope_theta} must be a positive finite number")
        expected = self.q_mean_real.shape
        if len(expected) != 3 or expected[2] != self.head_dim // 2:
            raise ValueError(
                f"q_mean_real must be [layers, heads, head_dim/2 = {self.head_dim // 2}], "
                f"got {tuple(expected)}"
            )
        for name in ("q_mean_imag", "q_abs_mean"):
            if getattr(self, name).shape != expected:
                raise ValueError(
                    f"{name} shape {tuple(getattr(self, name).shape)} != q_mean_real shape "
                    f"{tuple(expected)}"
                )
        if self.freq_scale.shape != (self.head_dim // 2,):
            raise ValueError(
                f"freq_scale must be [{self.head_dim // 2}], got {tuple(self.freq_scale.shape)}"
            )
        for name in (*_TENSOR_NAMES, "freq_scale"):
            if not torch.isfinite(getattr(self, name)).all():
                raise ValueError(f"{name} holds NaN or infinite values")

    @property
    def num_layers(self) -> int:
        return self.q_mean_real.shape[0]

    @property
    def num_heads(self) -> int:
        return self.q_mean_real.shape[1]

    def shape_text(self) -> str:
        return (
            f"{self.num_layers} layers x {self.num_heads} attention heads x head_dim "
            f"{self.head_dim} (rope_style {self.rope_style}, rope_theta {self.rope_theta:g})"
        )

    def check_model(
        self,
        *,
        num_layers: int,
        num_q_heads: int,
        head_dim: int,
        rope_style: str | None = None,
        rope_theta: float | None = None,
        model_path: str | None = None,
    ) -> None:
        """Raise ``ValueError`` naming both shapes, every mismatch between these stats and
        a model, and the calibration command for that model (``rope_style`` or
        ``rope_theta`` None: not known to the caller, so not compared)."""
        problems = []
        for name, ours, theirs in (
            ("layers", self.num_layers, num_layers),
            ("attention heads", self.num_heads, num_q_heads),
            ("head_dim", self.head_dim, head_dim),
        ):
            if ours != theirs:
                problems.append(f"{name}: stats have {ours}, model has {theirs}")
        if rope_style is not None and rope_style != self.rope_style:
            problems.append(f"rope_style: stats have {self.rope_style!r}, model has {rope_style!r}")
        if rope_theta is not None and abs(rope_theta - self.rope_theta) > 1e-6 * rope_theta:
            problems.append(f"rope_theta: stats have {self.rope_theta:g}, model has {rope_theta:g}")
        if problems:
            model = f"the model at {model_path}" if model_path else "the model"
            theta = "" if rope_theta is None else f" (rope_theta {rope_theta:g})"
            raise ValueError(
                f"triattention stats do not match {model}: the stats are for "
                f"{self.shape_text()}, the model has {num_layers} layers x {num_q_heads} "
                f"attention heads x head_dim {head_dim}{theta} "
                f"({'; '.join(problems)}); re-run calibration for this model: "
                + how_to_calibrate(model_path)
            )


@dataclass(frozen=True)
class ModelShape:
    """What stats must match in a model, read from its HF config the way calibration
    reads it (``model_shape_of``)."""

    num_layers: int
    num_q_heads: int
    head_dim: int
    rope_theta: float | None  # None: the config names no RoPE base


def rope_theta_of(config) -> float | None:
    """RoPE base of an HF config (transformers 5 keeps it in ``rope_parameters``), or
    None when it names none."""
    parameters = getattr(config, "rope_parameters", None) or {}
    theta = parameters.get("rope_theta") if isinstance(parameters, dict) else None
    theta = theta if theta is not None else getattr(config, "rope_theta", None)
    return None if theta is None else float(theta)


def model_shape_of(config) -> ModelShape:
    """Layers, query heads, head_dim and RoPE base of an HF (text) config, computed as
    ``sglang_evict.calibrate`` computes them when it records the stats."""
    num_heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return ModelShape(
        num_layers=int(config.num_hidden_layers),
        num_q_heads=num_heads,
        head_dim=int(head_dim),
        rope_theta=rope_theta_of(config),
    )


def how_to_calibrate(model_path: str | None = None) -> str:
    model = model_path or "DIR"
    return (
        f"`sglang-evict calibrate --model-path {model} --text FILE --out stats.safetensors` "
        f"(see docs/serving.md, Recommended configuration)"
    )


_HOW_TO_MAKE = "create one with " + how_to_calibrate()


def _metadata(stats: TriAttentionStats) -> dict[str, str]:
    return {
        "format": STATS_FORMAT,
        "version": str(STATS_VERSION),
        "rope_style": stats.rope_style,
        "rope_theta": repr(float(stats.rope_theta)),
        "head_dim": str(stats.head_dim),
    }


def save_stats(stats: TriAttentionStats, path: str | Path) -> None:
    """Write ``stats`` as safetensors (``.safetensors``) or JSON (``.json``)."""
    path = Path(path)
    tensors = {name: getattr(stats, name).float().contiguous() for name in _TENSOR_NAMES}
    tensors["freq_scale"] = stats.freq_scale.float().contiguous()
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(path), metadata=_metadata(stats))
    elif path.suffix == ".json":
        document = {**_metadata(stats), **{k: v.tolist() for k, v in tensors.items()}}
        path.write_text(json.dumps(document))
    else:
        raise ValueError(f"stats file {path} must end in .safetensors or .json")


def _int_field(name: str, value: object, path: Path) -> int:
    """A metadata integer: a JSON number or a decimal string (safetensors metadata
    holds strings only)."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"{path}: field {name!r} must be an integer, got {value!r}; " + _HOW_TO_MAKE)


def _float_field(name: str, value: object, path: Path) -> float:
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if math.isfinite(number):
            return number
    raise ValueError(
        f"{path}: field {name!r} must be a finite number, got {value!r}; " + _HOW_TO_MAKE
    )


def _tensor_field(name: str, value: object, path: Path) -> Tensor:
    """A JSON tensor: nested lists of numbers, rectangular."""
    if isinstance(value, Tensor):
        return value.float()
    if not isinstance(value, list):
        raise ValueError(
            f"{path}: field {name!r} must be a nested list of numbers, got "
            f"{type(value).__name__}; " + _HOW_TO_MAKE
        )
    try:
        return torch.tensor(value, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(
            f"{path}: field {name!r} must be a rectangular nested list of numbers ({error}); "
            + _HOW_TO_MAKE
        ) from None


def _from_parts(metadata: dict, tensors: dict[str, object], path: Path) -> TriAttentionStats:
    if metadata.get("format") != STATS_FORMAT:
        raise ValueError(
            f"{path} is not a triattention stats file (format={metadata.get('format')!r}, "
            f"expected {STATS_FORMAT!r}); " + _HOW_TO_MAKE
        )
    if str(metadata.get("version")) != str(STATS_VERSION):
        raise ValueError(
            f"{path} has stats version {metadata.get('version')}, this build reads "
            f"{STATS_VERSION}; " + _HOW_TO_MAKE
        )
    missing = [
        n
        for n in (*_TENSOR_NAMES, "rope_style", "rope_theta", "head_dim")
        if n not in {**metadata, **tensors}
    ]
    if missing:
        raise ValueError(f"{path} lacks {missing}; " + _HOW_TO_MAKE)
    head_dim = _int_field("head_dim", metadata["head_dim"], path)
    rope_style = metadata["rope_style"]
    if not isinstance(rope_style, str):
        raise ValueError(
            f"{path}: field 'rope_style' must be one of {list(ROPE_STYLES)}, got {rope_style!r}"
        )
    fields = {name: _tensor_field(name, tensors[name], path) for name in _TENSOR_NAMES}
    if "freq_scale" in tensors:
        fields["freq_scale"] = _tensor_field("freq_scale", tensors["freq_scale"], path)
    else:
        fields["freq_scale"] = torch.ones(max(head_dim, 0) // 2)
    rope_theta = _float_field("rope_theta", metadata["rope_theta"], path)
    try:
        return TriAttentionStats(
            **fields, rope_style=rope_style, rope_theta=rope_theta, head_dim=head_dim
        )
    except ValueError as error:
        raise ValueError(f"{path}: {error}; " + _HOW_TO_MAKE) from None


def _read_safetensors(path: Path) -> tuple[dict, dict[str, Tensor]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as error:  # safetensors raises its own error types
        raise ValueError(f"{path} is not a readable safetensors file: {error}") from None
    return metadata, tensors


def _read_json(path: Path) -> tuple[dict, dict[str, object]]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise ValueError(f"{path} must hold a JSON object")
    tensor_names = (*_TENSOR_NAMES, "freq_scale")
    tensors = {name: document[name] for name in tensor_names if name in document}
    metadata = {k: v for k, v in document.items() if k not in tensor_names}
    return metadata, tensors


def load_stats(path: str | Path) -> TriAttentionStats:
    """Read stats written by ``save_stats``; a missing, unreadable or malformed file is a
    ``ValueError``/``FileNotFoundError`` naming the file, the field and how to make one."""
    path = Path(path)
    if path.suffix in _PICKLE_SUFFIXES:
        raise ValueError(
            f"refusing to load {path}: pickle-based files can run code when loaded; "
            f"stats must be .safetensors or .json ({_HOW_TO_MAKE})"
        )
    if not path.exists():
        raise FileNotFoundError(f"triattention stats file {path} does not exist; " + _HOW_TO_MAKE)
    if not path.is_file():
        raise ValueError(f"triattention stats file {path} is not a file; " + _HOW_TO_MAKE)
    if path.suffix not in (".safetensors", ".json"):
        raise ValueError(f"stats file {path} must end in .safetensors or .json")
    try:
        read = _read_safetensors if path.suffix == ".safetensors" else _read_json
        metadata, tensors = read(path)
    except OSError as error:
        raise ValueError(f"cannot read stats file {path}: {error.strerror}") from None
    return _from_parts(metadata, tensors, path)
