"""Quality measurement: a reference model trained here, a task with known answers, the
evaluation harness, kvpress as a peer, and an accuracy gate.

| module         | cares about                                | in -> out                     |
|----------------|--------------------------------------------|-------------------------------|
| task           | the recall-chain task (pure Python)        | seed -> sequences; scores     |
| training       | training the reference model (CPU, seeded) | shape, curriculum -> model    |
| forced         | teacher-forced decoding on the real driver | forced tokens -> decode input |
| harness        | the scorer x budget x page size matrix     | checkpoint -> results         |
| kvpress_bridge | the kvpress environment, job and results   | sequences -> peer results     |
| kvpress_peer   | kvpress on the same model (its own venv)   | job JSON -> results JSON      |
| report         | plot, Markdown table, the gate             | results -> PNG, text, verdict |
| cli            | ``sglang-evict eval`` and ``eval-gate``    | flags -> the above            |

Import rule: ``task`` imports nothing of the project (the kvpress peer runs it under
another ``transformers``); ``kvpress_peer`` imports only ``task``; everything that
touches SGLang goes through ``sglang_evict.srt`` (``forced``) and the
reference loop.
"""
