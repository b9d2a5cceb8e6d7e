"""Every bad input the CLI is known to meet: one line naming the flag or field and the
fix, exit status 2, no traceback, nothing written.

Each case is fixed where the input is read (model folder, stats file, results file,
flags), not by a catch-all: an unexpected exception would exit 1 with "internal error"
and fail these tests."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from sglang_evict.calibrate import calibrate
from sglang_evict.cli.main import main
from sglang_evict.models.reference_model import build_tiny_llama
from sglang_evict.scorers.triattention_stats import save_stats

RESULTS = Path(__file__).resolve().parents[1] / "benches" / "quality" / "results" / "results.json"


def _json_stats(folder: Path, name: str, change) -> None:
    path = folder / "good.json"
    document = json.loads(path.read_text())
    change(document)
    (folder / f"{name}.json").write_text(json.dumps(document))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """Placeholder -> path of every file the cases use."""
    root = tmp_path_factory.mktemp("bad-inputs")
    model = root / "model"
    build_tiny_llama().save_pretrained(model)
    config = (model / "config.json").read_text()
    weights = (model / "model.safetensors").read_bytes()
    folders = {
        "garbage": {"config.json": "{not json"},
        "noweights": {"config.json": config},
        "truncated": {"config.json": config, "model.safetensors": weights[: len(weights) // 2]},
        "nomodeltype": {"config.json": json.dumps({"architectures": ["LlamaForCausalLM"]})},
        "arrayconfig": {"config.json": "[1, 2]"},
        "latin1config": {"config.json": '{"model_type": "caf\xe9"}'.encode("latin-1")},
        "missing": {
            "config.json": json.dumps({**json.loads(config), "num_hidden_layers": 3}),
            "model.safetensors": weights,
        },
    }
    paths = {"{model}": str(model)}
    for name, files in folders.items():
        folder = root / name
        folder.mkdir()
        for file, content in files.items():
            mode = "wb" if isinstance(content, bytes) else "w"
            with open(folder / file, mode) as handle:
                handle.write(content)
        paths[f"{{{name}}}"] = str(folder)
    pickled = root / "pickle"
    pickled.mkdir()
    (pickled / "config.json").write_text(config)
    torch.save(build_tiny_llama().state_dict(), pickled / "pytorch_model.bin")
    paths["{pickle}"] = str(pickled)

    (root / "stats-dir.json").mkdir()
    (root / "text.txt").write_text("calibration text " * 20)
    (root / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 20)
    paths["{text}"], paths["{latin1}"] = str(root / "text.txt"), str(root / "latin1.txt")

    save_stats(calibrate(build_tiny_llama(), torch.arange(32)), root / "good.json")
    save_stats(calibrate(build_tiny_llama(num_layers=3), torch.arange(32)), root / "three.json")
    _json_stats(root, "string_tensor", lambda d: d.update(q_mean_real="abc"))
    _json_stats(root, "list_head_dim", lambda d: d.update(head_dim=[16]))
    _json_stats(root, "null_rope_theta", lambda d: d.update(rope_theta=None))
    _json_stats(root, "ragged", lambda d: d["q_abs_mean"][0][0].pop())
    _json_stats(root, "nan", lambda d: d["q_mean_imag"][1][2].__setitem__(0, math.nan))
    for name in ("good", "three", "string_tensor", "list_head_dim", "null_rope_theta"):
        paths[f"{{stats:{name}}}"] = str(root / f"{name}.json")
    paths["{stats:ragged}"], paths["{stats:nan}"] = (
        str(root / "ragged.json"),
        str(root / "nan.json"),
    )

    results = json.loads(RESULTS.read_text())
    for name, change in (
        ("half", lambda r: r["entries"][3].update(budget_fraction="half")),
        ("string_accuracy", lambda r: r["entries"][5].update(step_accuracy="0.9")),
        ("no_task", lambda r: r.pop("settings")),
        ("no_pages_held", lambda r: r["entries"][2].pop("peak_pages_held")),
    ):
        document = json.loads(json.dumps(results))
        change(document)
        folder = root / f"results-{name}"
        folder.mkdir()
        (folder / "results.json").write_text(json.dumps(document))
        paths[f"{{results:{name}}}"] = str(folder / "results.json")
        paths[f"{{results-dir:{name}}}"] = str(folder)
    return paths


SERVE = ["serve", "--kv-budget", "256"]
LOCAL = ["--model-path", "{model}", "--device", "cpu"]
TRIATTENTION = ["--kv-budget", "500", "--kv-scorer", "triattention", "--kv-scorer-stats"]
CALIBRATE = ["calibrate", "--text", "{text}", "--out", "{model}/../out.json", "--byte-tokens"]
GRPC = ["--kv-compactor", "grpc"]

# (case, argv, what the one line must say, environment)
CASES = [
    ("calibrate garbage config.json", [*CALIBRATE, "--model-path", "{garbage}"],
     "--model-path {garbage}: config.json is not valid JSON", {}),
    ("calibrate without weights", [*CALIBRATE, "--model-path", "{noweights}"],
     "--model-path {noweights}: no weights (model.safetensors)", {}),
    ("calibrate truncated safetensors", [*CALIBRATE, "--model-path", "{truncated}"],
     "model.safetensors is not a readable safetensors file", {}),
    ("calibrate pickle-only .bin", [*CALIBRATE, "--model-path", "{pickle}"],
     "holds only pickle weights (pytorch_model.bin)", {}),
    ("calibrate weights lacking tensors the config asks for",
     [*CALIBRATE, "--model-path", "{missing}"],
     "the weights lack 9 tensor(s) config.json asks for", {}),
    ("calibrate config without model_type", [*CALIBRATE, "--model-path", "{nomodeltype}"],
     "config.json must be a JSON object naming the architecture", {}),
    ("calibrate non-UTF-8 text",
     ["calibrate", "--model-path", "{model}", "--text", "{latin1}", "--out", "x.json"],
     "--text {latin1}: not UTF-8 text", {}),
    ("calibrate --max-tokens -1", [*CALIBRATE, "--model-path", "{model}", "--max-tokens", "-1"],
     "argument --max-tokens: -1 is out of range; allowed: [0, 2147483647]", {}),
    ("calibrate --chunk-tokens 1e20",
     [*CALIBRATE, "--model-path", "{model}", "--chunk-tokens", "100000000000000000000"],
     "argument --chunk-tokens: 100000000000000000000 is out of range; allowed: [1, 2147483647]",
     {}),
    ("calibrate without --out", ["calibrate", "--model-path", "{model}", "--text", "{text}"],
     "calibrate needs --text FILE and --out STATS", {}),
    ("calibrate --out in a directory that cannot be created",
     ["calibrate", "--model-path", "{model}", "--text", "{text}", "--out", "/proc/nope/x.json",
      "--byte-tokens"],
     "--out /proc/nope/x.json: cannot write it (cannot create /proc/nope", {}),
    ("calibrate --out naming a directory",
     ["calibrate", "--model-path", "{model}", "--text", "{text}", "--out",
      "{model}/../stats-dir.json", "--byte-tokens"],
     "--out {model}/../stats-dir.json: cannot write it (a directory)", {}),
    ("calibrate --out in an unwritable place",
     ["calibrate", "--model-path", "{model}", "--text", "{text}", "--out", "{text}/x.json",
      "--byte-tokens"],
     "--out {text}/x.json: cannot write it", {}),
    ("calibrate --check of a missing file",
     ["calibrate", "--model-path", "{model}", "--check", "{model}/absent.json"],
     "triattention stats file {model}/absent.json does not exist", {}),
    ("stats: string tensor", ["simulate", *TRIATTENTION, "{stats:string_tensor}"],
     "field 'q_mean_real' must be a nested list of numbers, got str", {}),
    ("stats: list head_dim", ["simulate", *TRIATTENTION, "{stats:list_head_dim}"],
     "field 'head_dim' must be an integer, got [16]", {}),
    ("stats: null rope_theta", ["simulate", *TRIATTENTION, "{stats:null_rope_theta}"],
     "field 'rope_theta' must be a finite number, got None", {}),
    ("stats: ragged tensor", ["simulate", *TRIATTENTION, "{stats:ragged}"],
     "field 'q_abs_mean' must be a rectangular nested list of numbers", {}),
    ("stats: NaN", ["simulate", *TRIATTENTION, "{stats:nan}"],
     "q_mean_imag holds NaN or infinite values", {}),
    ("serve stats: string tensor",
     ["serve", *TRIATTENTION, "{stats:string_tensor}", "--dry-run", *LOCAL],
     "field 'q_mean_real' must be a nested list of numbers", {}),
    ("serve stats: list head_dim",
     ["serve", *TRIATTENTION, "{stats:list_head_dim}", "--dry-run", *LOCAL],
     "field 'head_dim' must be an integer", {}),
    ("serve stats: null rope_theta",
     ["serve", *TRIATTENTION, "{stats:null_rope_theta}", "--dry-run", *LOCAL],
     "field 'rope_theta' must be a finite number", {}),
    ("serve stats of another model",
     ["serve", *TRIATTENTION, "{stats:three}", "--dry-run", *LOCAL],
     "the stats are for 3 layers x 4 attention heads x head_dim 16", {}),
    ("stats with a scorer that reads none",
     ["simulate", "--kv-budget", "500", "--kv-scorer-stats", "{stats:good}"],
     "--kv-scorer-stats is read by the triattention scorer only", {}),
    ("serve --page-size abc", [*SERVE, "--dry-run", *LOCAL, "--page-size", "abc"],
     "--page-size 'abc' is not an integer", {}),
    ("serve --kv-scorer window under torch.compile",
     [*SERVE, "--kv-scorer", "window", "--dry-run", *LOCAL, "--enable-torch-compile"],
     "--enable-torch-compile with --kv-scorer window is not supported yet", {}),
    ("serve --kv-scorer-param without =",
     [*SERVE, "--kv-scorer", "window", "--kv-scorer-param", "mode", "--dry-run", *LOCAL],
     "--kv-scorer-param 'mode': expected KEY=VALUE", {}),
    ("serve cumulative window with z-scores",
     [*SERVE, "--kv-scorer", "window", "--kv-scorer-param", "mode=cumulative", "--dry-run",
      *LOCAL],
     "window mode 'cumulative' adds scores across passes", {}),
    ("serve --kv-query-window 0", [*SERVE, "--kv-query-window", "0", "--dry-run", *LOCAL],
     "argument --kv-query-window: 0 is out of range; allowed: [1, 4096]", {}),
    ("serve config.json that is not JSON",
     [*SERVE, "--dry-run", "--model-path", "{garbage}", "--device", "cpu"],
     "--model-path {garbage}: config.json is not valid JSON", {}),
    ("serve config.json that is not an object",
     [*SERVE, "--dry-run", "--model-path", "{arrayconfig}", "--device", "cpu"],
     "--model-path {arrayconfig}: config.json must be a JSON object, got an array", {}),
    ("serve config.json that is not UTF-8",
     [*SERVE, "--dry-run", "--model={latin1config}", "--device", "cpu"],
     "--model-path {latin1config}: config.json is not valid JSON", {}),
    ("serve --kv-budget 1e20",
     ["serve", "--kv-budget", "100000000000000000000", "--dry-run", *LOCAL],
     "argument --kv-budget: 100000000000000000000 is out of range; allowed: [1, 2147483647]",
     {}),
    ("serve --kv-cadence 2**31", [*SERVE, "--kv-cadence", "2147483648", "--dry-run", *LOCAL],
     "argument --kv-cadence: 2147483648 is out of range; allowed: [1, 2147483647]", {}),
    ("serve --kv-compactor-timeout-ms 1e20",
     [*SERVE, "--kv-compactor-timeout-ms", "100000000000000000000", "--dry-run", *LOCAL],
     "argument --kv-compactor-timeout-ms: 100000000000000000000 is out of range", {}),
    ("serve --kv-request-max-budget 1e20",
     [*SERVE, "--kv-request-max-budget", "100000000000000000000", "--dry-run", *LOCAL],
     "argument --kv-request-max-budget: 100000000000000000000 is out of range", {}),
    ("simulate --tokens 1e20", ["simulate", "--kv-budget", "500", "--tokens", "1" + "0" * 20],
     "argument --tokens: 100000000000000000000 is out of range; allowed: [1, 2147483647]", {}),
    ("serve --kv-compactor-socket in a missing directory",
     [*SERVE, *GRPC, "--kv-compactor-socket", "{model}/absent/c.sock", "--dry-run", *LOCAL],
     "--kv-compactor-socket {model}/absent/c.sock: directory {model}/absent does not exist, "
     "so the scheduler cannot reach a compactor there; start the compactor first", {}),
    ("serve --kv-compactor-socket naming a regular file",
     [*SERVE, *GRPC, "--kv-compactor-socket", "{text}", "--dry-run", *LOCAL],
     "--kv-compactor-socket {text} exists and is not a socket", {}),
    ("serve --kv-compactor-pool-dir /proc/nope",
     [*SERVE, *GRPC, "--kv-compactor-pool-dir", "/proc/nope", "--dry-run", *LOCAL],
     "--kv-compactor-pool-dir /proc/nope: cannot create /proc/nope", {}),
    ("serve --kv-compactor-pool-dir naming a regular file",
     [*SERVE, *GRPC, "--kv-compactor-pool-dir", "{text}", "--dry-run", *LOCAL],
     "--kv-compactor-pool-dir {text}: {text} is not a directory", {}),
    ("serve malformed --kv-redis-url",
     [*SERVE, "--kv-redis-url", "redis://:pw@host:port/0", "--dry-run", *LOCAL],
     "--kv-redis-url: malformed Redis URL 'redis://:***@host:port/0'", {}),
    ("serve malformed $SGLANG_EVICT_REDIS_URL", [*SERVE, "--dry-run", *LOCAL],
     "$SGLANG_EVICT_REDIS_URL: 'http://:***@redis:6379' is not a Redis URL",
     {"SGLANG_EVICT_REDIS_URL": "http://:pw@redis:6379"}),
    ("serve missing --kv-redis-url-file",
     [*SERVE, "--kv-redis-url-file", "{model}/absent", "--dry-run", *LOCAL],
     "--kv-redis-url-file {model}/absent: cannot read it", {}),
    ("serve URL flag and file both",
     [*SERVE, "--kv-redis-url", "redis://h:1/0", "--kv-redis-url-file", "{text}", "--dry-run"],
     "give --kv-redis-url or --kv-redis-url-file, not both", {}),
    ("serve --kv-request-max-budget below --kv-budget",
     [*SERVE, "--kv-request-max-budget", "100", "--dry-run", *LOCAL],
     "request_max_budget_tokens=100 (--kv-request-max-budget) is below the server's own 256",
     {}),
    ("serve --kv-request-max-cadence below --kv-cadence",
     [*SERVE, "--kv-request-max-cadence", "64", "--dry-run", *LOCAL],
     "(--kv-request-max-cadence) is below the server's own 128", {}),
    ("serve --dry-run with a hub id",
     [*SERVE, "--dry-run", "--model-path", "org/model", "--device", "cpu"],
     "--model-path org/model: not a local folder", {}),
    ("serve unknown SGLang flag", [*SERVE, "--dry-run", *LOCAL, "--bogus-flag"],
     "unrecognized arguments: --bogus-flag", {}),
    ("serve --radix-cache-backend", [*SERVE, "--dry-run", *LOCAL, "--radix-cache-backend", "x"],
     "selects --radix-cache-backend sglang-evict itself", {}),
    ("eval-gate budget_fraction 'half'",
     ["eval-gate", "--results", "{results:half}", "--floor", "0.9"],
     "entry 3 field 'budget_fraction' must be a number in (0, 1], got 'half'", {}),
    ("eval-gate step_accuracy as a string",
     ["eval-gate", "--results", "{results:string_accuracy}", "--floor", "0.9"],
     "entry 5 field 'step_accuracy' must be a number in [0, 1], got '0.9'", {}),
    ("eval --render-only without settings.task",
     ["eval", "--render-only", "--out", "{results-dir:no_task}"],
     "lacks settings.task", {}),
    ("eval --render-only with an entry lacking peak_pages_held",
     ["eval", "--render-only", "--out", "{results-dir:no_pages_held}"],
     "entry 2 lacks ['peak_pages_held']", {}),
    ("simulate --page-size abc", ["simulate", "--kv-budget", "500", "--page-size", "abc"],
     "argument --page-size: invalid int value: 'abc'", {}),
    ("demo --log-dir under a file", ["demo", "--model", "tiny", "--log-dir", "{text}/logs"],
     "--log-dir {text}/logs: cannot create it (Not a directory)", {}),
    ("router without --worker-urls", ["router", "--policy", "cache_aware"],
     "the following arguments are required: --worker-urls", {}),
    ("router worker that is not a URL", ["router", "--worker-urls", "localhost:30000"],
     "--worker-urls takes http(s)://host:port URLs, got 'localhost:30000'", {}),
    ("router unreachable worker",
     ["router", "--worker-urls", "http://127.0.0.1:9", "--wait-s", "0"],
     "worker http://127.0.0.1:9 did not answer /get_server_info within 0 s", {}),
    ("router unknown policy", ["router", "--worker-urls", "http://127.0.0.1:9", "--policy", "x"],
     "argument --policy: invalid choice: 'x'", {}),
    ("tier bits", ["serve", "--kv-budget", "256", "--kv-tier-bits", "5", "--", "--model-path", "x"],
     "--kv-tier-bits 5: the tier stores 2, 3, 4 or 8 bits", {}),
    ("tier group", ["serve", "--kv-budget", "256", "--kv-tier-bits", "3", "--kv-tier-group",
                    "24", "--", "--model-path", "x"],
     "--kv-tier-group 24: a power of two of at least 8", {}),
    ("tier bound", ["serve", "--kv-budget", "256", "--kv-tier-bits", "3", "--kv-tier-tokens",
                    "16", "--", "--model-path", "x"],
     "--kv-tier-tokens 16: the tier holds whole groups of 32 tokens", {}),
    ("tier, flashinfer backend", [*SERVE, "--kv-tier-bits", "3", "--dry-run", *LOCAL,
                                  "--attention-backend", "flashinfer"],
     "--kv-tier-bits with --attention-backend flashinfer: the tier's attention merges with "
     "SGLang's torch_native or triton backends only so far; pass --attention-backend "
     "torch_native", {}),
    ("tier, triton backend on a GPU", [*SERVE, "--kv-tier-bits", "3", "--dry-run",
                                       "--model-path", "{model}", "--device", "cuda",
                                       "--attention-backend", "triton"],
     "--kv-tier-bits with --attention-backend triton on cuda: the tier's merge with "
     "triton's decode has run in SGLang's engine on CPU only", {}),
    ("tier, another decode backend", [*SERVE, "--kv-tier-bits", "3", "--dry-run", *LOCAL,
                                      "--attention-backend", "torch_native",
                                      "--decode-attention-backend", "triton"],
     "--kv-tier-bits with --decode-attention-backend triton: the tier's attention merges "
     "with one attention backend for the whole server, here --attention-backend "
     "torch_native; drop --decode-attention-backend", {}),
    ("tier, sidecar on a GPU", [*SERVE, "--kv-tier-bits", "3", *GRPC, "--dry-run",
                                "--model-path", "{model}", "--device", "cuda",
                                "--attention-backend", "torch_native"],
     "--kv-tier-bits with --kv-compactor grpc on cuda: the tier's arena is shared with the "
     "sidecar on CPU only so far (its CUDA IPC export has not run on a GPU yet)", {}),
    ("tier, fp8 KV", [*SERVE, "--kv-tier-bits", "3", "--dry-run", *LOCAL,
                      "--attention-backend", "torch_native", "--kv-cache-dtype", "fp8_e4m3"],
     "--kv-tier-bits with --kv-cache-dtype fp8_e4m3: the tier quantizes from a 16- or 32-bit",
     {}),
    ("tier flags without the tier's bits",
     ["serve", "--kv-budget", "256", "--kv-tier-group", "16", "--kv-tier-pool-share", "0.3",
      "--", "--model-path", "x"],
     "--kv-tier-group, --kv-tier-pool-share without --kv-tier-bits: no tier runs without "
     "its bits; add --kv-tier-bits 3", {}),
    ("tier outliers without the tier's bits, demo",
     ["demo", "--model", "tiny", "--kv-tier-outliers", "2"],
     "--kv-tier-outliers without --kv-tier-bits", {}),
    ("tier in simulate", ["simulate", "--kv-budget", "500", "--kv-tier-bits", "3"],
     "so simulate refuses it", {}),
    ("eval-tier kinds", ["eval-tier", "--kinds", "code7,color", "--no-ppl"],
     "--kinds ['color']: known needle kinds", {}),
    ("eval-tier candidates", ["eval-tier", "--candidates", "5:32"],
     "--candidates 5:32: tier bits 5 not supported", {}),
    ("eval-tier candidate form", ["eval-tier", "--candidates", "3-32"],
     "--candidates '3-32': 'evict', 'evict:SCORER' or BITS:GROUP[:OUTLIERS[:VALUE_GROUP]]"
     "[/SCORER]", {}),
    ("eval-tier candidate scorer", ["eval-tier", "--candidates", "3:32/nosuch"],
     "--candidates 3:32/nosuch: scorer 'nosuch'; known:", {}),
    ("eval-tier render nothing", ["eval-tier", "--render-only", "--out", "{model}/none"],
     "--render-only: no {model}/none/results.json to draw from", {}),
]  # fmt: skip


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("argv", "message", "environment"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_input_is_one_line_naming_it_and_exit_status_2(
    argv, message, environment, inputs, capsys, monkeypatch
):
    monkeypatch.delenv("SGLANG_EVICT_REDIS_URL", raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)

    def fill(text: str) -> str:
        for placeholder, path in inputs.items():
            text = text.replace(placeholder, path)
        return text

    code, out, err = run_cli([fill(arg) for arg in argv], capsys)
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2, err
    assert len(errors) == 1 and errors[0] == err.strip().splitlines()[-1], err
    assert errors[0].startswith("sglang-evict")
    assert fill(message) in errors[0]
    assert "Traceback" not in out + err
    assert not (Path(inputs["{model}"]).parent / "out.json").exists()


def test_dry_run_without_device_on_a_machine_without_an_accelerator(inputs, capsys):
    from sglang_evict.srt.server_args import no_accelerator

    if not no_accelerator():
        pytest.skip("this machine has an accelerator: SGLang picks it without --device")
    argv = [*SERVE, "--dry-run", "--model-path", inputs["{model}"]]
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and "Traceback" not in out + err
    assert err.strip().splitlines()[-1] == (
        "sglang-evict serve: error: no accelerator (CUDA, XPU, HPU, NPU, MUSA, MPS) on this "
        "machine for SGLang to pick: add --device cpu to validate (or serve) on CPU, or run "
        "where the GPU is"
    )


@pytest.mark.parametrize(
    "out", ["/proc/nope/stats.json", "{text}/stats.json", "{model}/../stats-dir.json"]
)
def test_calibrate_refuses_an_unwritable_out_before_computing_anything(inputs, capsys, out):
    """The output path is checked first: no model loaded, no text read, no progress."""
    import time

    for placeholder, path in inputs.items():
        out = out.replace(placeholder, path)
    argv = ["calibrate", "--model-path", inputs["{model}"], "--text", inputs["{text}"]]
    started = time.monotonic()
    code, stdout, err = run_cli([*argv, "--out", out, "--byte-tokens"], capsys)
    assert time.monotonic() - started < 5
    assert code == 2 and stdout == ""  # before: "calibrating on 340 tokens in 1 chunks"
    (line,) = err.strip().splitlines()  # no weight-loading nor calibration progress bar
    assert line.startswith(f"sglang-evict calibrate: error: --out {out}: cannot write it")


@pytest.mark.parametrize("where", ["default", "existing directory"])
def test_dry_run_takes_a_socket_the_compactor_has_not_created_yet(
    inputs, capsys, monkeypatch, tmp_path, where
):
    """The compactor creates its socket's directory when it starts; a dry run refuses a
    missing one, except for the default socket, which the compactor makes at its default
    path (a dry run before the compactor is started must pass)."""
    from compactor_service import runtime_dir

    if where == "default":
        socket = tmp_path / "runtime" / "compactor.sock"  # directory not created
        monkeypatch.setattr(runtime_dir, "DEFAULT_SOCKET", str(socket))
    else:
        socket = tmp_path / "compactor.sock"  # directory there, no socket yet
    argv = [*SERVE, *GRPC, "--kv-compactor-socket", str(socket), "--dry-run"]
    argv += ["--kv-compactor-pool-dir", str(tmp_path / "pool"), "--model-path", inputs["{model}"]]
    code, out, err = run_cli([*argv, "--device", "cpu"], capsys)
    assert code == 0, err
    assert out.startswith("# checks passed")
    assert not (tmp_path / "pool").exists()  # checked, not created: a dry run starts nothing
