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
    peer_env          a peer's own virtual environment (kvpress,    (both)
                      transformers' quantized cache); running a
                      peer module in it
    kvpress_bridge    kvpress's environment (a ``peer_env``)        (both)
    cli               the three subcommands' flags and handlers     (both)

Import rule: ``reference`` and ``real`` import nothing of each other; the peers
(``reference.kvpress_peer``, ``real.kvpress_peer``, ``real.qcache_peer``) run in
environments of their own and import only pure modules (``reference.task``,
``real.needle``); everything that
touches SGLang goes through ``sglang_evict.srt`` (``forced``, the engine runner).
"""
