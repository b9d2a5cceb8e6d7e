"""The quantized tier's storage format (KIVI's layout, OTT's outlier tokens) and its
torch reference quantizer.

The tier holds whole groups of ``G`` consecutive tokens of one request (per layer):

* **keys per channel**: for each (group, KV head, channel) an asymmetric range over the
  group's tokens, ``scale = (max - min) / (2**bits - 1)``, ``zero = min``;
* **values per token**: for each (token, KV head, block of ``C`` channels) the same
  over those channels;
* **outlier tokens** (OTT): per (group, KV head) the ``n_out`` tokens of smallest key L1
  norm are left out of the group's key ranges and kept in full precision (key and
  value); their slots still hold codes, which nothing reads. OTT finds none in a model's
  first layers, so the mechanism asks for none there (``outliers_for_layer``).

Codes are ``bits``-bit unsigned integers, ``code = floor((x - zero) / scale + 0.5)``
clamped to ``[0, 2**bits - 1]`` (0 where the range is empty), computed in float32 from
the scale and zero as stored (``scale_dtype``: float16 or bfloat16), so the stored
values alone give back what attention reads: ``x' = code * scale + zero`` in float32.
A row (one token's ``D`` codes of one KV head) is made of 32-bit words that each hold
whole codes, so that a GPU decodes a code with a shift and a mask and no code crosses a
word (exactly ``bits / 8`` bytes per element, for 2, 3, 4 and 8 bits alike):

* 2, 4 and 8 bits: one little-endian bit stream, code ``i`` at bit ``bits * i`` (word
  ``i // (32 / bits)`` holds ``32 / bits`` whole codes);
* 3 bits: two planes, ``D / 4`` bytes of the codes' low two bits (a 2-bit stream, code
  ``i`` at bit ``2 i``) and then ``D / 8`` bytes of their high bit (a 1-bit stream, code
  ``i`` at bit ``i``): ``code = low | high << 2``. Both planes are whole words for every
  supported head dim (``D / 16`` and ``D / 32`` of them).

A row is ``D * bits / 8`` bytes, a multiple of 4 for every supported head dim and width,
so every row starts on a word (``TierStore.check_contiguous`` checks the tensors' start).

Storage of ``S`` group slots (``TierStore``), ``H`` KV heads, head dim ``D``:

    tensor     shape                    dtype          bytes per (group, head)
    k_codes    [S, G, H, D * bits / 8]  uint8          G * D * bits / 8
    k_scale    [S, H, D]                scale_dtype    2 * D          (and k_zero)
    v_codes    [S, G, H, D * bits / 8]  uint8          G * D * bits / 8
    v_scale    [S, G, H, D / C]         scale_dtype    2 * G * D / C  (and v_zero)
    out_index  [S, H, n_out]            int16          2 * n_out
    out_k      [S, H, n_out, D]         full dtype     n_out * D * full bytes (and out_v)

so a token and KV head cost ``2 * D * bits / 8 + 2 * s * D / G + 2 * s * D / C`` bytes
plus ``n_out * (2 * D * f + 2) / G`` for the outliers (``s`` the scale dtype's bytes,
``f`` the full dtype's): ``TierFormat.bytes_per_token_head``, which the storage's
tensors are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # 256: Gemma 2 and 3
SCALE_DTYPES = (torch.float16, torch.bfloat16)
PACK_CHUNK = 8  # codes per chunk of ``bits`` bytes (of one bit stream)
WORD_BYTES = 4  # a row's words, and the alignment the kernels read them at
# OTT found no outlier tokens in the first two layers (its ablation, section 4).
OUTLIER_FIRST_LAYER = 2


@dataclass(frozen=True)
class TierFormat:
    """One tier's format. Refuses, naming the knob, what the kernels cannot hold."""

    bits: int = 3
    group_tokens: int = 32  # G: tokens quantized together (keys' ranges span them)
    value_group_channels: int = 32  # C: channels sharing a value range (per token)
    outlier_tokens: int = 0  # n_out per (group, KV head), in full precision
    head_dim: int = 128
    scale_dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"tier bits {self.bits} not supported; choose one of {SUPPORTED_BITS}")
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"head dim {self.head_dim} not supported by the tier's kernels; "
                f"supported: {SUPPORTED_HEAD_DIMS}"
            )
        if self.group_tokens < 8 or self.group_tokens & (self.group_tokens - 1):
            raise ValueError(
                f"tier group of {self.group_tokens} tokens: a power of two of at least 8"
            )
        c = self.value_group_channels
        if c < 8 or c & (c - 1) or self.head_dim % c:
            raise ValueError(
                f"value group of {c} channels: a power of two of at least 8 dividing the "
                f"head dim {self.head_dim}"
            )
        if not 0 <= self.outlier_tokens < self.group_tokens // 2:
            raise ValueError(
                f"{self.outlier_tokens} outlier tokens per group: between 0 and "
                f"{self.group_tokens // 2 - 1} for groups of {self.group_tokens}"
            )
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale dtype {self.scale_dtype}: one of {SCALE_DTYPES}")

    @property
    def levels(self) -> int:
        return 2**self.bits - 1

    @property
    def packed_dim(self) -> int:
        """Bytes of one token's ``head_dim`` codes."""
        return self.head_dim * self.bits // PACK_CHUNK

    def outliers_for_layer(self, layer: int) -> int:
        return self.outlier_tokens if layer >= OUTLIER_FIRST_LAYER else 0

    def bytes_per_token_head(self, full_dtype: torch.dtype, outliers: int | None = None) -> float:
        """The formula of the module docstring: bytes one token of one KV head costs."""
        d, g, c = self.head_dim, self.group_tokens, self.value_group_channels
        s = torch.empty((), dtype=self.scale_dtype).element_size()
        f = torch.empty((), dtype=full_dtype).element_size()
        n_out = self.outlier_tokens if outliers is None else outliers
        return 2 * d * self.bits / 8 + 2 * s * d / g + 2 * s * d / c + n_out * (2 * d * f + 2) / g

    def full_bytes_per_token_head(self, full_dtype: torch.dtype) -> int:
        return 2 * self.head_dim * torch.empty((), dtype=full_dtype).element_size()


@dataclass
class TierStore:
    """``S`` group slots of one layer (the module docstring's table)."""

    k_codes: Tensor
    k_scale: Tensor
    k_zero: Tensor
    v_codes: Tensor
    v_scale: Tensor
    v_zero: Tensor
    out_index: Tensor
    out_k: Tensor
    out_v: Tensor

    @classmethod
    def empty(
        cls,
        fmt: TierFormat,
        num_slots: int,
        kv_heads: int,
        full_dtype: torch.dtype,
        device: str | torch.device = "cpu",
        outliers: int | None = None,
    ) -> TierStore:
        s, g, h, d = num_slots, fmt.group_tokens, kv_heads, fmt.head_dim
        n_out = fmt.outlier_tokens if outliers is None else outliers
        sd = fmt.scale_dtype

        def z(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            k_codes=z(s, g, h, fmt.packed_dim, dtype=torch.uint8),
            k_scale=z(s, h, d, dtype=sd),
            k_zero=z(s, h, d, dtype=sd),
            v_codes=z(s, g, h, fmt.packed_dim, dtype=torch.uint8),
            v_scale=z(s, g, h, d // fmt.value_group_channels, dtype=sd),
            v_zero=z(s, g, h, d // fmt.value_group_channels, dtype=sd),
            out_index=z(s, h, n_out, dtype=torch.int16),
            out_k=z(s, h, n_out, d, dtype=full_dtype),
            out_v=z(s, h, n_out, d, dtype=full_dtype),
        )

    def tensors(self) -> dict[str, Tensor]:
        return dict(vars(self))

    def kernel_args(self) -> tuple[Tensor, ...]:
        """The tensors in the order every kernel takes them (the module docstring's)."""
        return (
            self.k_codes,
            self.k_scale,
            self.k_zero,
            self.v_codes,
            self.v_scale,
            self.v_zero,
            self.out_index,
            self.out_k,
            self.out_v,
        )

    def check_contiguous(self) -> None:
        """The kernels index the store's tensors as dense arrays, and read codes by words."""
        loose = [name for name, t in self.tensors().items() if not t.is_contiguous()]
        if loose:
            raise ValueError(f"tier store tensors must be contiguous: {loose} are not")
        off = [
            name for name in ("k_codes", "v_codes") if getattr(self, name).data_ptr() % WORD_BYTES
        ]
        if off:
            raise ValueError(
                f"tier store codes must start on a {WORD_BYTES}-byte word (the kernels read "
                f"whole words): {off} do not"
            )

    @property
    def num_slots(self) -> int:
        return self.k_codes.shape[0]

    @property
    def outliers(self) -> int:
        return self.out_index.shape[-1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def write(self, slots: Tensor, groups: TierStore) -> None:
        """Store ``groups`` (a ``TierStore`` of ``len(slots)`` groups) at ``slots``."""
        for name, tensor in self.tensors().items():
            tensor[slots] = getattr(groups, name)

    def take(self, slots: Tensor) -> TierStore:
        return TierStore(**{name: t[slots] for name, t in self.tensors().items()})


def _pack_stream(codes: Tensor, bits: int) -> Tensor:
    """uint8 ``[..., D * bits / 8]``: codes ``[..., D]`` as one little-endian bit stream,
    code ``i`` at bit ``bits * i`` (eight codes a chunk of ``bits`` bytes)."""
    if bits == 8:
        return codes.to(torch.uint8)
    *lead, d = codes.shape
    chunks = codes.to(torch.int64).reshape(*lead, d // PACK_CHUNK, PACK_CHUNK)
    shifts = torch.arange(PACK_CHUNK, device=codes.device) * bits
    word = (chunks << shifts).sum(dim=-1)  # at most 8 * bits <= 32 bits
    byte_shifts = torch.arange(bits, device=codes.device) * 8
    packed = (word.unsqueeze(-1) >> byte_shifts) & 0xFF
    return packed.reshape(*lead, d * bits // PACK_CHUNK).to(torch.uint8)


def _unpack_stream(packed: Tensor, bits: int) -> Tensor:
    """int32 codes from ``_pack_stream``'s bytes. A chunk's ``bits`` bytes fit an int32
    word (4 bytes at most: the top code's sign-extended bits are masked off), which
    runs about twice as fast as int64 on CPU."""
    if bits == 8:
        return packed.to(torch.int32)
    *lead, nbytes = packed.shape
    chunks = packed.reshape(*lead, nbytes // bits, bits).to(torch.int32)
    word = chunks[..., 0]
    for i in range(1, bits):
        word = word | (chunks[..., i] << (8 * i))
    shifts = torch.arange(PACK_CHUNK, device=packed.device, dtype=torch.int32) * bits
    codes = (word.unsqueeze(-1) >> shifts) & (2**bits - 1)
    return codes.reshape(*lead, nbytes // bits * PACK_CHUNK)


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """uint8 ``[..., D * bits / 8]`` from codes ``[..., D]`` (values below ``2**bits``),
    in the module docstring's row layout."""
    if bits != 3:
        return _pack_stream(codes, bits)
    codes = codes.to(torch.int64)
    return torch.cat([_pack_stream(codes & 3, 2), _pack_stream(codes >> 2, 1)], dim=-1)


def unpack_codes(packed: Tensor, bits: int, dtype: torch.dtype = torch.int64) -> Tensor:
    """Codes ``[..., D]`` (``dtype``) from ``pack_codes``'s bytes."""
    if bits != 3:
        return _unpack_stream(packed, bits).to(dtype)
    d = packed.shape[-1] * 8 // 3
    low, high = packed[..., : d // 4], packed[..., d // 4 :]
    return (_unpack_stream(low, 2) | (_unpack_stream(high, 1) << 2)).to(dtype)


def encode(x: Tensor, lo: Tensor, hi: Tensor, levels: int, scale_dtype: torch.dtype):
    """``(codes int64, scale, zero)`` of float32 ``x`` over the ranges ``[lo, hi]``
    (broadcast to ``x``): the stored scale and zero, and codes computed from them."""
    scale = ((hi - lo) / levels).to(scale_dtype)
    zero = lo.to(scale_dtype)
    s, z = scale.float(), zero.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.floor((x - z) / safe + 0.5).clamp(0, levels)
    codes = torch.where(s > 0, codes, torch.zeros_like(codes))
    return codes.to(torch.int64), scale, zero


def outlier_tokens_reference(keys: Tensor, n_out: int) -> Tensor:
    """int64 ``[N, H, n_out]``: per (group, head) of ``keys [N, G, H, D]`` the tokens of
    smallest key L1 norm (summed in float64), ties to the earlier token, ascending."""
    norms = keys.double().abs().sum(dim=-1)  # [N, G, H]
    order = torch.argsort(norms, dim=1, stable=True)[:, :n_out]  # [N, n_out, H]
    return order.transpose(1, 2).sort(dim=-1).values.contiguous()


def quantize_groups_reference(
    keys: Tensor, values: Tensor, fmt: TierFormat, outliers: int | None = None
) -> TierStore:
    """The tier's groups of ``keys``/``values`` ``[N, G, H, D]`` (post-RoPE keys, any
    float dtype): the reference every kernel is held to, bit for bit."""
    check_groups(keys, values, fmt)
    n, g, h, d = keys.shape
    n_out = fmt.outlier_tokens if outliers is None else outliers
    kf, vf = keys.float(), values.float()
    index = outlier_tokens_reference(keys, n_out)  # [N, H, n_out]
    is_out = torch.zeros(n, h, g, dtype=torch.bool, device=keys.device)
    is_out.scatter_(2, index, True)
    is_out = is_out.transpose(1, 2).unsqueeze(-1)  # [N, G, H, 1]
    inf = torch.tensor(float("inf"), device=keys.device)
    lo = torch.where(is_out, inf, kf).amin(dim=1)  # [N, H, D]: over the non-outliers
    hi = torch.where(is_out, -inf, kf).amax(dim=1)
    k_codes, k_scale, k_zero = encode(
        kf, lo.unsqueeze(1), hi.unsqueeze(1), fmt.levels, fmt.scale_dtype
    )
    c = fmt.value_group_channels
    blocks = vf.reshape(n, g, h, d // c, c)
    v_codes, v_scale, v_zero = encode(
        blocks,
        blocks.amin(dim=-1, keepdim=True),
        blocks.amax(dim=-1, keepdim=True),
        fmt.levels,
        fmt.scale_dtype,
    )
    gather = index.unsqueeze(-1).expand(n, h, n_out, d)  # [N, H, n_out, D]
    return TierStore(
        k_codes=pack_codes(k_codes, fmt.bits),
        k_scale=k_scale.squeeze(1),
        k_zero=k_zero.squeeze(1),
        v_codes=pack_codes(v_codes.reshape(n, g, h, d), fmt.bits),
        v_scale=v_scale.squeeze(-1),
        v_zero=v_zero.squeeze(-1),
        out_index=index.to(torch.int16),
        out_k=keys.transpose(1, 2).gather(2, gather).contiguous(),
        out_v=values.transpose(1, 2).gather(2, gather).contiguous(),
    )


def dequantize_groups_reference(store: TierStore, fmt: TierFormat) -> tuple[Tensor, Tensor]:
    """float32 keys and values ``[N, G, H, D]`` as attention reads them: codes times
    scale plus zero, the outlier tokens' own rows in their place."""
    n, g, h, _ = store.k_codes.shape
    d, c = fmt.head_dim, fmt.value_group_channels
    k = unpack_codes(store.k_codes, fmt.bits, torch.float32)
    k = torch.addcmul(store.k_zero.float().unsqueeze(1), k, store.k_scale.float().unsqueeze(1))
    v = unpack_codes(store.v_codes, fmt.bits, torch.float32).reshape(n, g, h, d // c, c)
    v = torch.addcmul(store.v_zero.float().unsqueeze(-1), v, store.v_scale.float().unsqueeze(-1))
    v = v.reshape(n, g, h, d)
    if store.outliers:
        index = store.out_index.long()  # [N, H, n_out]
        rows = index.unsqueeze(-1).expand(-1, -1, -1, d)
        k = k.transpose(1, 2).scatter(2, rows, store.out_k.float()).transpose(1, 2)
        v = v.transpose(1, 2).scatter(2, rows, store.out_v.float()).transpose(1, 2)
    return k, v


def check_groups(keys: Tensor, values: Tensor, fmt: TierFormat) -> None:
    if keys.dim() != 4 or keys.shape != values.shape:
        raise ValueError(
            f"keys and values must be [groups, group tokens, kv heads, head dim] alike; "
            f"got {tuple(keys.shape)} and {tuple(values.shape)}"
        )
    if keys.shape[1] != fmt.group_tokens or keys.shape[3] != fmt.head_dim:
        raise ValueError(
            f"groups of {keys.shape[1]} tokens with head dim {keys.shape[3]} do not fit the "
            f"tier format (groups of {fmt.group_tokens}, head dim {fmt.head_dim})"
        )


def check_quantize_inputs(
    store: TierStore,
    group_slots: Tensor,
    k_buffer: Tensor,
    v_buffer: Tensor,
    token_slots: Tensor,
    fmt: TierFormat,
) -> None:
    if k_buffer.shape != v_buffer.shape or k_buffer.dim() != 3:
        raise ValueError(
            f"k_buffer and v_buffer must be [tokens, kv heads, head dim] alike; got "
            f"{tuple(k_buffer.shape)} and {tuple(v_buffer.shape)}"
        )
    if k_buffer.shape[1:] != (*store.k_codes.shape[2:3], fmt.head_dim):
        raise ValueError(
            f"buffers of {k_buffer.shape[1]} heads x {k_buffer.shape[2]} do not fit a store "
            f"of {store.k_codes.shape[2]} heads x {fmt.head_dim}"
        )
    if token_slots.dim() != 2 or token_slots.shape != (group_slots.numel(), fmt.group_tokens):
        raise ValueError(
            f"token_slots must be [{group_slots.numel()} groups, {fmt.group_tokens} tokens]; "
            f"got {tuple(token_slots.shape)}"
        )
