"""SGLang plugin entry point (group ``sglang.srt.plugins``).

SGLang's ``load_plugins()`` calls ``register()`` in every process it starts, the
scheduler included, then applies the registered hooks. Importing this module has no
side effects; ``register()`` is idempotent and, against an SGLang release other than
the one the adapter targets, fails with a message saying which to install.
"""

from __future__ import annotations


def register() -> None:
    # Importing sglang_evict.srt checks the SGLang version before any internal is touched.
    from sglang_evict.srt import install
    from sglang_evict.srt.process_start import fork_if_asked

    fork_if_asked()
    install()
