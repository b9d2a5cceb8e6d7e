"""Any architecture over SGLang's paged KV pool: transformers' own model of it, whose
attention reads and writes the pool through transformers' attention interface.

``PagedModel`` keeps ``PagedLlama``'s contract (``forward(token_ids, positions,
write_slots, context_slots, context_positions, kv, allowed, capture_queries, tier)``)
for every architecture transformers runs, so the CPU reference loop, the decode-time
perplexity and the tier's frontier (everything driven by ``srt.cpu_driver``) run
Gemma 3 or Qwen3 as they run a Llama. Everything but the attention is the model's own
code (embeddings and their scaling, norms, biases, q/k norms, RoPE at the explicit
logical ``position_ids``, MLP or MoE, logits); each attention layer, in
``_paged_attention``:

    write       the step's K/V at ``write_slots`` of the layer's pool buffers
    keys        the request's context ``context_slots`` (the write included), masked
                causally by logical position, by ``allowed``, and for a windowed layer
                to positions q - W .. q (SGLang's convention: ``srt.windows``)
    tier        at full-attention layers only, merged by log-sum-exp with the query's
                attention over the request's tier (as SGLang's engine does)
    capture     the post-RoPE queries, per layer, for the query-reading scorers

Its logits equal ``PagedLlama``'s on a Llama and transformers' own on the full cache
(``tests/test_paged_model.py``); soft-capping of attention logits is not applied, as in
SGLang's transformers backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from sglang_evict.models.reference_model import KVBuffers, PagedLlama, TierContext, merge_tier
from sglang_evict.srt.windows import layer_windows

ATTENTION_IMPLEMENTATION = "sglang_evict_paged"


@dataclass
class _Step:
    write_slots: Tensor
    context_slots: Tensor
    context_positions: Tensor
    positions: Tensor
    kv: KVBuffers
    allowed: Tensor | None
    capture: list[Tensor] | None
    tier: TierContext | None
    near: dict = field(default_factory=dict)  # window -> the context indices it can see


_ACTIVE: list[tuple[PagedModel, _Step]] = []


def _paged_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    if not _ACTIVE:
        raise RuntimeError("the paged attention ran outside PagedModel.forward")
    model, step = _ACTIVE[-1]
    return model.attend(step, module, query, key, value, scaling), None


class PagedModel:
    """``model`` (a transformers causal LM) over a paged KV pool (module docstring)."""

    def __init__(self, model, *, windows: tuple[int, ...] | None = None) -> None:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_IMPLEMENTATION, _paged_attention)
        self.model = model.eval()
        self.model.set_attn_implementation(ATTENTION_IMPLEMENTATION)
        config = getattr(model.config, "text_config", None) or model.config
        if getattr(config, "kv_lora_rank", None):
            raise ValueError(
                f"PagedModel keeps K and V per head in an MHA pool; "
                f"{type(model).__name__} is MLA (its latent rows' proof runs in SGLang's "
                f"engine: tests/test_engine_mla.py)"
            )
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", self.num_heads)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.dtype = next(model.parameters()).dtype
        self.windows = tuple(windows) if windows is not None else layer_windows(config)

    @torch.no_grad()
    def forward(
        self,
        token_ids: Tensor,
        positions: Tensor,
        write_slots: Tensor,
        context_slots: Tensor,
        context_positions: Tensor,
        kv: KVBuffers,
        allowed: Tensor | None = None,
        capture_queries: list[Tensor] | None = None,
        tier: TierContext | None = None,
    ) -> Tensor:
        """Logits ``[1, vocab]`` of the last of ``T`` new tokens of one request
        (``PagedLlama.forward``'s arguments and meaning; every caller reads the last
        token's, and over a 262k-token vocabulary a prompt's other logits would cost
        more than its forward)."""
        step = _Step(
            write_slots,
            context_slots,
            context_positions,
            positions,
            kv,
            allowed,
            capture_queries,
            tier if tier is not None and int(tier.num_groups[0]) > 0 else None,
        )
        device = next(self.model.parameters()).device
        _ACTIVE.append((self, step))
        try:
            out = self.model(
                input_ids=token_ids[None].to(device),
                position_ids=positions[None].to(device, torch.int64),
                use_cache=False,
                logits_to_keep=1,
            )
        finally:
            _ACTIVE.pop()
        return out.logits[0]

    def attend(self, step: _Step, module, query, key, value, scaling) -> Tensor:
        layer = int(module.layer_idx)
        k_buffer, v_buffer = step.kv.k[layer], step.kv.v[layer]
        k_buffer[step.write_slots] = key[0].transpose(0, 1).to(k_buffer.dtype)
        v_buffer[step.write_slots] = value[0].transpose(0, 1).to(v_buffer.dtype)
        q = query[0]  # [heads, T, D]
        if step.capture is not None:
            step.capture.append(q.transpose(0, 1).clone())
        window = self.windows[layer]
        slots, context_positions = step.context_slots, step.context_positions
        allowed = step.allowed
        if window >= 0:  # only the keys a windowed layer can see (positions q - W .. q)
            near = step.near.get(window)
            if near is None:
                near = step.near[window] = torch.nonzero(
                    context_positions >= int(step.positions.min()) - window
                ).flatten()
            slots, context_positions = slots[near], context_positions[near]
            allowed = None if allowed is None else allowed[near]
        keys = k_buffer[slots].to(q.dtype)  # [N, kv_heads, D]
        values = v_buffer[slots].to(q.dtype)
        heads, tokens, dim = q.shape
        grouped = q.view(self.num_kv_heads, heads // self.num_kv_heads, tokens, dim)
        scale = scaling if scaling is not None else self.head_dim**-0.5
        visible = context_positions[None, :] <= step.positions[:, None]  # [T, N]
        if allowed is not None:
            visible = visible & allowed[None, :]
        if window >= 0:
            visible = visible & (context_positions[None, :] >= step.positions[:, None] - window)
        scores = torch.einsum("kgtd,nkd->kgtn", grouped, keys).reshape(heads, tokens, -1)
        scores = (scores * scale).masked_fill(~visible[None], float("-inf"))
        weights = torch.softmax(scores, dim=-1).view(*grouped.shape[:3], -1)
        out = torch.einsum("kgtn,nkd->tkgd", weights, values).reshape(tokens, heads, dim)
        if step.tier is not None and window < 0:
            out = merge_tier(q, scores, out, step.tier, layer, scale)
        return out[None]  # [1, T, heads, D], as transformers' attention functions


def paged_model(hf_model) -> PagedLlama | PagedModel:
    """The paged model the reference path runs for ``hf_model``: ``PagedLlama`` for a
    Llama (its own forward, what the project's figures were measured with), else the
    architecture-generic ``PagedModel``."""
    if type(hf_model).__name__ == "LlamaForCausalLM":
        return PagedLlama(hf_model)
    return PagedModel(hf_model)
