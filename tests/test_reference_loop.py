"""The CPU reference decode loop: a Llama-architecture model whose attention reads and
writes SGLang's real KV pool through request-to-token rows, driven through the plugin
exactly as its hooks drive it. float64 throughout, so attention sums taken in a
different order (hole_fill scrambles row order) cannot flip a greedy choice.
"""

from __future__ import annotations

import pytest
import torch

from sglang_evict.config import EvictionConfig
from sglang_evict.models.reference_loop import GenerationRequest, generate
from sglang_evict.models.reference_model import PagedLlama, build_tiny_llama
from sglang_evict.srt.cpu_driver import MemoryDriver

DTYPE = torch.float64


@pytest.fixture(scope="module")
def hf_model():
    return build_tiny_llama(seed=1, dtype=DTYPE)


def driver_for(model, page_size, config=None, num_tokens=4096):
    return MemoryDriver.for_model(
        PagedLlama(model), page_size=page_size, num_tokens=num_tokens, config=config
    )


def policy(page_size, strategy="hole_fill", budget=48, scorer="knorm"):
    return EvictionConfig(
        kv_budget_tokens=budget,
        cadence_tokens=16,
        sink_tokens=4,
        window_tokens=16,
        scorer=scorer,
        compaction=strategy,
        page_size=page_size,
    )


PROMPT = [(7 * i + 3) % 256 for i in range(40)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_budget_off_is_token_identical_to_plain_hf_generation(hf_model, page_size):
    new_tokens = 60
    expected = hf_model.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=new_tokens,
        do_sample=False,
        attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
    )[0, len(PROMPT) :].tolist()
    driver = driver_for(hf_model, page_size, policy(page_size, budget=4000))
    result = generate(driver, PagedLlama(hf_model), [GenerationRequest("a", PROMPT, new_tokens)])
    assert not result.passes
    assert result.outputs["a"] == expected
    assert len(set(expected)) > 5  # a non-degenerate stream


@pytest.mark.parametrize(
    ("page_size", "strategy"), [(1, "repack"), (1, "hole_fill"), (16, "repack"), (16, "hole_fill")]
)
def test_compacted_generation_equals_a_masked_full_cache_reference(hf_model, page_size, strategy):
    model = PagedLlama(hf_model)
    request = GenerationRequest("a", PROMPT, 150)
    evicting = generate(
        driver_for(hf_model, page_size, policy(page_size, strategy)), model, [request]
    )
    assert len(evicting.passes) >= 5
    # The protected prompt and window (40 + 16) exceed the budget (48): a pass keeps
    # them, and the next one runs a cadence (16) of tokens later.
    survivors = max(48, len(PROMPT) + 16)
    assert max(len(a) for a in evicting.attended["a"]) <= survivors + 16 + 1
    # The same survivor sets, applied as attention masks on an uncompacted cache.
    reference = generate(
        driver_for(hf_model, page_size),
        model,
        [request],
        attend_masks={"a": evicting.attended["a"]},
    )
    assert reference.outputs["a"] == evicting.outputs["a"]
    # And eviction did change what the model saw: a full cache decodes differently.
    full = generate(driver_for(hf_model, page_size), model, [request])
    assert full.outputs["a"] != evicting.outputs["a"]


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_system_prompt_survives_a_heavily_evicting_neighbour(hf_model, page_size):
    model = PagedLlama(hf_model)
    system = [(11 * i + 5) % 256 for i in range(32)]
    warmup = GenerationRequest("system", system, 2)
    a = GenerationRequest("a", [*system, 1, 2, 3], 200, arrival_step=0)
    b = GenerationRequest("b", [*system, 4, 5], 20, arrival_step=3)

    def run(requests):
        driver = driver_for(hf_model, page_size, policy(page_size, budget=40))
        generate(driver, model, [warmup])
        shared = driver.match(system).indices.clone()
        snapshot = [
            buf[shared].clone() for buf in (*driver.kv_pool.k_buffer, *driver.kv_pool.v_buffer)
        ]
        result = generate(driver, model, requests)
        return driver, shared, snapshot, result

    driver, shared, snapshot, together = run([a, b])
    assert shared.numel() == 32 and together.passes
    assert all(rid == "a" for rid, _, _ in together.passes)
    for before, buf in zip(
        snapshot, (*driver.kv_pool.k_buffer, *driver.kv_pool.v_buffer), strict=True
    ):
        assert torch.equal(buf[shared], before)  # shared pages bit-identical
    assert torch.equal(driver.match([*system, 9]).indices, shared)  # still a hit
    _, _, _, alone = run([b])
    assert together.outputs["b"] == alone.outputs["b"]  # b's output is unchanged
    assert driver.free_tokens() + driver.cache.evictable_size() == driver.num_tokens


def test_a_fully_cached_prompt_still_prefills_its_last_token(hf_model):
    """Two requests with one prompt: the second matches all but the last token (as
    SGLang's scheduler limits the match) and generates what the first generated."""
    model = PagedLlama(hf_model)
    driver = driver_for(hf_model, 4, policy(4))
    requests = [
        GenerationRequest("first", PROMPT, max_new_tokens=60),
        GenerationRequest("again", PROMPT, max_new_tokens=60, arrival_step=70),
    ]
    result = generate(driver, model, requests)
    assert result.outputs["again"] == result.outputs["first"]
    assert driver.free_tokens() + driver.cache.evictable_size() == driver.num_tokens
    driver.cache.check_invariants()
