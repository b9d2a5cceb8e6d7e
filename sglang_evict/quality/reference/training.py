"""Training of the quality reference model (``benches/quality/train_reference_model.py``).

A small HF ``LlamaForCausalLM`` (RoPE, GQA, RMSNorm, SwiGLU) learns the recall-chain
task (``sglang_evict.quality.reference.task``) from a fixed seed, on CPU, with a curriculum that
grows the number of facts and distractors stage by stage. The loss is taken on the
answer tokens only (facts and distractors are random: nothing to predict there).

Determinism: one seed drives the weights (``torch.manual_seed``) and the data (each
batch is ``make_sample(spec, seed, index)``); ``torch.use_deterministic_algorithms``
is on and the thread count is fixed, so the same command on the same torch build and
thread count gives bit-identical weights (``test_training_is_bit_reproducible``).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from sglang_evict.quality.reference.task import (
    HELD_OUT_SEED_BASE,
    VARIANTS,
    VOCAB_SIZE,
    Sample,
    TaskSpec,
    make_sample,
)


@dataclass(frozen=True)
class ModelShape:
    """Architecture of the reference model (an HF ``LlamaConfig`` subset)."""

    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads}"
            )


@dataclass(frozen=True)
class Stage:
    """A curriculum stage: up to ``max_steps`` optimizer steps on batches of
    ``batch_size`` sequences whose fact and distractor counts are drawn uniformly from
    the given inclusive ranges (one draw per batch, so a batch has one length); the
    answer walks half the facts.

    A stage with ``advance_at`` ends early, after at least ``min_steps``, once the
    teacher-forced answer accuracy averaged over the last ``ADVANCE_WINDOW`` batches
    reaches it (the run stays deterministic: the decision reads only its own losses).
    The last stage runs all its steps, with the learning rate decaying over them.
    """

    max_steps: int
    facts: tuple[int, int]
    distractors: tuple[int, int]
    batch_size: int = 32
    min_steps: int = 0
    advance_at: float | None = 0.97


ADVANCE_WINDOW = 20

# Retrieval forms on short sequences (~450 steps at 4-8 facts, 0-8 distractors, seed
# 0), then lengths grow stage by stage; a jump straight to ~300-token sequences did
# not form it in 1000 steps. The last stage covers the eval's default (32 facts, 224
# distractors, 340 tokens) and beyond, so positions up to ~430 are trained.
DEFAULT_CURRICULUM = (
    Stage(max_steps=2000, facts=(4, 8), distractors=(0, 8), batch_size=64, min_steps=200),
    Stage(max_steps=800, facts=(4, 16), distractors=(0, 48), batch_size=64, min_steps=150),
    Stage(max_steps=800, facts=(8, 24), distractors=(16, 128), min_steps=200),
    Stage(max_steps=800, facts=(16, 36), distractors=(64, 256), min_steps=300),
    Stage(max_steps=600, facts=(24, 40), distractors=(160, 320), advance_at=None),
)


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    learning_rate: float = 2e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    min_lr_fraction: float = 0.1
    # 1 thread: on this 2-core machine, shared with other jobs, 2 threads ran ~5x
    # slower per step (spin-waiting under oversubscription) than 1.
    threads: int = 1
    curriculum: tuple[Stage, ...] = DEFAULT_CURRICULUM

    def to_dict(self) -> dict:
        return asdict(self)


def build_model(shape: ModelShape, seed: int):
    """A freshly initialised reference model (float32, seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def batch_tensors(samples: Sequence[Sample]) -> tuple[Tensor, Tensor]:
    """(inputs ``[B, T-1]``, targets ``[B, T-1]`` with -100 outside the answer)."""
    tokens = torch.tensor([s.tokens for s in samples], dtype=torch.int64)
    targets = tokens[:, 1:].clone()
    answer_len = len(samples[0].answer)
    targets[:, : targets.shape[1] - answer_len] = -100
    return tokens[:, :-1], targets


def _learning_rate(config: TrainConfig, step: int, final_stage_step: int | None) -> float:
    """Linear warmup, constant, then cosine decay to ``min_lr_fraction`` over the last
    stage (``final_stage_step`` counts its steps; None before it)."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    if final_stage_step is None:
        return config.learning_rate
    progress = final_stage_step / max(1, config.curriculum[-1].max_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.learning_rate * (config.min_lr_fraction + (1 - config.min_lr_fraction) * cosine)


def _stage_batch(config: TrainConfig, stage: Stage, step: int) -> list[Sample]:
    rng = random.Random(config.seed * 7919 + step)
    num_facts = rng.randint(*stage.facts)
    spec = TaskSpec(
        variant=VARIANTS[rng.randrange(len(VARIANTS))],
        num_facts=num_facts,
        num_distractors=rng.randint(*stage.distractors),
        chain_steps=max(1, num_facts // 2),
    )
    if config.seed >= HELD_OUT_SEED_BASE:
        raise ValueError(f"training seeds must be < {HELD_OUT_SEED_BASE} (held-out data above)")
    # Sample indices: step * 1024 + i, distinct for every (step, i) of a run.
    return [make_sample(spec, config.seed, step * 1024 + i) for i in range(stage.batch_size)]


def train(
    shape: ModelShape,
    config: TrainConfig,
    *,
    on_step: Callable[[int, float, float, float], None] | None = None,
):
    """Train a reference model; returns ``(model, log)``: the loss curve (every 25 steps),
    the steps each stage ran, and the wall time. ``on_step(step, loss, lr, accuracy)``
    sees every step (accuracy: teacher-forced, on that batch's answer tokens)."""
    torch.set_num_threads(config.threads)
    torch.use_deterministic_algorithms(True)
    model = build_model(shape, config.seed)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=config.learning_rate,
        betas=(0.9, 0.98),
    )
    losses: list[tuple[int, float]] = []
    stage_log: list[dict] = []
    start = time.perf_counter()
    step = 0
    for stage_index, stage in enumerate(config.curriculum):
        final = stage_index == len(config.curriculum) - 1
        recent: list[float] = []
        stage_start = step
        for stage_step in range(stage.max_steps):
            lr = _learning_rate(config, step, stage_step if final else None)
            for group in optimizer.param_groups:
                group["lr"] = lr
            inputs, targets = batch_tensors(_stage_batch(config, stage, step))
            logits = model(input_ids=inputs, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            with torch.no_grad():
                answered = targets != -100
                hits = (logits.argmax(dim=-1) == targets) & answered
                accuracy = hits.sum().item() / answered.sum().item()
            recent = [*recent[-(ADVANCE_WINDOW - 1) :], accuracy]
            if step % 25 == 0:
                losses.append((step, round(loss.item(), 5)))
            if on_step is not None:
                on_step(step, loss.item(), lr, accuracy)
            step += 1
            if (
                not final
                and stage.advance_at is not None
                and stage_step + 1 >= stage.min_steps
                and len(recent) == ADVANCE_WINDOW
                and sum(recent) / ADVANCE_WINDOW >= stage.advance_at
            ):
                break
        stage_log.append(
            {
                "stage": stage_index,
                "steps": step - stage_start,
                "final_window_accuracy": round(sum(recent) / max(1, len(recent)), 4),
            }
        )
    model.eval()
    return model, {
        "loss_every_25_steps": losses,
        "stages": stage_log,
        "total_steps": step,
        "train_wall_s": time.perf_counter() - start,
    }


@torch.no_grad()
def greedy_chains(model, samples: Sequence[Sample], batch_size: int = 64) -> list[list[int]]:
    """Greedy answer tokens of each sample with the full context (HF forward, no cache;
    the reference for what the paged evaluation must reproduce without eviction)."""
    outputs: list[list[int]] = []
    for first in range(0, len(samples), batch_size):
        chunk = samples[first : first + batch_size]
        tokens = torch.tensor([[*s.prompt, *s.forced] for s in chunk], dtype=torch.int64)
        generated = []
        for _ in range(len(chunk[0].answer)):
            logits = model(input_ids=tokens, use_cache=False).logits[:, -1]
            nxt = logits.argmax(dim=-1, keepdim=True)
            generated.append(nxt)
            tokens = torch.cat([tokens, nxt], dim=1)
        outputs.extend(torch.cat(generated, dim=1).tolist())
    return outputs
