"""The architecture-generic reference: any model's own transformers implementation on
the full cache, each decode step attending only to what a run kept.

SGLang's engine under eviction must generate exactly what this generates (float32,
greedy) for the same prompt and the same kept sets. What it checks is the mechanism:
that compaction moved the right K/V, that every token was generated at its logical
RoPE position, that a windowed layer attended exactly the kept tokens inside its window
by logical position, and that the tier's tokens were attended at their quantized
values; the scorers' choices are the run's own (their reference is the pure policy,
``passes.selection``). It is built on transformers' attention interface, so it runs
whatever architecture transformers runs, with no model code of its own:

    transformers' model (embeddings, norms, q/k/v projections, biases, q/k norms, RoPE
    at explicit ``position_ids``, MLP or MoE, logits)
      every attention layer -> ``_masked_attention`` (registered as
      ``ATTENTION_IMPLEMENTATION``): keeps the layer's full K/V by position, and
      attends query position q to

        keys(q) = {p <= q : p kept at q} ∩ window(layer, q)
        kept at q   the full-precision positions of the last state whose
                    ``next_position`` <= q, and every position from there to q
                    (nothing before the first state: the whole causal prefix)
        window      every position where the layer has none; q - W .. q (W + 1 keys,
                    SGLang's convention, not transformers' W) for a window of W
        tier        the state's tier groups, at full-attention layers only: their K/V
                    quantized and dequantized by the tier's reference quantizer, as
                    the tier holds them

SGLang's conventions are followed where they differ from transformers' own: the
window's width (``srt.windows.layer_windows``: SGLang's transformers backend windows exactly the
layers ``layer_types`` names ``sliding_attention``, with the config's
``sliding_window``; a Mistral v0.1 ``sliding_window`` with no ``layer_types`` gets no
window there) and no attention logit soft-capping (that backend's ``RadixAttention`` is
built without a logit cap: Gemma 2's ``attn_logit_softcapping`` is not applied).

A run's kept sets come from SGLang's engine itself (``SGLANG_EVICT_LOG_KEPT=1``: each
pass's log record lists, per request, the logical positions it keeps in full
precision, the positions of each tier group and the next position;
``traces_from_pass_records``).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sglang_evict.srt.windows import layer_windows

ATTENTION_IMPLEMENTATION = "sglang_evict_masked"


@dataclass(frozen=True)
class KeptState:
    """What one request holds from a pass on (until the next pass)."""

    next_position: int  # the first query position this state applies to
    full_positions: tuple[int, ...]  # held in full precision (all below next_position)
    tier_groups: tuple[tuple[int, ...], ...] = ()  # each tier group's positions


@dataclass
class RequestTrace:
    """A request's states, by ``next_position``."""

    states: list[KeptState] = field(default_factory=list)

    def add(self, state: KeptState) -> None:
        if self.states and state.next_position <= self.states[-1].next_position:
            raise ValueError(
                f"a pass at position {state.next_position} after one at "
                f"{self.states[-1].next_position}: states must come in position order"
            )
        self.states.append(state)

    def at(self, position: int) -> KeptState | None:
        """The state a query at ``position`` sees (None: before the first pass)."""
        starts = [s.next_position for s in self.states]
        index = bisect.bisect_right(starts, position) - 1
        return self.states[index] if index >= 0 else None


def traces_from_pass_records(records: Iterable[dict]) -> dict[str, RequestTrace]:
    """Each request's trace from the engine's pass log records (``parse_pass_lines`` of
    a log written with ``SGLANG_EVICT_LOG_KEPT=1``)."""
    traces: dict[str, RequestTrace] = {}
    for record in records:
        for request in record["requests"]:
            if "kept_positions" not in request:
                raise ValueError(
                    "the pass records carry no kept positions: start the engine with "
                    "SGLANG_EVICT_LOG_KEPT=1 (and SGLANG_EVICT_LOG_PASSES=1)"
                )
            traces.setdefault(request["rid"], RequestTrace()).add(
                KeptState(
                    next_position=int(request["next_position"]),
                    full_positions=tuple(request["kept_positions"]),
                    tier_groups=tuple(tuple(g) for g in request.get("tier_positions", ())),
                )
            )
    return traces


class _Run:
    """One request's generation: each layer's full K/V by position, and the masks."""

    def __init__(self, windows, trace: RequestTrace | None, tier_format, capacity: int):
        self.windows = windows
        self.trace = trace
        self.tier_format = tier_format
        self.capacity = capacity
        self.keys: dict[int, Tensor] = {}  # layer -> [kv heads, capacity, D]
        self.values: dict[int, Tensor] = {}
        self.length = 0  # positions stored (every layer alike, after a forward)
        self.positions: Tensor | None = None  # the current forward's query positions
        self._dequantized: dict[tuple[int, tuple[int, ...]], tuple[Tensor, Tensor]] = {}

    def attend(self, module, query: Tensor, key: Tensor, value: Tensor, scaling) -> Tensor:
        if getattr(module, "sinks", None) is not None:
            raise NotImplementedError(
                "attention sinks (GPT-OSS) are not in the masked reference yet"
            )
        layer = int(module.layer_idx)
        b, hq, t, d = query.shape
        if b != 1:
            raise ValueError(f"the masked reference runs one request at a time, got {b}")
        kv_heads = key.shape[1]
        start = int(self.positions[0])
        if start != self.length:
            raise AssertionError(f"layer {layer}: a forward from {start}, {self.length} stored")
        if layer not in self.keys:
            self.keys[layer] = key.new_zeros(kv_heads, self.capacity, key.shape[-1])
            self.values[layer] = value.new_zeros(kv_heads, self.capacity, value.shape[-1])
        end = start + t
        self.keys[layer][:, start:end] = key[0]
        self.values[layer][:, start:end] = value[0]
        keys, values = self.keys[layer][:, :end], self.values[layer][:, :end]
        rows = [self.keys_of(layer, start + i, end) for i in range(t)]
        allowed = torch.stack([row for row, _ in rows]).to(query.device)  # [t, end]
        tier = [groups for _, groups in rows]
        if any(tier) and t > 1:
            raise AssertionError("a forward of several tokens after a pass with a tier")
        if tier[0]:
            keys, values = keys.clone(), values.clone()
            for positions in tier[0]:
                k_deq, v_deq = self.dequantized(layer, positions, keys, values)
                index = torch.tensor(positions, device=keys.device)
                keys[:, index] = k_deq.to(keys.dtype)
                values[:, index] = v_deq.to(values.dtype)
        group = hq // kv_heads
        scale = scaling if scaling is not None else d**-0.5
        k_rep = keys.repeat_interleave(group, dim=0)  # [hq, end, D]
        v_rep = values.repeat_interleave(group, dim=0)
        scores = torch.einsum("htd,hnd->htn", query[0], k_rep) * scale
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        weights = torch.softmax(scores.float(), dim=-1).to(query.dtype)
        out = torch.einsum("htn,hnd->thd", weights, v_rep)
        return out.unsqueeze(0)  # [1, t, hq, D], as transformers' attention functions

    def keys_of(self, layer: int, q_pos: int, width: int) -> tuple[Tensor, list[tuple[int, ...]]]:
        """bool ``[width]``: the positions query ``q_pos`` attends at ``layer`` (none
        after it), and the tier groups among them (attended at their quantized
        values)."""
        allowed = torch.zeros(width, dtype=torch.bool)
        allowed[: q_pos + 1] = True
        tier: list[tuple[int, ...]] = []
        state = None if self.trace is None else self.trace.at(q_pos)
        if state is not None:
            allowed[: state.next_position] = False
            allowed[list(state.full_positions)] = True
        window = self.windows[layer]
        if window >= 0:
            allowed[: max(0, q_pos - window)] = False
        elif state is not None and state.tier_groups:
            tier = list(state.tier_groups)
            for positions in tier:
                if any(p >= state.next_position for p in positions):
                    raise ValueError("a tier group holds a position at or after its pass")
                allowed[list(positions)] = True
        return allowed, tier

    def dequantized(self, layer, positions, keys, values) -> tuple[Tensor, Tensor]:
        """The tier's view of one group at ``layer``: ``[kv heads, G, D]`` keys and
        values quantized and dequantized by the reference quantizer (its outlier tokens
        as the tier keeps them for this layer)."""
        key = (layer, positions)
        if key not in self._dequantized:
            from sglang_evict_kernels.tier_format import (
                dequantize_groups_reference,
                quantize_groups_reference,
            )

            fmt = self.tier_format
            if fmt is None:
                raise ValueError("the trace holds tier groups: give the tier's format")
            index = torch.tensor(positions, device=keys.device)
            k = keys[:, index].transpose(0, 1).unsqueeze(0)  # [1, G, H, D]
            v = values[:, index].transpose(0, 1).unsqueeze(0)
            store = quantize_groups_reference(k, v, fmt, outliers=fmt.outliers_for_layer(layer))
            k_deq, v_deq = dequantize_groups_reference(store, fmt)
            self._dequantized[key] = (k_deq[0].transpose(0, 1), v_deq[0].transpose(0, 1))
        return self._dequantized[key]


_ACTIVE: list[_Run] = []


def _masked_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' attention-function signature; ``attention_mask`` is ignored (the
    run's own masks apply)."""
    if not _ACTIVE:
        raise RuntimeError("the masked reference's attention ran outside MaskedReference")
    return _ACTIVE[-1].attend(module, query, key, value, scaling), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, _masked_attention)


class MaskedReference:
    """``model`` (a transformers causal LM, float32) as the masked full cache.

    ``tier_format``: the server's ``TierFormat`` when its traces hold tier groups;
    ``windows``: each layer's window (default: ``layer_windows`` of the model's config).
    """

    def __init__(self, model, *, tier_format=None, windows: tuple[int, ...] | None = None):
        _register()
        self.model = model.eval()
        self.model.set_attn_implementation(ATTENTION_IMPLEMENTATION)
        self.tier_format = tier_format
        self.windows = tuple(windows) if windows is not None else layer_windows(model.config)

    @classmethod
    def from_folder(cls, path, **kwargs) -> MaskedReference:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        return cls(model, **kwargs)

    @torch.no_grad()
    def prompt_logits(self, prompt: list[int]) -> Tensor:
        """float ``[len(prompt), vocab]``: the logits of one forward over ``prompt`` on
        the full cache (causal, each layer's window)."""
        run = _Run(self.windows, None, self.tier_format, len(prompt))
        device = next(self.model.parameters()).device
        _ACTIVE.append(run)
        try:
            run.positions = torch.arange(len(prompt))
            return self.model(
                input_ids=torch.tensor([prompt], device=device),
                position_ids=run.positions.unsqueeze(0).to(device),
                use_cache=False,
            ).logits[0]
        finally:
            _ACTIVE.pop()

    @torch.no_grad()
    def generate(
        self, prompt: list[int], new_tokens: int, trace: RequestTrace | None = None
    ) -> list[int]:
        """The ``new_tokens`` greedy tokens after ``prompt``, each decode step attending
        to what ``trace`` kept (None: the full cache)."""
        if not prompt or new_tokens < 1:
            raise ValueError("a prompt of at least one token and at least one new token")
        run = _Run(self.windows, trace, self.tier_format, len(prompt) + new_tokens)
        device = next(self.model.parameters()).device
        _ACTIVE.append(run)
        try:
            tokens = list(prompt)
            out: list[int] = []
            step_ids, start = tokens, 0
            while len(out) < new_tokens:
                run.positions = torch.arange(start, start + len(step_ids))
                logits = self.model(
                    input_ids=torch.tensor([step_ids], device=device),
                    position_ids=run.positions.unsqueeze(0).to(device),
                    use_cache=False,
                ).logits
                run.length = start + len(step_ids)
                token = int(logits[0, -1].argmax())
                out.append(token)
                start, step_ids = run.length, [token]
            return out
        finally:
            _ACTIVE.pop()
