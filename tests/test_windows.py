"""Sliding windows after compaction (``sglang_evict.srt.windows``): SGLang's
``torch_native`` decode windows a layer by KV index, which after a pass is not its
window of logical positions; the plugin's hook recomputes each compacted request over
the keys of its logical window, and leaves every other request as SGLang computed it.
Also the rule of which layers SGLang windows (``layer_windows``) and the refusals of
windowed models at start."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from sglang_evict.srt.windows import layer_windows, rewindow

pytestmark = pytest.mark.sglang

HEADS, KV_HEADS, DIM, WINDOW = 4, 2, 8, 5


@dataclass
class State:
    req_pool_idx: int


class Manager:
    """What ``rewindow`` reads of the eviction manager: each compacted request's row,
    logical positions and offset."""

    def __init__(self, positions_by_rid: dict[str, list[int]], rows: dict[str, int]):
        self.positions_by_rid = positions_by_rid
        self.states = {rid: State(row) for rid, row in rows.items()}

    def positions(self, rid, kv_len):
        return torch.tensor(self.positions_by_rid[rid][:kv_len])

    def position_offset(self, rid):
        positions = self.positions_by_rid[rid]
        return positions[-1] - (len(positions) - 1)


def pool(num_slots, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_slots, KV_HEADS, DIM, generator=gen)
    v = torch.randn(num_slots, KV_HEADS, DIM, generator=gen)
    return k, v


def sglang_decode(q, k, v, req_to_token, rows, seq_lens, window):
    """SGLang's own torch_native decode (``_run_sdpa_forward_decode``)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    backend = object.__new__(TorchNativeAttnBackend)
    out = torch.empty(q.shape[0], HEADS, DIM)
    return backend._run_sdpa_forward_decode(
        q.view(-1, HEADS, DIM),
        out,
        k,
        v,
        req_to_token,
        rows,
        seq_lens,
        scaling=DIM**-0.5,
        enable_gqa=True,
        sliding_window_size=window,
    ).reshape(q.shape[0], -1)


def logical_window_attention(q, k, v, slots, positions, window):
    """The query (of the last position) over the keys whose positions lie in its window."""
    current = positions[-1]
    chosen = slots[positions >= current - window]
    keys = k[chosen].repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
    values = v[chosen].repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
    scores = torch.einsum("hd,hnd->hn", q.view(HEADS, DIM), keys) * DIM**-0.5
    return torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), values).reshape(-1)


def test_a_compacted_row_is_windowed_by_index_in_sglang_and_by_position_after_the_hook():
    # Request "a" after a hole_fill pass: sinks 0..3, then old survivors moved into the
    # tail page's holes (positions 5, 7) after recent ones, then the newest tokens.
    positions_a = [0, 1, 2, 3, 14, 15, 16, 5, 7, 17, 18, 19]
    # Request "b" never compacted: entry i holds position i.
    positions_b = list(range(9))
    k, v = pool(64)
    req_to_token = torch.zeros(4, 16, dtype=torch.int32)
    req_to_token[1, : len(positions_a)] = torch.arange(10, 10 + len(positions_a))
    req_to_token[3, : len(positions_b)] = torch.arange(40, 40 + len(positions_b))
    rows = torch.tensor([1, 3])
    seq_lens = torch.tensor([len(positions_a), len(positions_b)])
    q = torch.randn(2, HEADS * DIM, generator=torch.Generator().manual_seed(3))
    sglangs = sglang_decode(q, k, v, req_to_token, rows, seq_lens, WINDOW)

    slots_a = req_to_token[1, : len(positions_a)].long()
    wanted_a = logical_window_attention(q[0], k, v, slots_a, torch.tensor(positions_a), WINDOW)
    # SGLang's index window reads the moved old tokens 5 and 7 and misses 14..16
    assert not torch.allclose(sglangs[0], wanted_a, atol=1e-4)

    manager = Manager({"a": positions_a}, {"a": 1})
    layer = SimpleNamespace(
        tp_q_head_num=HEADS,
        qk_head_dim=DIM,
        v_head_dim=DIM,
        scaling=DIM**-0.5,
        layer_id=0,
    )
    backend = SimpleNamespace(
        token_to_kv_pool=SimpleNamespace(get_key_buffer=lambda _: k, get_value_buffer=lambda _: v),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
    )
    batch = SimpleNamespace(req_pool_indices=rows, seq_lens=seq_lens)
    fixed = rewindow(sglangs.clone(), q, layer, batch, backend, manager, WINDOW)
    torch.testing.assert_close(fixed[0], wanted_a, rtol=1e-5, atol=1e-5)
    assert torch.equal(fixed[1], sglangs[1])  # the untouched request: SGLang's own
    slots_b = req_to_token[3, : len(positions_b)].long()
    wanted_b = logical_window_attention(q[1], k, v, slots_b, torch.tensor(positions_b), WINDOW)
    torch.testing.assert_close(sglangs[1], wanted_b, rtol=1e-5, atol=1e-5)  # index = position


def test_sglang_windows_the_layers_layer_types_names_sliding():
    from transformers import Gemma3TextConfig, MistralConfig, Qwen2Config

    gemma = Gemma3TextConfig(
        num_hidden_layers=3,
        sliding_window=512,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    assert layer_windows(gemma) == (512, -1, 512)
    assert layer_windows(MistralConfig(num_hidden_layers=2, sliding_window=4096)) == (-1, -1)
    assert layer_windows(Qwen2Config(num_hidden_layers=2)) == (-1, -1)
