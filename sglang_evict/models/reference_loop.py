"""Greedy generation on CPU through SGLang's memory classes and the plugin.

``generate`` admits requests into a ``MemoryDriver`` (prefix match, prefill into the
paged pool, the prompt into the radix tree), then decodes them as a continuous batch:
each step runs the plugin's decode-time pass (evict + compact + free pages), SGLang's
decode allocation, and ``PagedLlama`` attention over each request's row at logical
positions. With no policy it is plain SGLang memory management: the reference.

``attend_masks`` replays another run's survivor sets on a full cache (the masked
reference): at decode step s, a request attends only to the logical positions listed
for it at that step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sglang_evict.models.reference_model import KVBuffers, PagedLlama
from sglang_evict.passes.manager import PassResult


@dataclass(frozen=True)
class GenerationRequest:
    rid: str
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int = 0  # decode step at which the request is admitted
    # SGLang's custom_params of the request (its per-request policy, "sglang_evict").
    custom_params: dict | None = None


@dataclass
class GenerationResult:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    # logical positions each request attended to, per decode step of that request
    attended: dict[str, list[Tensor]] = field(default_factory=dict)
    passes: list[tuple[str, int, PassResult]] = field(default_factory=list)  # (rid, step, pass)
    held_tokens: list[int] = field(default_factory=list)  # KV slots in use after each step
    full_cache_tokens: list[int] = field(default_factory=list)  # what no eviction would hold


def generate(
    driver,
    model: PagedLlama,
    requests: list[GenerationRequest],
    *,
    attend_masks: dict[str, list[Tensor]] | None = None,
    on_step: Callable[[int, GenerationResult], None] | None = None,
) -> GenerationResult:
    """Run ``requests`` to ``max_new_tokens`` each (greedy) and return what happened."""
    kv = KVBuffers(k=driver.kv_pool.k_buffer, v=driver.kv_pool.v_buffer)
    result = GenerationResult()
    manager = driver.evictor
    capture = manager is not None and manager.scorer.needs_queries

    def forward(req, tokens, positions, *rest, **kwargs):
        """The model forward; feeds the plugin's query capture when the scorer reads queries."""
        captured: list[Tensor] | None = [] if capture else None
        logits = model.forward(tokens, positions, *rest, capture_queries=captured, **kwargs)
        if captured:
            row = driver.kv(req).req_pool_idx
            manager.record_queries(row, torch.stack(captured), positions)
        return logits

    pending = sorted(requests, key=lambda r: r.arrival_step)
    running: dict[str, tuple] = {}  # rid -> (req, GenerationRequest, decode steps so far)
    step = 0
    while pending or running:
        while pending and pending[0].arrival_step <= step:
            spec = pending.pop(0)
            req, prefix_len, slots = driver.admit(
                spec.rid, spec.prompt, custom_params=spec.custom_params
            )
            length = len(spec.prompt)
            logits = forward(
                req,
                torch.tensor(spec.prompt[prefix_len:]),
                torch.arange(prefix_len, length),
                slots,
                driver.row(req),
                torch.arange(length),
                kv,
            )
            req.output_ids.append(int(logits[-1].argmax()))
            driver.prefill_done(req)
            running[spec.rid] = (req, spec, 0)
            result.attended[spec.rid] = []
        if not running:
            step += 1
            continue
        reqs = [entry[0] for entry in running.values()]
        slots, positions, passes = driver.prepare_decode(reqs)
        for i, req in enumerate(reqs):
            _, spec, decoded = running[req.rid]
            if passes[i] is not None:
                result.passes.append((req.rid, step, passes[i]))
            context_positions = driver.positions(req)
            allowed = None
            if attend_masks is not None:
                allowed = torch.isin(context_positions, attend_masks[req.rid][decoded])
            result.attended[req.rid].append(context_positions.clone())
            logits = forward(
                req,
                torch.tensor([req.output_ids[-1]]),
                positions[i : i + 1],
                slots[i : i + 1],
                driver.row(req),
                context_positions,
                kv,
                allowed=allowed,
                tier=driver.tier_context(req),
            )
            req.output_ids.append(int(logits[-1].argmax()))
            running[req.rid] = (req, spec, decoded + 1)
        result.held_tokens.append(driver.held_tokens())
        result.full_cache_tokens.append(
            sum(len(r.origin_input_ids) + len(r.output_ids) - 1 for r, _, _ in running.values())
        )
        for rid, (req, spec, _) in list(running.items()):
            if len(req.output_ids) >= spec.max_new_tokens:
                result.outputs[rid] = list(req.output_ids)
                driver.finish(req)
                del running[rid]
        if on_step is not None:
            on_step(step, result)
        step += 1
    return result
