"""Decode-time perplexity on real text (StreamingLLM's protocol, the setting a reasoning
trace is in): essay text fed one token per decode step through the real decode path,
with the plugin's passes at the cadence as in serving, against the full cache on the
same tokens.

Each sequence: ``PROMPT_TOKENS`` tokens of an essay are the prompt (prefilled; they enter
the radix tree and are never evicted), the next ``length - PROMPT_TOKENS`` are forced one
per decode step (``quality.forced.TeacherForcedDriver``: SGLang's allocator, radix cache
and KV pool on CPU, the plugin's scoring, selection, compaction and page frees at every
step). The model's log-probability of each forced token is read off the step that
predicts it; perplexity is ``exp`` of the mean negative log-likelihood over every
forced token of every sequence. Sequences start at seeded offsets of the essays.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

PROMPT_TOKENS = 16
SEED_BASE = 31_337


@dataclass(frozen=True)
class PerplexityPolicy:
    page_size: int = 16
    sink_tokens: int = 4
    window_tokens: int = 64
    cadence_tokens: int = 64
    query_window_tokens: int = 32


def sequences(token_ids: Sequence[int], length: int, count: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens of ``token_ids`` at seeded offsets."""
    if len(token_ids) < length:
        raise ValueError(
            f"the text holds {len(token_ids)} tokens, fewer than a {length}-token sequence"
        )
    rng = random.Random(SEED_BASE + length)
    starts = [rng.randrange(len(token_ids) - length + 1) for _ in range(count)]
    return [list(token_ids[s : s + length]) for s in starts]


class _RecordingModel:
    """``PagedLlama`` whose every forward keeps the log-softmax of its last position
    (the prediction of the next fed token)."""

    def __init__(self, model) -> None:
        self._model = model
        self.log_probs: list[torch.Tensor] = []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, *args, **kwargs):
        logits = self._model.forward(*args, **kwargs)
        self.log_probs.append(torch.log_softmax(logits[-1].float(), dim=-1))
        return logits


def sequence_nll(
    model, tokens: Sequence[int], config, *, page_size: int, on_step: Callable | None = None
) -> tuple[float, int, dict]:
    """``(sum of NLL, tokens scored, facts)`` of one sequence through the decode path
    (``config`` None: the full cache)."""
    from sglang_evict.models.reference_loop import GenerationRequest, generate
    from sglang_evict.quality.forced import TeacherForcedDriver

    prompt, forced = list(tokens[:PROMPT_TOKENS]), list(tokens[PROMPT_TOKENS:])
    recording = _RecordingModel(model)
    driver = TeacherForcedDriver.for_model(
        model,
        forced={"s": forced},
        page_size=page_size,
        num_tokens=len(tokens) + 4 * page_size,
        config=config,
        max_requests=2,
        max_context=len(tokens) + 2 * page_size,
    )
    # Each step feeds one forced token; the last forced token is fed by no step.
    request = GenerationRequest("s", prompt, len(forced))
    result = generate(driver, recording, [request], on_step=on_step)
    nll = 0.0
    for log_probs, token in zip(recording.log_probs, forced, strict=False):
        nll -= float(log_probs[token])
    scored = min(len(recording.log_probs), len(forced))
    passes = [p for _, _, p in result.passes]
    facts = {
        "passes": len(passes),
        "peak_kv_tokens": max(result.held_tokens) if result.held_tokens else 0,
        "tokens_evicted": sum(p.tokens_evicted for p in passes),
    }
    return nll, scored, facts


def perplexity(
    model, token_sequences: Sequence[Sequence[int]], config, *, page_size: int, on_step=None
) -> dict:
    """Perplexity over ``token_sequences`` (``config`` None: the full cache)."""
    started = time.perf_counter()
    total_nll, total_tokens, peaks, passes = 0.0, 0, [], 0
    for tokens in token_sequences:
        nll, scored, facts = sequence_nll(
            model, tokens, config, page_size=page_size, on_step=on_step
        )
        total_nll += nll
        total_tokens += scored
        peaks.append(facts["peak_kv_tokens"])
        passes += facts["passes"]
    return {
        "perplexity": math.exp(total_nll / total_tokens),
        "tokens_scored": total_tokens,
        "mean_peak_kv_tokens": sum(peaks) / len(peaks),
        "passes": passes,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def config_for(policy: PerplexityPolicy, scorer: str, budget: int, stats: str | None = None):
    from sglang_evict.config import EvictionConfig

    return EvictionConfig(
        kv_budget_tokens=budget,
        cadence_tokens=policy.cadence_tokens,
        sink_tokens=policy.sink_tokens,
        window_tokens=policy.window_tokens,
        scorer=scorer,
        scorer_params={"stats_path": stats} if stats else {},
        page_size=policy.page_size,
        query_window_tokens=policy.query_window_tokens,
    )
