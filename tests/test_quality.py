"""Quality: the recall-chain task, the committed reference model, ``sglang-evict eval``
and ``eval-gate``, and the kvpress peer (when its environment exists)."""

from __future__ import annotations

import copy
import json
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from sglang_evict.cli.main import main
from sglang_evict.quality.reference import harness, report
from sglang_evict.quality.reference.task import (
    FACT,
    FIRST_DISTRACTOR,
    FIRST_SYMBOL,
    NUM_SYMBOLS,
    PROMPT_TOKENS,
    QUERY,
    TaskSpec,
    held_out_samples,
    make_sample,
    score_chain,
)

CHECKPOINT = Path(__file__).resolve().parents[1] / "benches" / "quality" / "checkpoint"
FULL_CACHE_FLOOR = 0.95  # the target for the full cache on held-out sequences


def facts_in(sample) -> dict[int, int]:
    """The facts as written in the forced stream (``FACT k v``), read back by position."""
    stream = [*sample.prompt, *sample.forced]
    return {stream[i + 1]: stream[i + 2] for i, t in enumerate(stream) if t == FACT}


# --- the task ----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["spread", "middle"])
def test_task_generator_is_a_pure_function_of_spec_seed_and_index(variant):
    spec = TaskSpec(variant=variant)
    assert make_sample(spec, 3, 7) == make_sample(spec, 3, 7)
    assert make_sample(spec, 3, 7).tokens != make_sample(spec, 3, 8).tokens
    assert make_sample(spec, 3, 7).tokens != make_sample(spec, 4, 7).tokens
    assert len(make_sample(spec, 3, 7).tokens) == spec.total_tokens


@pytest.mark.parametrize("variant", ["spread", "middle"])
def test_every_answer_is_the_fact_of_the_previous_value_written_far_back(variant):
    spec = TaskSpec(variant=variant)
    for sample in held_out_samples(spec, seed=0, count=8):
        written = facts_in(sample)
        assert written == sample.successor  # the body holds exactly the facts
        assert len(written) == spec.num_facts
        stream = [*sample.prompt, *sample.forced]
        previous = sample.start
        distances = []  # tokens between the fact a step needs and the answer's start
        for token in sample.answer:  # recomputed from the written facts alone
            assert token == written[previous]
            key_position = next(
                i + 1 for i, t in enumerate(stream) if t == FACT and stream[i + 1] == previous
            )
            distances.append(len(stream) - key_position)
            previous = token
        distances.sort()
        if variant == "middle":  # every fact behind a long distractor run
            assert distances[0] > 64
        else:  # spread: most facts far back, a few may be recent
            assert distances[len(distances) // 2] > 64
        # Decoys: symbols off the walk remain at the last step (no elimination shortcut).
        unused = set(written) - {sample.start, *sample.answer}
        assert len(unused) >= spec.num_facts - spec.chain_steps - 1 >= 2
        assert all(FIRST_SYMBOL <= k < FIRST_SYMBOL + NUM_SYMBOLS for k in written)
        body = sample.forced[:-2]
        assert sample.forced[-2] == QUERY
        assert sum(t >= FIRST_DISTRACTOR for t in body) == spec.num_distractors


def test_middle_variant_puts_every_fact_in_the_middle_and_spread_does_not():
    def fact_spans(variant):
        spec = TaskSpec(variant=variant)
        spans = []
        for sample in held_out_samples(spec, seed=0, count=8):
            relative = [(p - PROMPT_TOKENS) / spec.body_tokens for p in sample.fact_positions]
            spans.append((min(relative), max(relative)))
        return spans

    for first, last in fact_spans("middle"):
        assert 0.25 < first and last < 0.75  # far from the sinks and from the window
    spread = fact_spans("spread")
    assert all(first < 0.15 and last > 0.8 for first, last in spread)


def test_score_chain_judges_each_step_on_its_own_retrieval():
    sample = make_sample(TaskSpec(), 0, 0)
    assert score_chain(sample, sample.answer).steps_correct == len(sample.answer)
    assert score_chain(sample, sample.answer).exact
    wrong = list(sample.answer)
    wrong[3] = next(k for k in sample.successor if k not in (wrong[3], wrong[2]))
    score = score_chain(sample, wrong)
    # Step 3 is wrong; step 4 is then judged on the fact of the wrong value: also wrong
    # here (the answer's token is not its successor), the rest right.
    assert not score.exact
    assert score.steps_correct == len(sample.answer) - 2
    with pytest.raises(ValueError, match="task asks for"):
        score_chain(sample, sample.answer[:-1])


def test_task_spec_rejects_impossible_shapes_by_name():
    with pytest.raises(ValueError, match="unknown task variant 'edge'"):
        TaskSpec(variant="edge")
    with pytest.raises(ValueError, match="chain_steps=32"):
        TaskSpec(num_facts=32, chain_steps=32)


# --- the committed checkpoint ------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_model():
    return harness.load_checkpoint(CHECKPOINT)


def test_committed_checkpoint_records_how_it_was_made():
    record = json.loads((CHECKPOINT / "training.json").read_text())
    assert record["command"].startswith("python3 benches/quality/train_reference_model.py")
    assert record["seed"] == 0 and record["versions"]["torch"]
    assert record["held_out"]["all"]["step_accuracy"] >= FULL_CACHE_FLOOR
    config = json.loads((CHECKPOINT / "config.json").read_text())
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA


@pytest.mark.parametrize("variant", ["spread", "middle"])
def test_committed_checkpoint_reaches_the_floor_through_generate_with_no_eviction(
    reference_model, variant
):
    from sglang_evict.quality.reference.training import greedy_chains

    samples = held_out_samples(TaskSpec(variant=variant), seed=0, count=2)
    outcome = harness.run_sequences(reference_model, samples, page_size=1)
    accuracy = sum(outcome.steps_correct) / sum(len(s.answer) for s in samples)
    assert accuracy >= FULL_CACHE_FLOOR
    # The paged path without a policy decodes what HF's own forward decodes.
    assert outcome.chains == greedy_chains(reference_model, samples)
    assert outcome.pages_freed == 0 and outcome.passes == 0


def test_teacher_forced_driver_feeds_the_stream_and_evicts_while_it_does(reference_model):
    spec = TaskSpec(num_facts=12, num_distractors=96, chain_steps=6)  # 142 tokens
    sample = held_out_samples(spec, seed=0, count=1)[0]
    settings = harness.EvalSettings(spec=spec)
    config = harness._policy_config(
        settings, harness.ScorerEntry("streaming"), budget=48, page_size=16
    )
    result = harness.run_sequence(reference_model, sample, 16, config)
    outputs = result.outputs["s"]
    assert tuple(outputs[: len(sample.forced)]) == sample.forced
    assert len(outputs) == len(sample.forced) + len(sample.answer)
    # Held KV stays within the trigger (budget + cadence) rounded up to pages.
    assert result.passes and max(result.held_tokens) <= 48 + 16 + 16
    # Passes ran before the answer began: the forced stream is what got evicted.
    assert result.passes[0][1] < len(sample.forced)


# --- sglang-evict eval / eval-gate --------------------------------------------------------


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("quality")
    code = main(
        [
            "eval",
            "--quick",
            "--sequences",
            "1",
            "--scorers",
            "streaming,knorm",
            "--budgets",
            "0.25,0.5",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    return out


def test_eval_quick_writes_results_json_png_and_table(quick_results):
    results = report.load_results(quick_results / "results.json")
    png = (quick_results / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "| sglang-evict | knorm | 16 |" in (quick_results / "results.md").read_text()
    entries = results["entries"]
    methods = {(e["method"], e["page_size"], e["budget_fraction"]) for e in entries}
    for page_size in (1, 16):
        assert ("full", page_size, 1.0) in methods
        for scorer in ("streaming", "knorm"):
            for budget in (0.25, 0.5):
                assert (scorer, page_size, budget) in methods
    full = next(e for e in entries if e["method"] == "full" and e["page_size"] == 1)
    assert full["step_accuracy"] >= 0.9 and full["pages_freed"] == 0
    evicting = [e for e in entries if e["method"] != "full" and e["page_size"] == 1]
    assert all(
        e["pages_freed"] > 0 and e["peak_pages_held"] < full["peak_pages_held"] for e in evicting
    )
    assert results["versions"]["sglang"] == version("sglang")  # the release it ran on


def test_eval_render_only_redraws_from_the_results_file(quick_results, tmp_path):
    out = tmp_path / "copy"
    out.mkdir()
    (out / "results.json").write_text((quick_results / "results.json").read_text())
    assert main(["eval", "--out", str(out), "--render-only"]) == 0
    assert (out / "results.png").stat().st_size > 10_000
    assert (out / "results.md").read_text() == (quick_results / "results.md").read_text()


def test_eval_is_deterministic(quick_results, reference_model):
    results = report.load_results(quick_results / "results.json")
    entry = next(e for e in results["entries"] if e["method"] == "knorm" and e["page_size"] == 16)
    model = reference_model
    settings = harness.EvalSettings(**harness.QUICK_SETTINGS | {"num_sequences": 1})
    config = harness._policy_config(
        settings, harness.ScorerEntry("knorm"), entry["budget_tokens"], 16
    )
    samples = settings.samples()
    outcomes = {v: harness.run_sequences(model, group, 16, config) for v, group in samples.items()}
    again = harness._summarise(outcomes, samples, 16)
    for key in ("step_accuracy", "peak_pages_held", "mean_pages_held", "pages_freed", "passes"):
        assert again[key] == entry[key], key
    assert again["by_variant"] == entry["by_variant"]


def write(path: Path, results: dict) -> str:
    path.write_text(json.dumps(results))
    return str(path)


def test_gate_exits_zero_when_every_entry_holds_the_floor(quick_results, tmp_path, capsys):
    results = report.load_results(quick_results / "results.json")
    passing = copy.deepcopy(results)
    for entry in passing["entries"]:
        entry["relative_step_accuracy"] = 1.0
    assert (
        main(["eval-gate", "--results", write(tmp_path / "ok.json", passing), "--floor", "0.9"])
        == 0
    )
    assert "eval-gate: ok" in capsys.readouterr().out


def test_gate_exits_non_zero_listing_the_entries_below_the_floor(quick_results, tmp_path, capsys):
    results = report.load_results(quick_results / "results.json")
    failing = copy.deepcopy(results)
    for entry in failing["entries"]:
        entry["relative_step_accuracy"] = 1.0
    bad = next(e for e in failing["entries"] if e["method"] == "knorm" and e["page_size"] == 16)
    bad["relative_step_accuracy"] = 0.5
    path = write(tmp_path / "bad.json", failing)
    assert main(["eval-gate", "--results", path, "--floor", "0.9"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: 1 of" in out and "knorm at budget" in out and "page size 16" in out
    assert "0.500 < floor 0.9" in out
    # Filters narrow the check: streaming alone passes.
    assert main(["eval-gate", "--results", path, "--floor", "0.9", "--scorer", "streaming"]) == 0


def test_gate_fails_entries_whose_full_cache_scored_zero(quick_results, tmp_path, capsys):
    results = report.load_results(quick_results / "results.json")
    broken = copy.deepcopy(results)
    for entry in broken["entries"]:
        entry["relative_step_accuracy"] = None
    path = write(tmp_path / "zero.json", broken)
    assert main(["eval-gate", "--results", path, "--floor", "0.9"]) == 1
    assert "full cache's step accuracy is 0" in capsys.readouterr().out


def test_gate_on_the_real_quick_results_matches_their_numbers(quick_results, capsys):
    results = report.load_results(quick_results / "results.json")
    lowest = min(e["relative_step_accuracy"] for e in results["entries"] if e["method"] != "full")
    path = str(quick_results / "results.json")
    expected = 0 if lowest >= 0.5 else 1
    assert main(["eval-gate", "--results", path, "--floor", "0.5"]) == expected
    assert main(["eval-gate", "--results", path, "--floor", f"{lowest + 0.01}"]) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["eval-gate", "--results", "/nonexistent/results.json", "--floor", "0.9"],
            "does not exist",
        ),
        (["eval-gate", "--results", "{malformed}", "--floor", "0.9"], "not valid JSON"),
        (["eval-gate", "--results", "{other}", "--floor", "0.9"], "not an `sglang-evict eval`"),
        (
            ["eval-gate", "--results", "{good}", "--floor", "0.9", "--scorer", "knrom"],
            "unknown scorer(s) ['knrom']",
        ),
        (
            ["eval-gate", "--results", "{good}", "--floor", "0.9", "--budget", "0.3"],
            "unknown budget(s)",
        ),
        (
            ["eval", "--quick", "--scorers", "knrom", "--out", "{tmp}"],
            "unknown scorer 'knrom'; known:",
        ),
        (
            ["eval", "--quick", "--scorers", "window:mood=last", "--out", "{tmp}"],
            "has no parameter 'mood'",
        ),
        (["eval", "--checkpoint", "/nonexistent", "--quick", "--out", "{tmp}"], "no config.json"),
        (["eval", "--quick", "--budgets", "1.5", "--out", "{tmp}"], "budget fraction 1.5"),
        (["eval", "--quick", "--budgets", "half", "--out", "{tmp}"], "budget 'half' is neither"),
        (["eval", "--quick", "--variants", "edge", "--out", "{tmp}"], "unknown task variant"),
    ],
)
def test_bad_inputs_are_rejected_with_a_clear_message(
    argv, message, quick_results, tmp_path, capsys
):
    malformed = tmp_path / "malformed.json"
    malformed.write_text('{"format": "sglang-evict/quality-results", "entries": [')
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    paths = {
        "{malformed}": str(malformed),
        "{other}": str(other),
        "{good}": str(quick_results / "results.json"),
        "{tmp}": str(tmp_path / "out"),
    }
    assert main([paths.get(a, a) for a in argv]) == 2
    assert message in capsys.readouterr().err


def test_scorer_entries_parse_parameters_and_label_themselves():
    entry = harness.parse_scorer_entry("window:mode=last:pool_kernel=3")
    assert entry.name == "window" and entry.params_dict() == {"mode": "last", "pool_kernel": 3}
    assert entry.label == "window:mode=last:pool_kernel=3"
    with pytest.raises(ValueError, match="not key=value"):
        harness.parse_scorer_entry("window:last")


# --- training ----------------------------------------------------------------------------


def test_training_is_bit_reproducible_and_seed_dependent():
    from sglang_evict.quality.reference.training import ModelShape, Stage, TrainConfig, train

    shape = ModelShape(
        hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
    )
    curriculum = (
        Stage(max_steps=3, facts=(4, 6), distractors=(0, 8), batch_size=4, advance_at=None),
    )
    threads = torch.get_num_threads()
    try:
        runs = [
            train(shape, TrainConfig(seed=seed, curriculum=curriculum, warmup_steps=1))[0]
            for seed in (0, 0, 1)
        ]
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)
    first, again, other = (dict(m.state_dict()) for m in runs)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


# --- the kvpress peer ---------------------------------------------------------------------


def test_kvpress_peer_on_the_same_model_and_sequences(reference_model, tmp_path):
    from sglang_evict.quality import kvpress_bridge
    from sglang_evict.quality.reference.kvpress import PEER_MODULE, write_job

    venv = kvpress_bridge.default_venv()
    if kvpress_bridge.probe(venv) is None:
        pytest.skip(
            f"no kvpress environment at {venv} (set {kvpress_bridge.VENV_ENV} or run "
            f"`sglang-evict eval --kvpress` once to create it)"
        )
    settings = harness.EvalSettings(**harness.QUICK_SETTINGS | {"num_sequences": 1})
    samples = settings.samples()
    job = write_job(
        tmp_path / "job.json",
        checkpoint=CHECKPOINT,
        samples=samples,
        budgets=[(0.5, settings.budget_tokens(0.5))],
        presses=["KnormPress"],
        modes=["prefill", "decoding"],
        cadence_tokens=settings.policy.cadence_tokens,
        sink_tokens=settings.policy.sink_tokens,
    )
    peer = kvpress_bridge.run_peer(
        venv, job, tmp_path / "peer.json", module=PEER_MODULE, progress=False
    )
    methods = {e["method"] for e in peer["entries"]}
    assert methods == {
        "kvpress:none",
        "kvpress:KnormPress(prefill)",
        "kvpress:KnormPress(decoding)",
    }
    assert peer["versions"]["transformers"].startswith("5.2")
    # kvpress's full cache decodes what our paged full cache decodes.
    ours = {
        v: harness.run_sequences(reference_model, group, 1).steps_correct
        for v, group in samples.items()
    }
    theirs = next(e for e in peer["entries"] if e["method"] == "kvpress:none")
    assert {v: theirs["by_variant"][v]["steps_correct"] for v in ours} == ours
    decoding = next(e for e in peer["entries"] if e["method"] == "kvpress:KnormPress(decoding)")
    assert (
        decoding["peak_tokens_held"]
        <= settings.budget_tokens(0.5) + settings.policy.cadence_tokens + 1
    )
