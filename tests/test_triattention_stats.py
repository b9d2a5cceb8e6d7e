"""Stats files: safetensors and JSON round trips; every bad file is a clear error."""

from __future__ import annotations

import json
import re

import pytest
import torch

from sglang_evict.scorers import build_scorer
from sglang_evict.scorers.triattention_stats import TriAttentionStats, load_stats, save_stats


def sample_stats(layers=2, heads=4, head_dim=8, style="half"):
    g = torch.Generator().manual_seed(0)
    shape = (layers, heads, head_dim // 2)
    return TriAttentionStats(
        q_mean_real=torch.randn(shape, generator=g),
        q_mean_imag=torch.randn(shape, generator=g),
        q_abs_mean=torch.rand(shape, generator=g) + 1,
        freq_scale=torch.ones(head_dim // 2),
        rope_style=style,
        rope_theta=500000.0,
        head_dim=head_dim,
    )


@pytest.mark.parametrize("suffix", [".safetensors", ".json"])
def test_round_trip(tmp_path, suffix):
    stats = sample_stats(style="interleaved")
    path = tmp_path / f"stats{suffix}"
    save_stats(stats, path)
    loaded = load_stats(path)
    for name in ("q_mean_real", "q_mean_imag", "q_abs_mean", "freq_scale"):
        assert torch.equal(getattr(loaded, name), getattr(stats, name)), name
    assert (loaded.rope_style, loaded.rope_theta, loaded.head_dim) == ("interleaved", 500000.0, 8)
    scorer = build_scorer("triattention", {"stats_path": str(path)})
    assert scorer.stats.num_heads == 4


def test_pickle_files_are_refused_without_being_opened(tmp_path):
    path = tmp_path / "stats.pt"
    path.write_bytes(b"not even read")
    with pytest.raises(ValueError, match="pickle"):
        load_stats(path)


def test_missing_file_says_how_to_make_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="sglang-evict calibrate"):
        load_stats(tmp_path / "nope.safetensors")


def test_wrong_format_tag_and_version_are_refused(tmp_path):
    path = tmp_path / "s.json"
    save_stats(sample_stats(), path)
    document = json.loads(path.read_text())
    path.write_text(json.dumps({**document, "format": "other"}))
    with pytest.raises(ValueError, match="not a triattention stats file"):
        load_stats(path)
    path.write_text(json.dumps({**document, "version": 9}))
    with pytest.raises(ValueError, match="version 9"):
        load_stats(path)


def test_corrupt_files_are_refused(tmp_path):
    bad = tmp_path / "s.safetensors"
    bad.write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="not a readable safetensors"):
        load_stats(bad)
    bad_json = tmp_path / "s.json"
    bad_json.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_stats(bad_json)


def test_mismatched_shapes_in_file_are_refused(tmp_path):
    path = tmp_path / "s.json"
    save_stats(sample_stats(), path)
    document = json.loads(path.read_text())
    document["q_abs_mean"] = document["q_abs_mean"][:1]
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="q_abs_mean shape"):
        load_stats(path)


def test_model_mismatch_lists_every_difference():
    stats = sample_stats()
    stats.check_model(num_layers=2, num_q_heads=4, head_dim=8, rope_style="half")
    with pytest.raises(ValueError) as error:
        stats.check_model(
            num_layers=3, num_q_heads=8, head_dim=8, rope_style="interleaved", rope_theta=10000.0
        )
    message = str(error.value)
    for fragment in (
        "the stats are for 2 layers x 4 attention heads x head_dim 8",
        "the model has 3 layers x 8 attention heads x head_dim 8",
        "layers: stats have 2, model has 3",
        "attention heads",
        "rope_style",
        "rope_theta",
        "re-run calibration",
    ):
        assert fragment in message


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"head_dim": "abc"}, "field 'head_dim' must be an integer, got 'abc'"),
        ({"rope_theta": "inf"}, "field 'rope_theta' must be a finite number, got 'inf'"),
        ({"rope_theta": "-5"}, "rope_theta=-5.0 must be a positive finite number"),
        ({"rope_style": "spiral"}, "unknown rope_style 'spiral'"),
    ],
)
def test_safetensors_metadata_of_the_wrong_type_names_the_field(tmp_path, metadata, message):
    from safetensors.torch import save_file

    from sglang_evict.scorers.triattention_stats import _metadata

    stats = sample_stats()
    tensors = {n: getattr(stats, n) for n in ("q_mean_real", "q_mean_imag", "q_abs_mean")}
    path = tmp_path / "stats.safetensors"
    save_file(tensors, str(path), metadata={**_metadata(stats), **metadata})
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        load_stats(path)
    assert str(path) in str(refused.value) and "sglang-evict calibrate" in str(refused.value)
