"""Quality measurement: what eviction does to a model's answers, in two evaluations
that share only what both use.

    package / module  cares about                                   command
    reference/        a small model trained here on a task with     ``sglang-evict eval``,
                      known answers (recall chains): the scorer x   ``eval-gate``
                      budget x page-size matrix, the CI gate
    real/             a real pretrained model (SmolLM2-135M-        ``sglang-evict
                      Instruct, 4-bit weights dequantised) on real  eval-real``
                      text: needles in SGLang's engine, decode-time
                      perplexity, kvpress's presses
    forced            teacher-forced decoding through SGLang's      (both)
                      memory classes
    kvpress_bridge    kvpress's own environment; running a peer     (both)
                      module in it
    cli               the three subcommands' flags and handlers     (both)

Import rule: ``reference`` and ``real`` import nothing of each other; the kvpress peers
(``reference.kvpress_peer``, ``real.kvpress_peer``) run under another ``transformers``
and import only pure modules (``reference.task``, ``real.needle``); everything that
touches SGLang goes through ``sglang_evict.srt`` (``forced``, the engine runner).
"""
