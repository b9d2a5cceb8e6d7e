"""``SGLangPoolAccess`` over SGLang's own ``MLATokenToKVPool`` (its memory classes; the
engine proof is tests/test_engine_mla.py): the latent rows are the pool's keys, there
are no values, a pass's moves copy every layer's latent row and nothing else, a key
scorer reads the latent row, and the MLA variants with other layouts are refused."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.sglang

RANK, ROPE, LAYERS, SLOTS, PAGE = 64, 16, 3, 64, 4


def mla_pool(cls=None):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    cls = cls or MLATokenToKVPool
    pool = cls(
        size=SLOTS,
        page_size=PAGE,
        dtype=torch.float32,
        kv_lora_rank=RANK,
        qk_rope_head_dim=ROPE,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    generator = torch.Generator().manual_seed(0)
    for buffer in pool.kv_buffer:
        buffer.copy_(torch.randn(buffer.shape, generator=generator))
    return pool


def access(pool):
    from types import SimpleNamespace

    from sglang_evict.srt.pools import SGLangPoolAccess

    rows = SimpleNamespace(req_to_token=torch.zeros(2, 32, dtype=torch.int32))
    return SGLangPoolAccess(rows, SimpleNamespace(page_size=PAGE), pool)


def test_the_latent_rows_are_the_keys_and_there_are_no_values():
    pool = mla_pool()
    view = access(pool)
    assert view.latent and view.v_buffers == []
    assert all(a is b for a, b in zip(view.k_buffers, pool.kv_buffer, strict=True))
    assert view.k_buffers[0].shape[1:] == (1, RANK + ROPE)
    slots = torch.tensor([5, 9, 17])
    keys = view.gather_keys(slots)
    assert keys.shape == (LAYERS, 3, 1, RANK + ROPE)
    assert torch.equal(keys[1], pool.kv_buffer[1][slots])


def test_a_pass_moves_every_layers_latent_row_and_nothing_else():
    from sglang_evict_kernels.repack import repack_kv_independent

    pool = mla_pool()
    view = access(pool)
    before = [b.clone() for b in pool.kv_buffer]
    src, dst = torch.tensor([20, 21, 33]), torch.tensor([8, 9, 10])
    repack_kv_independent(view.k_buffers, view.v_buffers, src, dst)
    for layer in range(LAYERS):
        want = before[layer].clone()
        want[dst] = before[layer][src]
        assert torch.equal(pool.kv_buffer[layer], want)
        # what the attention reads: SGLang's own key and value views of the same rows
        assert torch.equal(pool.get_key_buffer(layer)[dst], before[layer][src])
        assert torch.equal(pool.get_value_buffer(layer)[dst], before[layer][src][..., :RANK])


def test_the_knorm_scorer_reads_the_latent_row():
    from sglang_evict.scorers.knorm import KNormScorer

    pool = mla_pool()
    view = access(pool)
    slots = torch.arange(8, 24)
    scores = KNormScorer().pool_head_scores(view.k_buffers, slots, 0)
    norms = torch.stack([b[slots, 0].norm(dim=-1) for b in pool.kv_buffer])
    assert torch.allclose(scores.reshape(LAYERS, -1), -norms, atol=1e-5)


def test_mla_variants_with_other_layouts_are_refused():
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPoolFP4

    with pytest.raises(ValueError, match="MLATokenToKVPoolFP4"):
        access(mla_pool(MLATokenToKVPoolFP4))


def test_the_sidecar_refuses_an_mla_pool():
    from sglang_evict.srt.pools import share_kv_pool

    with pytest.raises(ValueError, match="--kv-compactor inprocess"):
        share_kv_pool(mla_pool(), "/nonexistent")
