"""Sliding-window layers that follow logical positions after compaction.

SGLang's ``torch_native`` backend windows a layer by KV index: at a decode step a
windowed layer of window ``W`` attends the row entries ``seq_len - 1 - W ..
seq_len - 1`` (``TorchNativeAttnBackend._make_sliding_window_mask``). While a request
holds every token that is its positions' window; after a pass the row holds survivors
(in ``hole_fill``'s order, not even in position order), so the last ``W + 1`` entries
reach back further than ``W`` positions and may skip recent ones.

An AFTER hook on ``TorchNativeAttnBackend.forward_decode`` gives every windowed layer
(``layer.sliding_window_size >= 0``) of every request with eviction state its own
window again, by logical position: the request's keys whose positions lie in
``q - W .. q`` (``q`` the new token's), SGLang's own convention (``W + 1`` keys), read
where they lie in the pool. A request no pass has touched keeps the backend's output
(index and position are one there). The tier is read at full-attention layers only
(``srt.tier``): with the recent window at least ``W`` (``server_args`` refuses less),
no tier token lies inside a window.

Other backends (``triton``, FlashInfer, FlashAttention) window by KV index too, inside
their kernels: ``server_args`` refuses models with windowed layers under them.
"""

from __future__ import annotations

import torch

from sglang_evict.srt.active import Active

HOOK_TORCH_NATIVE_DECODE = (
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_decode"
)
_ARGS = ("q", "k", "v", "layer", "forward_batch")
# What each windowed decode did (``get_server_info``'s ``windows``).
CALLS = {"windowed_decode_layers": 0, "requests_rewindowed": 0}


def layer_windows(config) -> tuple[int, ...]:
    """Each layer's sliding window as SGLang's transformers backend gives it (-1: full
    attention): the config's ``sliding_window`` on the layers ``layer_types`` names
    ``sliding_attention``, none elsewhere (``TransformersForCausalLM.
    _create_attention_instances``, SGLang 0.5.17 and 0.5.23)."""
    config = getattr(config, "text_config", None) or config
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window or not types:
        return (-1,) * layers
    return tuple(
        int(window) if i < len(types) and types[i] == "sliding_attention" else -1
        for i in range(layers)
    )


def layer_window(layer) -> int:
    """The layer's sliding window (SGLang's ``sliding_window_size``; -1: none)."""
    if getattr(layer, "is_cross_attention", False):
        return -1
    window = getattr(layer, "sliding_window_size", -1)
    return -1 if window is None else int(window)


def _after_forward_decode(result, backend, *args, **kwargs):
    named = dict(zip(_ARGS, args, strict=False))
    q, layer, forward_batch = (named.get(n, kwargs.get(n)) for n in ("q", "layer", "forward_batch"))
    window = layer_window(layer)
    manager = Active.manager
    if window < 0 or manager is None or not manager.states or forward_batch is None:
        return result
    return rewindow(result, q, layer, forward_batch, backend, manager, window)


def rewindow(o, q, layer, forward_batch, backend, manager, window: int):
    """``o`` with each compacted request's row recomputed over the keys of its logical
    window (host reads: ``torch_native`` is a CPU backend)."""
    CALLS["windowed_decode_layers"] += 1
    by_row = {state.req_pool_idx: rid for rid, state in manager.states.items()}
    rows = forward_batch.req_pool_indices.tolist()
    seq_lens = forward_batch.seq_lens.tolist()
    hq, d, dv = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
    queries = q.reshape(-1, hq, d)
    out = o.view(-1, hq, dv)
    k_buffer = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_buffer = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    for i, (row, seq_len) in enumerate(zip(rows, seq_lens, strict=True)):
        rid = by_row.get(row)
        if rid is None:
            continue
        positions = manager.positions(rid, seq_len)  # the new token's included
        current = seq_len - 1 + manager.position_offset(rid)
        inside = torch.nonzero(positions >= current - window, as_tuple=True)[0]
        slots = req_to_token[row, :seq_len].index_select(0, inside.to(req_to_token.device))
        keys = k_buffer.index_select(0, slots.long()).to(queries.dtype)  # [n, kv heads, d]
        values = v_buffer.index_select(0, slots.long()).to(queries.dtype)
        group = hq // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [hq, n, d]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.einsum("hd,hnd->hn", queries[i], keys) * layer.scaling
        weights = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        out[i] = torch.einsum("hn,hnd->hd", weights, values).to(out.dtype)
        CALLS["requests_rewindowed"] += 1
    return o
