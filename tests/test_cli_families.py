"""What `sglang-evict serve --dry-run` says of each family's config.json (no weights
read, nothing started): the windowed families refused with a backend that windows by
KV index and, with the tier, a recent window narrower than theirs; the tier refused
for a head dim its kernels lack and for attention soft-capping; an architecture the
engine tests do not run started with a warning naming the validated ones."""

from __future__ import annotations

import pytest

from sglang_evict.cli import main as cli
from sglang_evict.models.families import FAMILIES, WINDOW_TOKENS
from sglang_evict.srt.server_args import VALIDATED_ARCHITECTURES

pytestmark = pytest.mark.sglang

TIER_FLAGS = ("--kv-tier-bits", "3", "--kv-tier-group", "16", "--kv-tier-tokens", "64")


def config_folder(tmp_path, name, **overrides):
    config = FAMILIES[name].config(512)
    for key, value in overrides.items():
        setattr(config, key, value)
    config.architectures = [FAMILIES[name].architecture]
    folder = tmp_path / name
    config.save_pretrained(folder)
    return folder


def dry_run(capsys, folder, *flags, backend="torch_native"):
    argv = ["serve", "--kv-budget", "256", *flags, "--dry-run"]
    argv += ["--model-path", str(folder), "--device", "cpu"]
    if backend:
        argv += ["--attention-backend", backend]
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


MLA = {"deepseek_v2"}  # knorm on the latent rows, no tier: below


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_passes_the_dry_run_with_torch_native_and_the_tier(tmp_path, capsys, name):
    folder = config_folder(tmp_path, name)
    flags = () if name == "gemma2" else TIER_FLAGS  # soft-capping: below
    backend = "torch_native"
    if name in MLA:  # the engine test's settings (tests/test_engine_mla.py)
        flags, backend = ("--kv-scorer", "knorm"), "triton"
    code, out, err = dry_run(
        capsys, folder, *flags, "--kv-window", str(WINDOW_TOKENS), backend=backend
    )
    assert code == 0, err
    assert f"({FAMILIES[name].architecture})" in out
    assert "has not validated" not in err


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_a_windowed_model_under_a_backend_windowing_by_kv_index_is_refused(
    tmp_path, capsys, backend
):
    folder = config_folder(tmp_path, "gemma3")
    code, _, err = dry_run(capsys, folder, backend=backend)
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert f"sliding-window layers (window {WINDOW_TOKENS})" in line
    assert "--attention-backend torch_native" in line and "Gemma3ForCausalLM" in line


def test_the_tier_on_a_windowed_model_needs_a_recent_window_covering_its_window(tmp_path, capsys):
    folder = config_folder(tmp_path, "gemma3")
    code, _, err = dry_run(capsys, folder, *TIER_FLAGS, "--kv-window", str(WINDOW_TOKENS - 1))
    assert code == 2
    assert f"pass --kv-window {WINDOW_TOKENS} or more" in err.strip().splitlines()[-1]
    code, _, err = dry_run(capsys, folder, "--kv-window", str(WINDOW_TOKENS - 1))
    assert code == 0, err  # eviction alone: windowed layers see what is kept in them,
    (warning,) = [line for line in err.splitlines() if "--kv-window" in line]
    assert f"a sliding window of {WINDOW_TOKENS} tokens" in warning  # and it is said
    assert f"--kv-window {WINDOW_TOKENS} keeps every windowed layer's window" in warning
    code, _, err = dry_run(capsys, folder, "--kv-window", str(WINDOW_TOKENS))
    assert code == 0 and "--kv-window" not in err, err


def test_the_tier_refuses_attention_soft_capping_and_a_head_dim_its_kernels_lack(tmp_path, capsys):
    code, _, err = dry_run(capsys, config_folder(tmp_path, "gemma2"), *TIER_FLAGS)
    assert code == 2
    assert "attn_logit_softcapping 50.0" in err and "drop --kv-tier-*" in err
    folder = config_folder(tmp_path, "qwen3", head_dim=96)
    code, _, err = dry_run(capsys, folder, *TIER_FLAGS)
    assert code == 2
    assert "its head dim is 96, the tier's kernels hold 64, 128, 256" in err


def test_an_architecture_no_engine_test_runs_starts_with_a_warning(tmp_path, capsys):
    from transformers import PhiConfig

    config = PhiConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    config.architectures = ["PhiForCausalLM"]
    config.save_pretrained(tmp_path)
    code, _, err = dry_run(capsys, tmp_path)
    assert code == 0, err
    warning = next(line for line in err.splitlines() if "has not validated" in line)
    assert "PhiForCausalLM" in warning and "Gemma3ForCausalLM" in warning
    assert all(family.architecture in VALIDATED_ARCHITECTURES for family in FAMILIES.values())


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (("--kv-scorer", "window"), "--kv-scorer window on DeepseekV2ForCausalLM"),
        (("--kv-scorer", "rkv"), "--kv-scorer rkv on DeepseekV2ForCausalLM"),
        (("--kv-scorer", "knorm", *TIER_FLAGS), "--kv-tier-bits on DeepseekV2ForCausalLM"),
        (("--kv-scorer", "knorm", "--kv-compactor", "grpc"), "--kv-compactor grpc on"),
    ],
)
def test_mla_refuses_what_its_latent_rows_cannot_serve(tmp_path, capsys, flags, names):
    """One line naming the flag, exit 2, nothing started."""
    folder = config_folder(tmp_path, "deepseek_v2")
    code, out, err = dry_run(capsys, folder, *flags, backend="triton")
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert names in line, err
    assert "dry run" not in out.lower()


def test_mla_starts_with_streaming_and_knorm(tmp_path, capsys):
    folder = config_folder(tmp_path, "deepseek_v2")
    for scorer in ("streaming", "knorm"):
        code, out, err = dry_run(capsys, folder, "--kv-scorer", scorer, backend="triton")
        assert code == 0, err
        assert "(DeepseekV2ForCausalLM)" in out
