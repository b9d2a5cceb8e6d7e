"""Token identity in SGLang's real engine (CPU, overlap scheduler on): with eviction the
engine generates exactly what the project's CPU reference loop generates for the same
checkpoint, prompts and policy, the server's or each request's own (and the reference
loop equals a masked full-cache replay). With a budget no request reaches, the engine
generates exactly what plain SGLang generates: ``test_engine_policy``."""

from __future__ import annotations

import pytest

from sglang_evict.cli.main import main as cli_main
from tests.engine_harness import (
    BUDGET,
    EngineSpec,
    assert_same_tokens,
    greedy,
    masked_replay,
    policy_fields,
    reference_outputs,
    shared_system_prompts,
)

pytestmark = pytest.mark.engine

# Several passes per request (one every CADENCE tokens once a request holds BUDGET +
# CADENCE); page size > 1 runs SGLang's allocator kernels under Triton's interpreter,
# so those cases generate fewer tokens (still at least 3 passes per request).
NEW_TOKENS_BY_PAGE = {1: 4 * BUDGET + 8, 4: 2 * BUDGET + 8}


@pytest.fixture(scope="module")
def prompts(engine_model):
    return shared_system_prompts(engine_model)


@pytest.fixture(scope="module")
def triattention_stats(engine_model, tmp_path_factory):
    """Statistics calibrated on this model with `sglang-evict calibrate`."""
    from sglang_evict.models.engine_model import _CORPUS

    folder = tmp_path_factory.mktemp("calibration")
    text = folder / "calibration.txt"
    text.write_text(_CORPUS * 4)
    out = folder / "stats.safetensors"
    status = cli_main(
        ["calibrate", "--model-path", str(engine_model), "--text", str(text), "--out", str(out)]
    )
    assert status == 0
    return str(out)


# The cases CI also runs on the other SGLang release: both page-size paths of the
# allocator hand-over.
ON_EVERY_RELEASE = pytest.mark.release_smoke

# (page size, the server's scorer, the scorer the requests choose (None: the server's),
# compaction, overlap scheduler). Requests choosing their scorer (a per-request policy)
# share the page-1 streaming engine.
CASES = [
    pytest.param(
        1, "streaming", None, "hole_fill", True, id="page1-streaming", marks=ON_EVERY_RELEASE
    ),
    pytest.param(1, "streaming", None, "hole_fill", False, id="page1-streaming-no-overlap"),
    pytest.param(1, "streaming", "knorm", "hole_fill", True, id="page1-knorm-per-request"),
    pytest.param(
        4, "knorm", None, "hole_fill", True, id="page4-hole_fill-knorm", marks=ON_EVERY_RELEASE
    ),
    pytest.param(4, "triattention", None, "repack", True, id="page4-repack-triattention"),
]


@pytest.mark.parametrize(("page_size", "scorer", "request_scorer", "compaction", "overlap"), CASES)
def test_engine_outputs_equal_the_cpu_reference_loop_under_eviction(
    engines,
    reference_model,
    prompts,
    triattention_stats,
    page_size,
    scorer,
    request_scorer,
    compaction,
    overlap,
):
    """With the overlap scheduler on (SGLang's default) and, once, with
    ``--disable-overlap-schedule``; once with every request choosing its scorer."""
    params = (
        {"scorer_params": {"stats_path": triattention_stats}} if scorer == "triattention" else {}
    )
    policy = policy_fields(scorer=scorer, compaction=compaction, **params)
    engine = engines.get(EngineSpec.plugin(page_size, overlap=overlap, **policy))
    custom = None
    new_tokens = NEW_TOKENS_BY_PAGE[page_size]
    sampling = greedy(new_tokens)
    if request_scorer is not None:
        custom = {"sglang_evict": {"scorer": request_scorer}}
        sampling = greedy(new_tokens, custom_params=custom)
    mark = engine.mark()
    outputs = engine.generate(prompts, sampling)
    engine_ids = [out["output_ids"] for out in outputs]

    expected, result = reference_outputs(
        reference_model,
        prompts,
        new_tokens,
        page_size=page_size,
        policy=policy,
        custom_params=None if custom is None else [custom] * len(prompts),
    )
    # The reference loop is itself a masked full-cache replay of its survivor sets.
    assert (
        masked_replay(
            reference_model, prompts, new_tokens, page_size=page_size, attended=result.attended
        )
        == expected
    )
    assert len(result.passes) >= 3 * len(prompts)
    assert_same_tokens(engine_ids, expected)
    # The engine really evicted (SGLang's own log) as often as the reference loop did.
    passes = [r for record in engine.pass_records(mark) for r in record["requests"]]
    assert len(passes) == len(result.passes)
    engines.report(
        f"identity page {page_size} {request_scorer or scorer} {compaction} overlap={overlap}",
        "passes (engine = reference), tokens evicted",
        f"{len(passes)}, {sum(r['tokens_before'] - r['tokens_after'] for r in passes)}",
    )
