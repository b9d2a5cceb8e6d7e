"""Query-reading scorers through the real pass (the CPU loop: SGLang's memory classes,
the plugin's batched pass, the query ring fed by the model's forward): the prefill
observation window scores an evictable prompt at its first pass, and ``cumulative``
carries every survivor's score, moved with it, into the next pass."""

from __future__ import annotations

import itertools

import pytest
import torch

from sglang_evict.config import EvictionConfig
from sglang_evict.models.reference_loop import GenerationRequest, generate
from sglang_evict.models.reference_model import KVBuffers, PagedLlama, build_tiny_llama
from sglang_evict.passes.batch import scoring as scoring_module
from sglang_evict.scorers import KVView, build_scorer
from sglang_evict.srt.cpu_driver import MemoryDriver

PROMPT = [(11 * i + 5) % 256 for i in range(80)]
QUERY_WINDOW = 24


@pytest.fixture(scope="module")
def model():
    return PagedLlama(build_tiny_llama(seed=3, dtype=torch.float64))


def policy(page_size: int, **overrides) -> EvictionConfig:
    fields = dict(
        kv_budget_tokens=48,
        cadence_tokens=16,
        sink_tokens=4,
        window_tokens=8,
        scorer="window",
        page_size=page_size,
        query_window_tokens=QUERY_WINDOW,
    )
    return EvictionConfig(**{**fields, **overrides})


@pytest.fixture
def scored_passes(monkeypatch):
    """Every batched pass's scorer inputs and ``[R, N]`` scores, in order."""
    log = []
    score_rows = scoring_module.score_rows  # what the pass's scoring step calls

    def recording(scorers, view):
        scores = score_rows(scorers, view)
        log.append((view, scores))
        return scores

    monkeypatch.setattr(scoring_module, "score_rows", recording)
    return log


def run(model, config, new_tokens):
    driver = MemoryDriver.for_model(
        model, page_size=config.page_size, num_tokens=1024, config=config, max_context=256
    )
    result = generate(driver, model, [GenerationRequest("a", PROMPT, new_tokens)])
    return driver, result


def by_position(view, scores, r=0) -> dict[int, float]:
    n = view.lengths[r]
    return dict(zip(view.positions[r, :n].tolist(), scores[r, :n].tolist(), strict=True))


@pytest.mark.parametrize("page_size", [1, 4])
def test_first_pass_scores_an_evictable_prompt_with_its_last_w_prompt_queries(
    model, scored_passes, page_size
):
    """SnapKV's use: with ``evict_prompt`` on, an 80-token prompt over budget + cadence
    is compacted at the request's second decode step, scored by the queries captured at
    the end of prefill (all but the newest of the window are prompt queries). The scores
    equal SnapKV's computed from one full forward of the same tokens."""
    config = policy(page_size, evict_prompt=True)
    _, result = run(model, config, new_tokens=4)
    _, step, first = result.passes[0]
    assert step == 1 and first.tokens_before == len(PROMPT) + 1
    view, scores = scored_passes[0]
    next_position = len(PROMPT) + 1
    window_positions = view.queries.positions[0][view.queries.valid[0]]
    assert sorted(window_positions.tolist()) == list(
        range(next_position - QUERY_WINDOW, next_position)
    )
    assert int((window_positions < len(PROMPT)).sum()) == QUERY_WINDOW - 1

    # SnapKV on one full forward of the prompt and the first generated token.
    tokens = torch.tensor([*PROMPT, result.outputs["a"][0]])
    positions = torch.arange(next_position)
    k = [
        torch.zeros(next_position, model.num_kv_heads, model.head_dim, dtype=model.dtype)
        for _ in range(model.num_layers)
    ]
    kv = KVBuffers(k=k, v=[torch.zeros_like(b) for b in k])
    captured = []
    model.forward(tokens, positions, positions, positions, positions, kv, capture_queries=captured)
    expected = build_scorer("window").score(
        KVView(
            keys=torch.stack(k),
            positions=positions,
            current_position=next_position,
            queries=torch.stack(captured)[:, -QUERY_WINDOW:],
            query_positions=positions[-QUERY_WINDOW:],
        )
    )
    got = by_position(view, scores)
    assert sorted(got) == positions.tolist()
    torch.testing.assert_close(
        torch.tensor([got[p] for p in range(next_position)], dtype=torch.float32),
        expected,
        rtol=1e-4,
        atol=1e-5,
    )
    # The prompt itself was evicted from: positions past the sinks are gone.
    assert first.tokens_evicted >= config.cadence_tokens
    kept = set(result.attended["a"][2].tolist())
    assert len(set(range(config.sink_tokens, len(PROMPT))) - kept) >= config.cadence_tokens


def test_cumulative_window_carries_each_survivors_score_into_the_next_pass(model, scored_passes):
    """``hole_fill`` moves survivors between passes; each still enters the next pass
    with the total it had at the last one, and tokens appended since with 0."""
    config = policy(1, scorer_params={"mode": "cumulative", "head_normalization": "none"})
    run(model, config, new_tokens=70)
    assert len(scored_passes) >= 3
    for (before, before_scores), (after, _) in itertools.pairwise(scored_passes):
        totals = by_position(before, before_scores)
        n = after.lengths[0]
        carried = dict(
            zip(
                after.positions[0, :n].tolist(),
                after.accumulated_scores[0, :n].tolist(),
                strict=True,
            )
        )
        survivors = [p for p in carried if p in totals]
        assert len(survivors) >= config.kv_budget_tokens - config.window_tokens
        assert all(carried[p] == pytest.approx(totals[p], rel=1e-6) for p in survivors)
        assert all(carried[p] == 0.0 for p in carried if p not in totals)
        assert any(totals[p] > 0 for p in survivors)
