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
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

STATS_FORMAT = "sglang-evict/triattention-stats"
STATS_VERSION = 1
ROPE_STYLES = ("half", "interleaved")
_TENSOR_NAMES = ("q_mean_real", "q_mean_imag", "q_abs_mean")
_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
_HOW_TO_MAKE = (
    "create one with `sglang-evict calibrate --model-path DIR --text FILE --out stats.safetensors`"
)


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
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta={self.rope_theta} must be positive")
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

    @property
    def num_layers(self) -> int:
        return self.q_mean_real.shape[0]

    @property
    def num_heads(self) -> int:
        return self.q_mean_real.shape[1]

    def check_model(
        self,
        *,
        num_layers: int,
        num_q_heads: int,
        head_dim: int,
        rope_style: str | None = None,
        rope_theta: float | None = None,
    ) -> None:
        """Raise ``ValueError`` naming every mismatch between these stats and a model."""
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
            problems.append(f"rope_theta: stats have {self.rope_theta}, model has {rope_theta}")
        if problems:
            raise ValueError(
                "triattention stats do not match the model (" + "; ".join(problems) + "); "
                "re-run calibration for this model: " + _HOW_TO_MAKE
            )


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


def _from_parts(metadata: dict, tensors: dict[str, Tensor], path: Path) -> TriAttentionStats:
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
    head_dim = int(metadata["head_dim"])
    freq_scale = tensors.get("freq_scale", torch.ones(head_dim // 2))
    return TriAttentionStats(
        q_mean_real=tensors["q_mean_real"].float(),
        q_mean_imag=tensors["q_mean_imag"].float(),
        q_abs_mean=tensors["q_abs_mean"].float(),
        freq_scale=freq_scale.float(),
        rope_style=str(metadata["rope_style"]),
        rope_theta=float(metadata["rope_theta"]),
        head_dim=head_dim,
    )


def load_stats(path: str | Path) -> TriAttentionStats:
    """Read stats written by ``save_stats``; clear errors for missing or wrong files."""
    path = Path(path)
    if path.suffix in _PICKLE_SUFFIXES:
        raise ValueError(
            f"refusing to load {path}: pickle-based files can run code when loaded; "
            f"stats must be .safetensors or .json ({_HOW_TO_MAKE})"
        )
    if not path.is_file():
        raise FileNotFoundError(f"triattention stats file {path} does not exist; " + _HOW_TO_MAKE)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = dict(handle.metadata() or {})
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        except Exception as error:  # safetensors raises its own error types
            raise ValueError(f"{path} is not a readable safetensors file: {error}") from error
    elif path.suffix == ".json":
        try:
            document = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON: {error}") from error
        if not isinstance(document, dict):
            raise ValueError(f"{path} must hold a JSON object")
        tensor_names = (*_TENSOR_NAMES, "freq_scale")
        tensors = {
            name: torch.tensor(document[name], dtype=torch.float32)
            for name in tensor_names
            if name in document
        }
        metadata = {k: v for k, v in document.items() if k not in tensor_names}
    else:
        raise ValueError(f"stats file {path} must end in .safetensors or .json")
    return _from_parts(metadata, tensors, path)
