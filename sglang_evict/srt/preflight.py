"""What would stop an engine from starting, checked without starting it (and without the
device it names): a GPU is lent rarely and briefly, and an engine that fails at start
there costs minutes of it.

``preflight`` builds, from an engine not started (``engine_runner.EngineProcess``: its
``sglang.Engine`` arguments, policy and environment), what the server builds before it
touches the device:

1. SGLang's ``ServerArgs`` (an argument this release does not have fails here);
2. the plugin's start-up refusals (``server_args.startup_problems``) for the model;
3. the KV pool left after the plugin's reservations, each computed by the hook the
   server runs, in its order (``resolve_pool_hooks``: the query ring, the pass graphs'
   pool, the tier's arena), when ``max_total_tokens`` fixes the pool (unset, SGLang sizes
   it from the device's memory, which only the device knows).

The pool's check follows 0.5.17's ``KVCacheConfigurator`` (the release the lent GPU
runs); on 0.5.23 it is skipped. Nothing here reads or allocates device memory.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from types import SimpleNamespace

from sglang_evict.srt.versioned import IS_0_5_23


@contextmanager
def _environment(env: dict[str, str]):
    """``os.environ`` replaced by ``env``, restored whole afterwards (SGLang's argument
    parsing writes to it)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def preflight(engine) -> list[str]:
    """Every reason ``engine`` (an ``engine_runner.EngineProcess`` not started: its
    ``sglang.Engine`` arguments, policy and environment) would fail to start, one line
    each; empty when none is found."""
    from sglang.srt.server_args import ServerArgs

    kwargs = dict(engine.engine_kwargs)
    # unset, SGLang takes the machine's accelerator, which here may be none: the engine
    # checked is the GPU's
    kwargs.setdefault("device", "cuda")
    with _environment(engine.environment(os.environ)):
        try:
            server_args = ServerArgs(**kwargs)
        except Exception as error:  # what SGLang raises is its own: report any
            return [f"SGLang's ServerArgs refuses these arguments: {type(error).__name__}: {error}"]
        if engine.policy_json is None:
            return []
        return _plugin_problems(server_args)


def _plugin_problems(server_args) -> list[str]:
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_evict.srt.server_args import config_from_env, model_facts, startup_problems

    page_size = server_args.page_size or 1
    try:
        config = config_from_env(page_size)
    except ValueError as error:
        return [f"the policy: {error}"]
    try:
        model_config = ModelConfig.from_server_args(server_args)
    except Exception as error:  # SGLang's own errors for a model it cannot read
        return [f"the model {server_args.model_path}: {type(error).__name__}: {error}"]
    facts = model_facts(model_config, is_hybrid_swa=False, is_hybrid_ssm=False, is_dsa=False)
    problems = startup_problems(server_args, config, facts)
    if problems or server_args.max_total_tokens is None or IS_0_5_23:
        return problems
    return _pool_problems(server_args, model_config, page_size)


def _pool_problems(server_args, model_config, page_size: int) -> list[str]:
    """The reservations' hooks on a 0.5.17-shaped configurator; their module state is
    put back as it was."""
    import torch

    from sglang_evict.srt import capture, resolve_pool_hooks, tier

    kv_dtype = server_args.kv_cache_dtype
    kv_cache_dtype = model_config.dtype if kv_dtype in (None, "auto") else _dtype(kv_dtype)
    if kv_cache_dtype is None:
        return [f"preflight cannot size a KV pool of --kv-cache-dtype {kv_dtype}"]
    configurator = SimpleNamespace(
        server_args=server_args,
        page_size=page_size,
        is_draft_worker=False,
        model_config=model_config,
        layer_info=SimpleNamespace(num_effective_layers=model_config.num_hidden_layers),
        kv_cache_dtype=kv_cache_dtype,
        model_dtype=model_config.dtype,
        device=server_args.device,
        ps=SimpleNamespace(attn_tp_size=server_args.tp_size or 1),
    )
    pool_config = SimpleNamespace(
        max_total_num_tokens=server_args.max_total_tokens,
        # unset, SGLang derives it from the pool; one row is the least it can be
        max_running_requests=server_args.max_running_requests or 1,
    )
    saved = (capture.STATE.plan, tier.STATE.plan)
    try:
        with torch.device("cpu"):  # whatever the hooks make stays off the named device
            for hook in resolve_pool_hooks():
                pool_config = hook(pool_config, configurator)
    except ValueError as error:
        return [str(error)]
    finally:
        capture.STATE.plan, tier.STATE.plan = saved
    return []


def _dtype(name: str):
    """The torch dtype of a ``--kv-cache-dtype`` name, or None when not known here."""
    import torch

    aliases = {
        "bf16": "bfloat16",
        "fp16": "float16",
        "half": "float16",
        "fp32": "float32",
        "fp8_e4m3": "float8_e4m3fn",
        "fp8_e5m2": "float8_e5m2",
    }
    dtype = getattr(torch, aliases.get(name, name), None)
    return dtype if isinstance(dtype, torch.dtype) else None
