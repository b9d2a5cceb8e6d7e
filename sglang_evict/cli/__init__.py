"""The ``sglang-evict`` command line: one module a job.

    module          job
    console         the console script (``sglang-evict``): the sidecar's health probe
                    dispatched before torch is imported, every other command to ``main``
    main            the parser and the subcommands but ``serve``, ``demo`` and ``router``
    flags           the eviction flags every subcommand shares -> ``EvictionConfig``
    serve_command   ``serve``: the start-up checks, then SGLang's own server
    serve_checks    what ``serve`` and ``calibrate`` refuse before starting
    demo            ``sglang-evict demo``: SGLang's engine with and without eviction
    router          ``sglang-evict router``: SGLang's router before evicting replicas

The product's other layers never import this package; it imports them.
"""
