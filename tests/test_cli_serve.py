"""`sglang-evict serve` (and its --dry-run) on a local model folder, run as a user runs
it: the same refusals as a scheduler's startup, output that pastes into a shell, and the
Redis URL kept out of every printed line and every command line."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from compactor_service.secrets import REDIS_URL_ENV
from sglang_evict.calibrate import calibrate
from sglang_evict.cli import flags as cli_flags
from sglang_evict.cli import main as cli
from sglang_evict.scorers.triattention_stats import save_stats
from sglang_evict.srt.server_args import CONFIG_ENV, config_from_env, parse_server_args
from tests.sglang_harness import NUM_LAYERS, Engine
from tests.test_plugin import build_context, engine_shaped_llama

PASSWORD = "hunter2-s3cret"
REDIS_URL = f"redis://:{PASSWORD}@redis.internal:6379/0"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A local model folder of the harness engine's shape (so the server-side factory
    can be built over the model the dry run reads), at a path holding a space."""
    path = tmp_path_factory.mktemp("tiny llama")
    engine_shaped_llama().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def stats_of_another_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("stats") / "three-layers.safetensors"
    save_stats(calibrate(engine_shaped_llama(NUM_LAYERS + 1), torch.arange(32)), path)
    return path


def serve(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["serve", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_dry_run_prints_an_environment_and_command_that_paste_into_a_shell(model_dir, capsys):
    code, out, _ = serve(
        capsys,
        *("--kv-budget", "512", "--kv-scorer", "knorm", "--dry-run"),
        *("--model-path", str(model_dir), "--device", "cpu", "--page-size", "16"),
    )
    assert code == 0
    lines = out.strip().splitlines()
    (export,) = [line for line in lines if line.startswith(f"export {CONFIG_ENV}=")]
    pasted = subprocess.run(
        ["bash", "-c", f"{export}\nprintenv {CONFIG_ENV}"], capture_output=True, text=True
    )
    policy = json.loads(pasted.stdout)
    assert (policy["kv_budget_tokens"], policy["scorer"]) == (512, "knorm")
    assert shlex.split(lines[-1]) == [
        sys.executable,
        *("-m", "sglang.launch_server", "--model-path", str(model_dir)),
        *("--device", "cpu", "--page-size", "16", "--radix-cache-backend", "sglang-evict"),
    ]


def _factory_verdict(server_args, policy: dict) -> str | None:
    """What a scheduler's radix-cache factory says for these server args and policy."""
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_evict.srt.active import Active
    from sglang_evict.srt.backend import radix_cache_factory

    previous = os.environ.get(CONFIG_ENV)
    os.environ[CONFIG_ENV] = json.dumps(policy)
    manager = Active.manager
    try:
        context = build_context(
            Engine(page_size=16),
            server_args,
            model_config=ModelConfig.from_server_args(server_args),
        )
        radix_cache_factory(context)
        return None
    except ValueError as error:
        return str(error)
    finally:
        Active.manager = manager
        if previous is None:
            os.environ.pop(CONFIG_ENV)
        else:
            os.environ[CONFIG_ENV] = previous


def test_dry_run_on_cpu_with_tensor_parallelism_exports_gloo_and_cores_per_rank(
    model_dir, capsys, monkeypatch
):
    """``--device cpu --tp-size 2``: SGLang needs gloo (no NCCL library) and one core set
    per rank there; ``serve`` sets both, and a value the user set is left alone."""
    argv = ("--kv-budget", "512", "--kv-scorer", "knorm", "--dry-run", "--model-path")
    argv += (str(model_dir), "--device", "cpu", "--tp-size", "2")
    monkeypatch.delenv("SGLANG_NCCL_SO_PATH", raising=False)
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    code, out, _ = serve(capsys, *argv)
    assert code == 0
    exports = dict(
        line.removeprefix("export ").split("=", 1)
        for line in out.splitlines()
        if line.startswith("export SGLANG_")
    )
    assert not os.path.exists(exports["SGLANG_NCCL_SO_PATH"])
    assert len(exports["SGLANG_CPU_OMP_THREADS_BIND"].strip("'").split("|")) == 2
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|0")
    code, out, _ = serve(capsys, *argv)
    assert code == 0 and "export SGLANG_CPU_OMP_THREADS_BIND" not in out
    assert "export SGLANG_NCCL_SO_PATH" in out
    code, out, _ = serve(capsys, *argv[:-2])  # one rank: nothing to set
    assert code == 0 and "export SGLANG_NCCL_SO_PATH" not in out


def test_dry_run_on_a_cpu_exports_the_triton_interpreter_serve_sets(model_dir, capsys, monkeypatch):
    """Without a GPU SGLang's Triton kernels (the ``triton`` attention backend, 0.5.17's
    paged allocator) have no driver but the interpreter: ``serve`` sets
    ``TRITON_INTERPRET=1`` and its dry run says so; a value the user set is left alone."""
    argv = ("--kv-budget", "512", "--kv-scorer", "knorm", "--dry-run", "--model-path")
    argv += (str(model_dir), "--device", "cpu", "--attention-backend", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # as on this machine
    code, out, _ = serve(capsys, *argv)
    assert code == 0 and "export TRITON_INTERPRET=1" in out.splitlines()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    code, out, _ = serve(capsys, *argv)
    assert code == 0 and "TRITON_INTERPRET" not in out


@pytest.mark.parametrize(
    ("eviction_flags", "sglang_flags"),
    [
        ((), ()),
        (("--kv-scorer", "window"), ()),
        (("--kv-scorer", "rkv"), ()),
        ((), ("--enable-mixed-chunk",)),
        ((), ("--speculative-algorithm", "NGRAM")),
        ((), ("--disable-radix-cache",)),
        ((), ("--kv-cache-dtype", "fp8_e4m3")),
        (("--kv-scorer", "triattention", "--kv-scorer-stats", "{other}"), ()),
        (("--kv-scorer", "triattention", "--kv-scorer-stats", "{fitting}"), ()),
    ],
)
def test_dry_run_refuses_exactly_what_server_startup_refuses(
    model_dir, stats_of_another_model, tmp_path, capsys, eviction_flags, sglang_flags
):
    from sglang_evict.srt.server_args import parse_server_args

    fitting = tmp_path / "fitting.safetensors"
    save_stats(calibrate(engine_shaped_llama(), torch.arange(32)), fitting)
    paths = {"{other}": str(stats_of_another_model), "{fitting}": str(fitting)}
    eviction_flags = [paths.get(flag, flag) for flag in eviction_flags]
    sglang_argv = ["--model-path", str(model_dir), "--device", "cpu", *sglang_flags]
    code, _, err = serve(capsys, "--kv-budget", "256", *eviction_flags, "--dry-run", *sglang_argv)

    args = cli.build_parser().parse_known_args(["serve", "--kv-budget", "256", *eviction_flags])
    args[0].page_size = 1
    policy = json.loads(cli_flags.config_from_args(args[0]).to_json())
    server_verdict = _factory_verdict(parse_server_args(sglang_argv, dry_run=True), policy)
    if server_verdict is None:
        assert code == 0, err
    else:
        assert code == 2
        assert err.strip().splitlines()[-1] == f"sglang-evict serve: error: {server_verdict}"


def test_dry_run_of_an_mla_model_starts_and_refuses_the_tier(tmp_path, capsys):
    """DeepSeek V3's MLA pool runs with eviction (tests/test_engine_mla.py proves V2's);
    the tier has no layout for its latent rows: one line naming the flag, exit 2."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(tmp_path)
    argv = ("--dry-run", "--model-path", str(tmp_path), "--device", "cpu")
    code, _, err = serve(capsys, "--kv-budget", "256", *argv)
    assert code == 0, err
    code, _, err = serve(capsys, "--kv-budget", "256", "--kv-tier-bits", "3", *argv)
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert "--kv-tier-bits on DeepseekV3ForCausalLM" in line and "latent rows" in line


@pytest.mark.parametrize(
    ("config_class", "architecture", "refused"),
    [
        ("GptOssConfig", "GptOssForCausalLM", "sliding-window (hybrid SWA) models"),
    ],
)
def test_dry_run_refuses_models_whose_kv_is_not_in_an_mha_pool(
    tmp_path, capsys, config_class, architecture, refused
):
    """config.json is all a dry run reads: no weights are needed to refuse a model."""
    import transformers

    config = getattr(transformers, config_class)(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2
    )
    config.architectures = [architecture]
    config.save_pretrained(tmp_path)
    code, _, err = serve(
        capsys, "--kv-budget", "256", "--dry-run", "--model-path", str(tmp_path), "--device", "cpu"
    )
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert refused in line and architecture in line and "MHATokenToKVPool" in line


@pytest.fixture
def captured_exec(monkeypatch):
    """What `serve` (without --dry-run) would exec: SGLang itself cannot start here."""
    calls = []

    def fake_execve(path, argv, env):
        calls.append((path, list(argv), dict(env)))

    monkeypatch.setattr(cli.os, "execve", fake_execve)
    return calls


@pytest.mark.parametrize("source", ["file", "environment", "flag"])
def test_redis_password_is_never_printed_nor_on_a_command_line(
    model_dir, tmp_path, monkeypatch, capsys, captured_exec, source
):
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    url_flags = []
    if source == "file":
        secret = tmp_path / "redis url"
        secret.write_text(REDIS_URL + "\n")
        url_flags = ["--kv-redis-url-file", str(secret)]
    elif source == "environment":
        monkeypatch.setenv(REDIS_URL_ENV, REDIS_URL)
    else:
        url_flags = ["--kv-redis-url", REDIS_URL]
    argv = [
        *("--kv-budget", "256", "--kv-lease-store", "redis", *url_flags),
        *("--model-path", str(model_dir), "--device", "cpu"),
    ]
    code, out, err = serve(capsys, *argv, "--dry-run")
    assert code == 0 and PASSWORD not in out + err
    assert "redis://:***@redis.internal:6379/0" in out
    if source == "file":  # the printed line, pasted, reads the file
        (line,) = [line for line in out.splitlines() if line.startswith(f"export {REDIS_URL_ENV}")]
        pasted = subprocess.run(
            ["bash", "-c", f"{line}\nprintenv {REDIS_URL_ENV}"], capture_output=True, text=True
        )
        assert pasted.stdout.strip() == REDIS_URL
    if source == "flag":
        assert "carries a password" in err

    assert serve(capsys, *argv)[0] == 0  # starts the server: exec captured
    ((_, command, env),) = captured_exec
    assert not any(PASSWORD in part for part in command)
    assert PASSWORD not in env[CONFIG_ENV] and env[REDIS_URL_ENV] == REDIS_URL
    # The scheduler's side: the policy it reads has the URL, its repr does not show it.
    config = config_from_env(16, env)
    assert config.redis_url == REDIS_URL and PASSWORD not in repr(config)


def test_dry_run_without_an_accelerator_says_to_add_device_cpu_in_one_line(model_dir):
    """The console script as a user runs it: one line, exit 2, no traceback, and none of
    the third-party import notices that say nothing here."""
    from sglang_evict.srt.server_args import no_accelerator
    from sglang_evict.warnings_filter import KNOWN_LOG_RECORDS, KNOWN_WARNINGS

    if not no_accelerator():
        pytest.skip("this machine has an accelerator: SGLang picks it without --device")
    command = ["serve", "--kv-budget", "256", "--dry-run", "--model-path", str(model_dir)]
    result = subprocess.run(
        [sys.executable, "-m", "sglang_evict.cli.main", *command],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("sglang-evict serve: error: no accelerator")
    assert "add --device cpu" in lines[-1]
    assert "Traceback" not in result.stderr
    for known in (*KNOWN_WARNINGS, *KNOWN_LOG_RECORDS):
        assert not re.search(known.message, result.stderr), known


def test_parsing_a_servers_arguments_leaves_this_processs_environment_as_it_was(model_dir):
    """SGLang 0.5.17's parsing sets process-wide switches for the server it prepares
    (``SGLANG_ENABLE_CP_V2`` for a Llama); left in this process, SGLang's PrefillAdder
    here asked for a context-parallel group no one created, and the admission tests
    failed whenever they ran after these in one process."""
    from tests.test_admission import adder, policy

    before = dict(os.environ)
    parse_server_args(["--model-path", str(model_dir), "--device", "cpu"], dry_run=True)
    assert dict(os.environ) == before
    engine = Engine(page_size=1, config=policy(1))
    assert adder(engine, []).rem_total_tokens > 0  # SGLang's admission runs here after it
