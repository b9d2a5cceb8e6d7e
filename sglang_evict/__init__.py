"""sglang-evict: decode-time KV-cache token eviction for SGLang that returns real memory.

The top of the package holds the entry points and the layers; each layer that has
parts is a package with its own table.

    entry points      job
    plugin            SGLang's plugin entry point (group ``sglang.srt.plugins``)
    cli/              the ``sglang-evict`` command: its subcommands, the shared
                      eviction flags, ``serve``, ``demo``, ``router``
    calibrate         ``sglang-evict calibrate``: ``triattention``'s statistics

    layers (pure first)  job
    config            one policy's knobs, validated once
    request_policy    one request's policy within the server's limits; its KV bound
    admission         how much KV an evicting request can still take (host ints)
    scorers/          how important each cached token is (one scorer a file)
    passes/           the eviction pass: policy (``passes.batch``, ``selection``,
                      ``planner``) and the mechanism that owns per-request state
                      (``passes.manager``)
    tier/             the quantized tier's policy: what a pass demotes instead of
                      evicting, the bytes a request holds (format and kernels:
                      ``sglang_evict_kernels.tier_*``)
    query_capture     the query ring the query-reading scorers read
    metrics           the plugin's Prometheus metrics
    srt/              everything that touches SGLang internals (the only package)
    models/           the models run here (tiny random ones, one per architecture;
                      the real ones from PyPI) and the references the engine is held to
    quality/          the two quality evaluations (reference model, real model)

    helpers           job
    plotting          headless matplotlib for the PNGs
    triton_env        Triton's interpreter on a machine without a GPU
    warnings_filter   third-party notices silenced in one place

Import rule (``tests/test_import_rule.py``): only ``srt`` imports ``sglang``; no import
circles; the policy modules of ``passes`` import none of its mechanism; nothing outside
``quality`` imports ``quality`` (the evaluation imports the product, never the reverse).
"""

__version__ = "0.1.0"
