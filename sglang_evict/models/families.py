"""One registry of architectures for the engine tests: a tiny random-weight model per
family, built offline (no download), each exercising what sets its family apart.

    name        architecture            what it exercises
    llama       LlamaForCausalLM        the baseline: GQA, RoPE, RMSNorm, SwiGLU
    qwen2       Qwen2ForCausalLM        attention bias on q, k and v
    qwen3       Qwen3ForCausalLM        per-head q/k RMSNorm before RoPE
    qwen3_moe   Qwen3MoeForCausalLM     q/k norm and a routed MoE MLP (4 experts, top 2)
    mistral     MistralForCausalLM      the Llama layout under Mistral's class
    mistral_swa MistralForCausalLM      a v0.1-style ``sliding_window`` with no
                                        ``layer_types``: SGLang applies no window to it
    mixtral     MixtralForCausalLM      a sparse MoE MLP (4 experts, top 2)
    gemma       GemmaForCausalLM        embeddings scaled by sqrt(hidden), (1 + w) norms,
                                        GeGLU, an explicit head dim
    gemma2      Gemma2ForCausalLM       local (windowed) and global layers alternating,
                                        attention logit soft-capping in its config (SGLang's
                                        transformers backend does not apply it)
    gemma3      Gemma3ForCausalLM       local and global layers with two RoPE bases, q/k
                                        norm, ``query_pre_attn_scalar``
    deepseek_v2 DeepseekV2ForCausalLM   MLA: one latent row a token a layer (rank 256 +
                                        a 32-wide rotary part), YaRN RoPE (SGLang's CPU
                                        rotary path takes DeepSeek's YaRN only), dense
                                        MLPs (``first_k_dense_replace`` covers both
                                        layers)

Every model shares the engine model's tokenizer and vocabulary
(``models.engine_model``), head dim 64 (one the tier's kernels hold), 4 query heads
over 2 KV heads (MLA: 4 heads over the one latent row), 2 or 3 layers, float32,
``lm_head`` scaled up so greedy choices are decisive. The windowed families use a
window of ``WINDOW_TOKENS``, far below the engine tests' contexts, so eviction and the
window meet within a few passes.

    ensure_family_model("qwen3")  # the folder, built on first use, reused when intact
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

# Change when any family's build changes (the cache folders are keyed by it).
FAMILY_VERSION = 1
SEED = 0
WINDOW_TOKENS = 24
LOGITS_SCALE = 8.0  # random init keeps logits nearly flat; this makes greedy decisive

_COMMON = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=256,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class Family:
    """One architecture of the registry: its transformers config class and fields."""

    name: str
    architecture: str
    config_class: str  # a transformers configuration class
    exercises: str
    fields: dict = field(default_factory=dict)

    def spec(self) -> str:
        """What the build depends on, as JSON (the cache is keyed by it)."""
        return json.dumps(
            {
                "class": self.config_class,
                "fields": {**_COMMON, **self.fields},
                "seed": SEED,
                "logits_scale": LOGITS_SCALE,
            },
            sort_keys=True,
        )

    def config(self, vocab_size: int):
        import transformers

        fields = {**_COMMON, **self.fields, "vocab_size": vocab_size}
        return getattr(transformers, self.config_class)(**fields)


FAMILIES = {
    family.name: family
    for family in (
        Family("llama", "LlamaForCausalLM", "LlamaConfig", "the baseline"),
        Family("qwen2", "Qwen2ForCausalLM", "Qwen2Config", "attention bias on q, k and v"),
        Family("qwen3", "Qwen3ForCausalLM", "Qwen3Config", "per-head q/k norm"),
        Family(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            "Qwen3MoeConfig",
            "q/k norm and a routed MoE MLP",
            dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
        ),
        Family("mistral", "MistralForCausalLM", "MistralConfig", "Mistral's class"),
        Family(
            "mistral_swa",
            "MistralForCausalLM",
            "MistralConfig",
            "a v0.1-style sliding_window without layer_types (SGLang applies none)",
            dict(sliding_window=WINDOW_TOKENS),
        ),
        Family(
            "mixtral",
            "MixtralForCausalLM",
            "MixtralConfig",
            "a sparse MoE MLP",
            dict(num_local_experts=4, num_experts_per_tok=2),
        ),
        Family("gemma", "GemmaForCausalLM", "GemmaConfig", "scaled embeddings, GeGLU"),
        Family(
            "gemma2",
            "Gemma2ForCausalLM",
            "Gemma2Config",
            "local and global layers (attention logit soft-capping in its config)",
            # No final soft-capping: SGLang's kernel for it (a Triton kernel) stops the CPU
            # engine under Triton's interpreter; a monotonic cap changes no greedy token.
            dict(
                sliding_window=WINDOW_TOKENS,
                layer_types=["sliding_attention", "full_attention"],
                final_logit_softcapping=None,
            ),
        ),
        Family(
            "gemma3",
            "Gemma3ForCausalLM",
            "Gemma3TextConfig",
            "local and global layers, two RoPE bases, q/k norm",
            dict(
                num_hidden_layers=3,
                sliding_window=WINDOW_TOKENS,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                    "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                },
            ),
        ),
        Family(
            "deepseek_v2",
            "DeepseekV2ForCausalLM",
            "DeepseekV2Config",
            "MLA latent rows, YaRN RoPE",
            dict(
                num_key_value_heads=4,
                # 256 + 32 = 288: a latent width SGLang's triton MLA decode kernel
                # splits into its latent and rotary blocks (as 512 + 64 for DeepSeek V3)
                kv_lora_rank=256,
                q_lora_rank=None,
                qk_rope_head_dim=32,
                qk_nope_head_dim=32,
                v_head_dim=32,
                n_routed_experts=4,
                num_experts_per_tok=2,
                n_group=1,
                topk_group=1,
                first_k_dense_replace=2,
                moe_intermediate_size=64,
                moe_layer_freq=1,  # SGLang's DeepSeek model reads it
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 10_000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 2048,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "mscale": 1.0,
                    # SGLang multiplies the softmax scale by YaRN's mscale(mscale_all_dim)
                    # squared (compute_mla_mscale_scaling); transformers' DeepSeek-V2 does
                    # not. At 0 that factor is 1 in both, and both scale cos/sin alike.
                    "mscale_all_dim": 0.0,
                },
            ),
        ),
    )
}


def family_of(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}") from None


def build_family_model(name: str, out: str | os.PathLike) -> Path:
    """Write family ``name``'s tiny model and the engine model's tokenizer to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_evict.models.engine_model import VOCAB_SIZE, build_tokenizer, folder_digests

    family = family_of(name)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = family.config(VOCAB_SIZE)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = None
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if type(model).__name__ != family.architecture:
        raise RuntimeError(f"{family.config_class} built {type(model).__name__}")
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGITS_SCALE)
    model.eval().save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "BUILD.json").write_text(
        json.dumps(
            {
                "family_version": FAMILY_VERSION,
                "family": name,
                "spec": family.spec(),
                "files": folder_digests(out),
            },
            indent=1,
        )
        + "\n"
    )
    return out


def default_family_dir(name: str) -> Path:
    from sglang_evict.models.engine_model import default_model_dir

    return default_model_dir().parent / f"family-{name}-v{FAMILY_VERSION}"


def ensure_family_model(name: str, folder: str | os.PathLike | None = None) -> Path:
    """Family ``name``'s folder, built on first use (reused when its files are intact),
    one builder at a time."""
    import fcntl

    from sglang_evict.models.engine_model import folder_digests

    family = family_of(name)
    folder = Path(folder) if folder is not None else default_family_dir(name)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            recorded = json.loads((folder / "BUILD.json").read_text())
        except (OSError, ValueError):
            recorded = {}
        if (
            recorded.get("family_version") == FAMILY_VERSION
            and recorded.get("family") == name
            and recorded.get("spec") == family.spec()
            and recorded.get("files") == folder_digests(folder)
        ):
            return folder
        return build_family_model(name, folder)
