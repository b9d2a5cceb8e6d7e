"""``sglang-evict serve``: check the plugin's flags, SGLang's flags and the model the way
every scheduler will at start-up, then replace this process with SGLang's own server
(``sglang.launch_server``), the policy in ``$SGLANG_EVICT_CONFIG`` and the Redis URL in
``$SGLANG_EVICT_REDIS_URL``; ``--dry-run`` prints them instead."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from sglang_evict.cli.flags import config_from_args
from sglang_evict.cli.serve_checks import check_compactor_paths, check_model_config
from sglang_evict.triton_env import use_triton_interpreter_without_gpu


def _page_size_of(sglang_argv: list[str]) -> int:
    """``--page-size`` among SGLang's arguments (1, SGLang's default, when absent)."""
    page_size = "1"
    for i, flag in enumerate(sglang_argv):
        if flag == "--page-size":
            if i + 1 == len(sglang_argv):
                raise ValueError("--page-size needs a value: the KV page size in tokens, e.g. 16")
            page_size = sglang_argv[i + 1]
        elif flag.startswith("--page-size="):
            page_size = flag.split("=", 1)[1]
    try:
        return int(page_size)
    except ValueError:
        raise ValueError(
            f"--page-size {page_size!r} is not an integer; pass the KV page size in tokens, "
            f"e.g. --page-size 16"
        ) from None


def _redis_url(args: argparse.Namespace) -> tuple[str | None, str]:
    """The Redis URL (flag, file or environment; validated) and a line for the dry run
    saying how it reaches the server, without its password."""
    import shlex

    from compactor_service.secrets import REDIS_URL_ENV, redact_url, resolve_redis_url

    url = resolve_redis_url(args.kv_redis_url, args.kv_redis_url_file, flag="--kv-redis-url")
    if url is None:
        return None, ""
    shown = redact_url(url)
    if args.kv_redis_url_file:
        path = shlex.quote(args.kv_redis_url_file)
        return url, f'export {REDIS_URL_ENV}="$(cat {path})"  # {shown}'
    if not args.kv_redis_url:
        return url, f"# {REDIS_URL_ENV} ({shown}) is taken from this environment"
    if shown == url:
        return url, f"export {REDIS_URL_ENV}={shlex.quote(url)}"
    print(
        f"sglang-evict serve: warning: --kv-redis-url carries a password, readable by every "
        f"user in the process list; pass it in ${REDIS_URL_ENV} or --kv-redis-url-file FILE",
        file=sys.stderr,
    )
    hint = f"# export {REDIS_URL_ENV}={shlex.quote(shown)} with the real password (not printed)"
    return url, hint


def tier_bytes_line(config, model) -> str | None:
    """The dry run's line on what one request holds at most under the tier (None: no
    tier, or the model's shape is not known)."""
    hf = getattr(model, "hf_text_config", None)
    if config.tier_bits is None or hf is None:
        return None
    from sglang_evict.scorers.triattention_stats import model_shape_of
    from sglang_evict.tier.policy import TierPolicy, full_bytes_per_token, max_kv_bytes

    shape = model_shape_of(hf)
    kv_heads = int(getattr(hf, "num_key_value_heads", None) or shape.num_q_heads)
    fmt = config.tier_format(shape.head_dim)
    args = dict(layers=shape.num_layers, kv_heads=kv_heads, full_dtype=torch.bfloat16)
    full = config.kv_budget_tokens + config.cadence_tokens
    most = max_kv_bytes(
        max_full_tokens=full, policy=TierPolicy(fmt, config.tier_max_tokens), **args
    )
    per_token = full_bytes_per_token(fmt, **args)
    return (
        f"# per request at most: {full} full-precision tokens (budget + cadence) and "
        f"{config.tier_max_tokens} tier tokens at {config.tier_bits} bits = "
        f"{most / 2**20:.2f} MiB (bfloat16 accounting; its protected prompt aside), the "
        f"bytes of {most / per_token:.0f} full-precision tokens"
    )


def query_ring_line(config, server_args, gpu_memory_mib: float | None) -> str | None:
    """The dry run's line on the query ring (None: the scorer reads no queries and no
    GPU size was asked for): sized against SGLang's KV pool on a GPU of
    ``gpu_memory_mib`` (``sglang_evict.srt.pool_estimate``), or per slot without one."""
    from sglang_evict.scorers import SCORERS

    if not SCORERS[config.scorer].needs_queries:
        if gpu_memory_mib is None:
            return None
        return f"# no query ring: --kv-scorer {config.scorer} reads no queries"
    from sglang_evict.srt.pool_estimate import ring_line

    if gpu_memory_mib is None:
        return (
            "# query ring: its slots follow the KV pool (KV pool // (--kv-budget + 1)); "
            "add --gpu-memory-gib GIB to size it against SGLang's pool on such a GPU"
        )
    return ring_line(config, server_args, gpu_memory_mib)


def serve(args: argparse.Namespace, sglang_argv: list[str]) -> int:
    """``sglang-evict serve``: the plugin's start-up checks, then SGLang's own server in
    this process's place (``--dry-run``: the environment and command instead)."""
    import shlex

    from compactor_service.secrets import REDIS_URL_ENV

    args.page_size = _page_size_of(sglang_argv)
    redis_url, redis_line = _redis_url(args)
    args.kv_redis_url = redis_url
    config = config_from_args(args)  # our flags first: nothing of SGLang is loaded yet
    users_env = set(os.environ)
    use_triton_interpreter_without_gpu()
    if args.dry_run:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a dry run never downloads
    from sglang_evict.calibrate import first_line
    from sglang_evict.srt.engine_runner import cpu_tp_env
    from sglang_evict.srt.server_args import (
        CONFIG_ENV,
        backend_flags,
        check_startup,
        model_facts_from_server_args,
        model_warnings,
        parse_server_args,
    )

    check_model_config(sglang_argv)
    gpu_memory_gib = getattr(args, "gpu_memory_gib", None)
    if gpu_memory_gib is not None and not args.dry_run:
        raise ValueError(
            "--gpu-memory-gib sizes a dry run for a GPU this machine may not have; a real "
            "start measures its own: add --dry-run or drop --gpu-memory-gib"
        )
    gpu_memory_mib = None if gpu_memory_gib is None else gpu_memory_gib * 1024
    try:
        server_args = parse_server_args(
            sglang_argv, dry_run=args.dry_run, gpu_memory_mib=gpu_memory_mib
        )
    except OSError as error:  # SGLang reading the model's config (e.g. given via --config)
        raise ValueError(
            f"SGLang cannot read the model's configuration: {first_line(error)}"
        ) from None
    model = model_facts_from_server_args(server_args)
    check_startup(server_args, config, model)  # what every scheduler checks at startup
    for line in model_warnings(model, config):
        print(f"sglang-evict serve: warning: {line}", file=sys.stderr)
    check_compactor_paths(config, getattr(server_args, "device", None), args.dry_run)
    command = [sys.executable, "-m", "sglang.launch_server", *sglang_argv, *backend_flags()]
    env = {**os.environ, CONFIG_ENV: config.to_json()}
    # On CPU: SGLang's tensor parallelism without AMX needs gloo and a core set per rank
    # (``cpu_tp_env``), and its Triton kernels (the ``triton`` attention backend; the
    # paged allocator of 0.5.17 at pages > 1) find no driver unless interpreted
    # (``use_triton_interpreter_without_gpu`` above). The user's own settings win; the
    # dry run prints what serve adds.
    cpu_env = {}
    if getattr(server_args, "device", None) == "cpu":
        cpu_env = cpu_tp_env(getattr(server_args, "tp_size", 1) or 1)
        if "TRITON_INTERPRET" in os.environ:
            cpu_env["TRITON_INTERPRET"] = os.environ["TRITON_INTERPRET"]
        cpu_env = {key: value for key, value in cpu_env.items() if key not in users_env}
    env.update(cpu_env)
    if redis_url:  # through the environment, never on the command line
        env[REDIS_URL_ENV] = redis_url
    if args.dry_run:
        architectures = ", ".join(model.architectures) or "?"
        print(f"# checks passed: policy, SGLang flags, model {model.path} ({architectures})")
        bytes_line = tier_bytes_line(config, model)
        if bytes_line:
            print(bytes_line)
        ring = query_ring_line(config, server_args, gpu_memory_mib)
        if ring:
            print(ring)
        if redis_line:
            print(redis_line)
        for key, value in cpu_env.items():
            print(f"export {key}={shlex.quote(value)}")
        print(f"export {CONFIG_ENV}={shlex.quote(config.to_json())}")
        print(shlex.join(command))
        return 0
    # Replace this process: SGLang receives the container's signals (SIGTERM drains it)
    # directly, with no parent in between to forward them.
    sys.stdout.flush()
    os.execve(sys.executable, command, env)
    return 0  # not reached
