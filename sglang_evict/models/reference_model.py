"""A CPU reference model whose attention reads and writes a paged KV pool.

``PagedLlama`` runs an HF ``LlamaForCausalLM`` (RoPE, GQA, RMSNorm, SwiGLU: its own
modules and weights) but keeps no cache of its own: each layer writes the new tokens'
K/V (after RoPE) into the pool's per-layer buffers at given slots and attends over
given slots, as SGLang's attention backends do through ``req_to_token``. Each context
entry carries its logical position; a query attends to entries at positions <= its
own (and, for masked references, only to allowed entries).

This is the oracle of the eviction tests and the engine of ``sglang-evict demo``; it
is not a serving path (one request at a time, plain torch attention).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def build_tiny_llama(
    *,
    seed: int = 0,
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    rope_theta: float = 10000.0,
    dtype: torch.dtype = torch.float32,
):
    """A random-weight Llama-architecture model (seeded, deterministic)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=8192,
        rope_theta=rope_theta,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Random init keeps logits nearly flat; a larger spread makes greedy choices decisive.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.to(dtype).eval()


@dataclass(frozen=True)
class TierContext:
    """One request's quantized tier for a forward: the arena's per-layer stores, the
    request's group slots and the format (``sglang_evict.tier.arena``). Every tier
    token precedes every query of a decode step (a pass demotes only tokens it holds)."""

    stores: Sequence[object]  # sglang_evict_kernels.tier_format.TierStore per layer
    group_table: Tensor  # int32 [1, groups]
    num_groups: Tensor  # int32 [1]
    fmt: object  # TierFormat


@dataclass
class KVBuffers:
    """Per-layer K and V buffers ``[slots, kv_heads, head_dim]`` (SGLang's MHA layout)."""

    k: Sequence[Tensor]
    v: Sequence[Tensor]


class PagedLlama:
    def __init__(self, model) -> None:
        self.model = model.eval()
        config = model.config
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.dtype = next(model.parameters()).dtype

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
        """Logits ``[T, vocab]`` for ``T`` new tokens of one request.

        Args:
            token_ids, positions, write_slots: ``[T]`` new tokens, their logical
                positions, and the slots their K/V go to.
            context_slots, context_positions: ``[N]`` the request's KV after the write
                (it includes ``write_slots``) and each entry's logical position.
            allowed: optional bool ``[N]``; False entries are masked out (references).
            capture_queries: if given, each layer appends its post-RoPE queries
                ``[T, heads, head_dim]`` (for query-reading scorers).
            tier: the request's quantized tier: each layer's attention over the
                context is merged (log-sum-exp) with its attention over the tier
                (``sglang_evict_kernels.tier_attention``).
        """
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        inner = self.model.model
        hidden = inner.embed_tokens(token_ids)[None]  # [1, T, hidden]
        position_ids = positions[None].to(torch.int64)
        cos, sin = inner.rotary_emb(hidden, position_ids)
        visible = context_positions[None, :] <= positions[:, None]  # [T, N] causal
        if allowed is not None:
            visible = visible & allowed[None, :]
        scale = 1.0 / math.sqrt(self.head_dim)
        group = self.num_heads // self.num_kv_heads
        num_tokens = token_ids.numel()
        for layer_index, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(1, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(1, num_tokens, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(1, num_tokens, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k_buffer, v_buffer = kv.k[layer_index], kv.v[layer_index]
            k_buffer[write_slots] = k[0].transpose(0, 1).to(k_buffer.dtype)
            v_buffer[write_slots] = v[0].transpose(0, 1).to(v_buffer.dtype)
            if capture_queries is not None:
                capture_queries.append(q[0].transpose(0, 1).clone())
            keys = k_buffer[context_slots].to(self.dtype).repeat_interleave(group, dim=1)
            values = v_buffer[context_slots].to(self.dtype).repeat_interleave(group, dim=1)
            scores = torch.einsum("htd,nhd->htn", q[0], keys) * scale
            scores = scores.masked_fill(~visible[None], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out = torch.einsum("htn,nhd->thd", probs, values)
            if tier is not None and int(tier.num_groups[0]) > 0:
                out = merge_tier(q[0], scores, out, tier, layer_index, scale)
            out = out.reshape(1, num_tokens, -1)
            hidden = hidden + attn.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(inner.norm(hidden))[0]


def merge_tier(
    q: Tensor, scores: Tensor, out: Tensor, tier: TierContext, layer: int, scale: float
) -> Tensor:
    """``out`` ``[T, heads, head_dim]`` (attention over the context, whose masked
    ``scores`` are ``[heads, T, N]``) merged with each query's attention over the
    tier."""
    from sglang_evict_kernels.tier_attention import (
        merge_attention_states,
        tier_attention_reference,
    )

    num_tokens = q.shape[1]
    queries = q.transpose(0, 1)  # [T, heads, head_dim]
    o_tier, lse_tier = tier_attention_reference(
        queries,
        tier.stores[layer],
        tier.group_table.expand(num_tokens, -1),
        tier.num_groups.expand(num_tokens),
        tier.fmt,
        sm_scale=scale,
    )
    lse_context = torch.logsumexp(scores.float(), dim=-1).transpose(0, 1)  # [T, heads]
    merged, _ = merge_attention_states(out.float(), lse_context, o_tier, lse_tier)
    return merged.to(out.dtype)
