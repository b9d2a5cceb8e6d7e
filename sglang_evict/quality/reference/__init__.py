"""The reference-model evaluation (``sglang-evict eval``, ``eval-gate``): a small Llama
trained here on the recall-chain task, whose answers are known, run through SGLang's
memory classes for every scorer x budget x page size.

| module       | cares about                                | in -> out                     |
|--------------|--------------------------------------------|-------------------------------|
| task         | the recall-chain task (pure Python)        | seed -> sequences; scores     |
| training     | training the reference model (CPU, seeded) | shape, curriculum -> model    |
| harness      | the scorer x budget x page size matrix     | checkpoint -> results         |
| kvpress      | the job kvpress's peer runs                | sequences -> job JSON         |
| kvpress_peer | kvpress on the same model (its own venv)   | job JSON -> results JSON      |
| report       | plot, Markdown table, the gate             | results -> PNG, text, verdict |

Import rule: ``task`` imports nothing of the project (the kvpress peer runs it under
another ``transformers``); ``kvpress_peer`` imports only ``task``.
"""
