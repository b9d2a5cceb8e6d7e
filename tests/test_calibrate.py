"""sglang-evict calibrate: statistics of pre-RoPE queries from an HF-format model."""

from __future__ import annotations

import pytest
import torch

from sglang_evict.calibrate import calibrate, held_out_agreement
from sglang_evict.cli.main import main
from sglang_evict.config import EvictionConfig
from sglang_evict.models.reference_loop import GenerationRequest, generate
from sglang_evict.models.reference_model import PagedLlama, build_tiny_llama
from sglang_evict.scorers.triattention import split_rope_pairs
from sglang_evict.scorers.triattention_stats import load_stats
from sglang_evict.srt.cpu_driver import MemoryDriver

TEXT = "The quick brown fox jumps over the lazy dog. " * 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_llama(seed=3).save_pretrained(path)
    (path / "calibration.txt").write_text(TEXT)
    return path


def test_calibrate_writes_stats_that_match_a_direct_computation(model_dir, capsys):
    out = model_dir / "stats.safetensors"
    argv = [
        "calibrate",
        "--model-path",
        str(model_dir),
        "--text",
        str(model_dir / "calibration.txt"),
        "--out",
        str(out),
        "--byte-tokens",
        "--chunk-tokens",
        "64",
    ]
    assert main(argv) == 0
    assert "wrote" in capsys.readouterr().out
    stats = load_stats(out)
    model = build_tiny_llama(seed=3)
    c = model.config
    assert (stats.num_layers, stats.num_heads, stats.head_dim) == (2, 4, 16)
    stats.check_model(
        num_layers=2, num_q_heads=4, head_dim=16, rope_style="half", rope_theta=10000.0
    )
    # Layer 0's queries depend only on the embeddings: recompute them directly.
    ids = torch.tensor(list(TEXT.encode())) % c.vocab_size
    layer = model.model.layers[0]
    with torch.no_grad():
        q = layer.self_attn.q_proj(layer.input_layernorm(model.model.embed_tokens(ids)))
    real, imag = split_rope_pairs(q.view(-1, 4, 16).double(), "half")
    torch.testing.assert_close(stats.q_mean_real[0], real.mean(0).float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats.q_mean_imag[0], imag.mean(0).float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        stats.q_abs_mean[0], torch.hypot(real, imag).mean(0).float(), rtol=1e-4, atol=1e-5
    )


def test_calibrated_stats_drive_the_triattention_scorer_in_the_loop(model_dir):
    out = model_dir / "stats.json"
    assert (
        main(
            [
                "calibrate",
                "--model-path",
                str(model_dir),
                "--text",
                str(model_dir / "calibration.txt"),
                "--out",
                str(out),
                "--byte-tokens",
            ]
        )
        == 0
    )
    config = EvictionConfig(
        kv_budget_tokens=48,
        cadence_tokens=16,
        window_tokens=16,
        scorer="triattention",
        scorer_params={"stats_path": str(out)},
        page_size=16,
    )
    hf = build_tiny_llama(seed=3)
    c = hf.config
    driver = MemoryDriver(
        page_size=16, num_tokens=2048, num_layers=2, num_kv_heads=2, head_dim=16, config=config
    )
    result = generate(driver, PagedLlama(hf), [GenerationRequest("a", list(range(40)), 100)])
    assert result.passes and c.num_hidden_layers == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"--model-path": "/nonexistent"}, "not an HF-format model folder"),
        ({"--text": "/nonexistent.txt"}, "does not exist"),
        ({"--out": "stats.pt"}, "must end in .safetensors or .json"),
    ],
)
def test_calibrate_bad_input_is_a_clear_error(model_dir, change, message, capsys):
    flags = {
        "--model-path": str(model_dir),
        "--text": str(model_dir / "calibration.txt"),
        "--out": str(model_dir / "x.safetensors"),
        **change,
    }
    argv = ["calibrate", *[item for pair in flags.items() for item in pair], "--byte-tokens"]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_calibrate_without_a_tokenizer_says_what_to_do(model_dir, capsys):
    argv = [
        "calibrate",
        "--model-path",
        str(model_dir),
        "--text",
        str(model_dir / "calibration.txt"),
        "--out",
        str(model_dir / "y.safetensors"),
    ]
    assert main(argv) == 2
    assert "--byte-tokens" in capsys.readouterr().err


def calibrate_argv(model_dir, out) -> list[str]:
    text = str(model_dir / "calibration.txt")
    return ["calibrate", "--model-path", str(model_dir), "--text", text, "--out", str(out)]


def test_check_says_a_stats_file_fits_its_model(model_dir, capsys):
    stats = model_dir / "fits.safetensors"
    assert main([*calibrate_argv(model_dir, stats), "--byte-tokens"]) == 0
    capsys.readouterr()
    assert main(["calibrate", "--model-path", str(model_dir), "--check", str(stats)]) == 0
    out = capsys.readouterr().out
    assert f"{stats} fits the model: 2 layers x 4 attention heads x head_dim 16" in out


def test_check_fails_stats_of_another_model_naming_both_shapes(model_dir, tmp_path, capsys):
    other = tmp_path / "other-model"
    build_tiny_llama(seed=3, num_layers=3).save_pretrained(other)
    (other / "calibration.txt").write_text(TEXT)
    stats = tmp_path / "other.json"
    assert main([*calibrate_argv(other, stats), "--byte-tokens"]) == 0
    capsys.readouterr()
    assert main(["calibrate", "--model-path", str(model_dir), "--check", str(stats)]) == 1
    out = capsys.readouterr().out
    assert "calibrate --check: FAIL" in out
    assert "the stats are for 3 layers x 4 attention heads x head_dim 16" in out
    assert "the model has 2 layers x 4 attention heads x head_dim 16" in out
    assert f"sglang-evict calibrate --model-path {model_dir} --text FILE" in out


def test_check_with_a_held_out_text_reports_how_close_the_mean_queries_are(model_dir, capsys):
    stats = model_dir / "held.json"
    assert main([*calibrate_argv(model_dir, stats), "--byte-tokens"]) == 0
    capsys.readouterr()
    argv = ["calibrate", "--model-path", str(model_dir), "--check", str(stats)]
    assert main([*argv, "--text", str(model_dir / "calibration.txt"), "--byte-tokens"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    # The same text as the calibration: the statistics agree exactly.
    assert line.startswith("calibrate --check: mean-query relative difference")
    assert "median 0.000, worst 0.000" in line


def test_held_out_agreement_is_zero_for_the_same_statistics_and_names_the_worst_head():
    model = build_tiny_llama(seed=3)
    text = torch.tensor(list(TEXT.encode())) % model.config.vocab_size
    stats = calibrate(model, text)
    same = held_out_agreement(stats, stats)
    assert (same.median, same.worst) == (0.0, 0.0)
    other = calibrate(model, torch.arange(200) % model.config.vocab_size)
    apart = held_out_agreement(stats, other)
    per_head = torch.hypot(
        stats.q_mean_real - other.q_mean_real, stats.q_mean_imag - other.q_mean_imag
    ).norm(dim=-1) / torch.hypot(other.q_mean_real, other.q_mean_imag).norm(dim=-1)
    layer, head = apart.worst_head
    assert apart.worst == pytest.approx(float(per_head.max()))
    assert per_head[layer, head] == per_head.max() and 0 < apart.median <= apart.worst
