"""The compactor: applies compaction plans to a KV pool (in-process or as a sidecar).

Imports only the kernels package (``sglang_evict_kernels``), never ``sglang`` or
``sglang_evict``, so it runs in a lean process.
"""
