"""The real-model evaluations (``sglang-evict eval-real``, ``sglang-evict eval-tier``):
SmolLM2-135M-Instruct
(``sglang-evict real-model``: 4-bit weights dequantised) and the Paul Graham essays
(``sglang-evict real-text``), each task through the path a user runs.

| module        | cares about                                   | in -> out                      |
|---------------|-----------------------------------------------|--------------------------------|
| needle        | the needle prompts and the check (pure)       | essays, seed -> samples; found |
| needle_engine | the needle task in SGLang's real engine       | samples, policy -> answers     |
| perplexity    | decode-time perplexity through the decode path| text -> NLL per token          |
| kvpress       | the job kvpress's peer runs, its results      | token ids -> peer entries      |
| kvpress_peer  | kvpress's presses on the same ids (own venv)  | job JSON -> results JSON       |
| evaluation    | the run: settings, resumable results          | settings -> results.json       |
| report        | tables and the plot                           | results.json -> .md, .png      |
| frontier      | eviction and the tier at equal KV bytes: how  | candidate, bytes -> config;    |
|               | a candidate spends them, one needle answer    | prompt -> answer, bytes held   |
|               | through the paged reference path              |                                |
| frontier_run  | ``eval-tier``: settings, resumable results    | settings -> results.json       |
| frontier_engine | the frontier's needles through SGLang's     | samples, candidates ->         |
|               | engine: plain, eviction, the tier             | answers, bytes held            |
| frontier_report | its tables, the frontier plot, the rule     | results.json -> .md, .png      |
|               | that picks the tier's defaults                |                                |
| qcache        | the job transformers' quantized cache runs,   | token ids -> peer rows,        |
|               | its results on the frontier's bytes axis      | fractions                      |
| qcache_peer   | ``QuantizedCache`` (quanto, HQQ) on the same  | job JSON -> results JSON       |
|               | ids, the bytes its tensors hold (own venv)    |                                |

Import rule: ``needle`` is pure Python (the kvpress peer builds the same prompts under
its own ``transformers``); ``kvpress_peer`` and ``qcache_peer`` import only ``needle``.
"""
