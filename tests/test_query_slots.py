"""The query ring's shared slots: only a request a pass may read holds one, a slot
handed on is emptied first, a row without a slot reads nothing (even where the scratch
slot holds real positions), admission waits while every slot is held, and the dry run
sizes the ring against SGLang's KV pool on a GPU this machine does not have. The ring's
invariants are checked after every operation."""

from __future__ import annotations

import json
import subprocess
import sys
from array import array
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import AddReqResult
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_evict.config import EvictionConfig
from sglang_evict.query_capture import QueryRing, RingShape, default_slots
from sglang_evict.request_policy import RequestLimits
from sglang_evict.srt import admission as srt_admission
from sglang_evict.srt.active import Active
from sglang_evict.srt.capture import claim_query_rows, needs_query_slot
from sglang_evict.srt.introspection import ring_problem
from sglang_evict.srt.request_policy import attach_policy
from sglang_evict.srt.versioned import req_kv

LAYERS, Q_HEADS, HEAD_DIM, WINDOW = 2, 4, 8, 4


def shared_ring(rows: int = 6, slots: int = 2) -> QueryRing:
    return QueryRing(RingShape(LAYERS, rows, WINDOW, Q_HEADS, HEAD_DIM, torch.float32, slots))


def queries_at(positions) -> torch.Tensor:
    base = torch.as_tensor(positions, dtype=torch.float32)
    return base.view(1, -1, 1, 1).expand(LAYERS, -1, Q_HEADS, HEAD_DIM).clone()


def held(ring: QueryRing, row: int, next_position: int) -> list[int]:
    window = ring.window_of(torch.tensor([row]), torch.tensor([next_position]))
    return sorted(window.positions[0][window.valid[0]].tolist())


def checked(ring: QueryRing) -> QueryRing:
    ring.check_invariants()
    return ring


def test_only_requests_that_need_a_slot_hold_one_and_a_row_without_reads_nothing():
    ring = checked(shared_ring())
    assert ring.reserve("a") and ring.reserve("b") and not ring.reserve("c")
    assert ring.reserve("a")  # a request holding one keeps it
    checked(ring).claim_rows([1, 2, 3], [1, 1, 1], ["a", "b", "c"], [True, True, False])
    checked(ring)
    for row, base in ((1, 0), (2, 100), (3, 200)):
        ring.record(row, queries_at(range(base, base + 6)), torch.arange(base, base + 6))
    assert held(ring, 1, 6) == [2, 3, 4, 5] and held(ring, 2, 106) == [102, 103, 104, 105]
    # Row 3's queries went to the scratch slot, which now holds real positions: a read
    # of the row still finds none.
    assert int(ring.positions[ring.scratch_slot].max()) >= 200
    assert held(ring, 3, 206) == []
    assert ring.slot_misses == 0 and ring.free_slots == 0


def test_a_slot_handed_on_is_emptied_and_a_reused_row_without_a_slot_reads_nothing():
    ring = shared_ring()
    ring.reserve("a")
    ring.claim_rows([1], [1], ["a"], [True])
    ring.record(1, queries_at(range(10)), torch.arange(10))
    ring.release("a")
    checked(ring)
    assert ring.free_slots == 2 and ring.slot_holders() == []
    # Request d takes a's slot on another row, its prompt ending where a's did.
    ring.reserve("d")
    ring.claim_rows([4], [1], ["d"], [True])
    checked(ring)
    assert held(ring, 4, 10) == []  # nothing of a
    ring.record(4, queries_at([9]), torch.tensor([9]))
    assert held(ring, 4, 10) == [9]
    # a's row goes to a request needing no slot: the row reads nothing, d keeps its own.
    ring.claim_rows([1], [2], ["e"], [False])
    checked(ring)
    ring.record(1, queries_at([7, 8]), torch.tensor([7, 8]))
    assert held(ring, 1, 9) == [] and held(ring, 4, 10) == [9]


def test_a_claim_finding_no_free_slot_counts_a_miss_and_never_shares_one():
    ring = shared_ring(slots=1)
    ring.claim_rows([1, 2], [1, 1], ["a", "b"], [True, True])  # no admission in between
    checked(ring)
    assert ring.slot_misses == 1 and ring.slot_holders() == ["a"]
    ring.record(2, queries_at([5]), torch.tensor([5]))
    assert held(ring, 2, 6) == [] and held(ring, 1, 6) == []


def test_a_flush_zeroing_the_generations_still_gives_the_next_request_its_own_slot():
    """SGLang's cache flush zeroes the request pool's generations: the request after
    it gets the same row and generation as the one before, and must still get its own
    slot, emptied (the engine case: request x, a flush, then a and b admitted b first)."""
    ring = shared_ring(slots=3)
    ring.reserve("x")
    ring.claim_rows([1], [1], ["x"], [True])
    ring.record(1, queries_at(range(50, 58)), torch.arange(50, 58))
    ring.release("x")
    ring.reserve("b")  # b is admitted first: it takes x's slot
    ring.reserve("a")
    ring.claim_rows([1, 2], [1, 1], ["a", "b"], [True, True])  # after the flush
    checked(ring)
    assert int(ring.slot_of_row[1]) == ring._held["a"] != ring._held["b"]
    assert held(ring, 1, 58) == [] and held(ring, 2, 58) == []
    # The same request again on its row (a later chunk): nothing reset.
    ring.record(1, queries_at([3]), torch.tensor([3]))
    ring.claim_rows([1], [1], ["a"], [True])
    assert held(ring, 1, 4) == [3]


def test_idle_problem_names_slots_a_release_path_kept():
    ring = shared_ring()
    ring.reserve("lost")
    problem = ring_problem(ring)
    assert "slots of ['lost'] held by the query ring while the scheduler is idle" in problem
    ring.release("lost")
    assert ring_problem(ring) is None and ring_problem(None) is None


def test_dedicated_ring_keeps_one_slot_per_row():
    ring = QueryRing(RingShape(LAYERS, 4, WINDOW, Q_HEADS, HEAD_DIM, torch.float32))
    assert ring.reserve("any") and ring.free_slots == 4
    ring.record(3, queries_at(range(3)), torch.arange(3))  # no claim needed
    assert held(ring, 3, 3) == [0, 1, 2]


@pytest.mark.parametrize(
    ("pool", "budget", "rows", "slots"),
    [(421_416, 2048, 2049, 205), (100_000, 64, 65, 65), (10, 2048, 9, 1)],
)
def test_default_slots_cover_what_bounded_admission_lets_run(pool, budget, rows, slots):
    assert default_slots(pool_tokens=pool, budget_tokens=budget, num_request_rows=rows) == slots


def test_slot_counts_out_of_range_are_refused():
    with pytest.raises(ValueError, match=r"num_slots=0: must lie in \[1, 4\]"):
        RingShape(LAYERS, 4, WINDOW, Q_HEADS, HEAD_DIM, torch.float32, 0)
    with pytest.raises(ValueError, match="query_slots=0 is out of range"):
        EvictionConfig(kv_budget_tokens=256, query_slots=0)


# --- which requests need one, and admission -------------------------------------------


def request(rid: str, config: EvictionConfig, prompt_len: int, max_new: int, **custom) -> Req:
    params = SamplingParams(
        max_new_tokens=max_new, custom_params={"sglang_evict": custom} if custom else None
    )
    req = Req(rid, "", array("q", range(prompt_len)), params)
    attach_policy(req, config, RequestLimits.of(config, ("rkv", "streaming")))
    return req


def test_a_request_needs_a_slot_when_it_may_outgrow_its_budget_under_a_query_scorer():
    config = EvictionConfig(kv_budget_tokens=256, scorer="rkv", window_tokens=32)
    manager = SimpleNamespace(default_policy=None)
    assert needs_query_slot(manager, request("long", config, 200, 57))
    assert not needs_query_slot(manager, request("short", config, 200, 56))  # 256 in all
    assert not needs_query_slot(manager, request("knorm", config, 200, 500, scorer="streaming"))


def test_admission_waits_while_every_slot_is_held_and_reserves_for_what_it_admits():
    from sglang_evict.srt.backend import EvictingRadixCache

    # SGLang's own admission arithmetic (the pool's side is test_admission's): the slot
    # check holds whatever --kv-admission says.
    config = EvictionConfig(
        kv_budget_tokens=256, scorer="rkv", window_tokens=32, admission="sglang"
    )
    ring = shared_ring(rows=8, slots=1)
    manager = SimpleNamespace(config=config, default_policy=None, query_ring=ring, tier_arena=None)
    cache = EvictingRadixCache.__new__(EvictingRadixCache)
    cache.disable, cache.evictor = False, manager
    adder = SimpleNamespace(tree_cache=cache, can_run_list=[], new_chunked_req=None)
    calls = []

    def original(adder, req, *args, **kwargs):
        calls.append(req.rid)
        adder.can_run_list.append(req)
        return AddReqResult.CONTINUE

    waits = Active.totals.query_slot_waits
    first, second = request("a", config, 300, 64), request("b", config, 300, 64)
    short = request("s", config, 10, 16)
    add = srt_admission._around_add_one_req
    assert add(original, adder, first, False, None) is AddReqResult.CONTINUE
    assert ring.slot_holders() == ["a"]
    assert add(original, adder, second, False, None) is AddReqResult.NO_TOKEN
    assert add(original, adder, short, False, None) is AddReqResult.CONTINUE  # needs none
    assert calls == ["a", "s"] and Active.totals.query_slot_waits == waits + 1
    ring.release("a")  # a finished
    assert add(original, adder, second, False, None) is AddReqResult.CONTINUE
    assert ring.slot_holders() == ["b"]
    # Its first forward points its row at the slot it was admitted with.
    pool = SimpleNamespace(req_generation=torch.ones(8, dtype=torch.int64))
    req_kv(second).req_pool_idx, req_kv(short).req_pool_idx = 5, 6
    claim_query_rows(ring, pool, [second, short], manager)
    checked(ring)
    assert ring.slot_of_row[5] == ring._held["b"] and ring.slot_of_row[6] == ring.scratch_slot
    assert ring.slot_misses == 0


# --- the dry run: the ring against SGLang's pool on a GPU of a given size ----------------

# Llama-3.1-8B's config.json (public): 32 layers, 32 query and 8 KV heads of 128, a
# 128k context, bfloat16.
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def dry_run(*flags: str, model_dir) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sglang_evict.cli.main", "serve", "--dry-run",
         "--model-path", str(model_dir), "--device", "cuda", *flags],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.fixture(scope="module")
def llama_8b(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-3.1-8b")
    (folder / "config.json").write_text(json.dumps(LLAMA_31_8B))
    return folder


def ring_figures(line: str) -> dict:
    """The figures of the dry run's ring line."""
    import re

    pattern = (
        r"KV pool at most (?P<pool>\d+) tokens = .* (?P<rows>\d+) request rows\): "
        r"(?P<slots>\d+) slots x (?P<slot_mib>[\d.]+) MiB = (?P<gib>[\d.]+) GiB, "
        r"(?P<share>[\d.]+)% of the KV pool \(one slot per request row would take "
        r"(?P<row_gib>[\d.]+) GiB"
    )
    match = re.search(pattern, line)
    assert match, line
    return {key: float(value) for key, value in match.groupdict().items()}


def test_dry_run_sizes_the_ring_against_sglangs_pool_on_an_80_gib_gpu(llama_8b):
    """The issue's goal: at SGLang's defaults for Llama-3.1-8B on an 80 GiB GPU the ring
    takes at most 5 % of the KV pool (one slot per request row: about 17 GB)."""
    from sglang_evict.srt.versioned import IS_0_5_23

    flags = ["--gpu-memory-gib", "80", "--kv-budget", "2048", "--kv-scorer", "rkv"]
    done = dry_run(*flags, model_dir=llama_8b)
    if IS_0_5_23:  # it sizes mem_fraction_static at start: the estimate needs it given
        assert done.returncode == 2 and "give --mem-fraction-static" in done.stderr
        flags += ["--mem-fraction-static", "0.83"]  # 0.5.17's pick for 80 GiB
        done = dry_run(*flags, model_dir=llama_8b)
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("# query ring, for a GPU"))
    figures = ring_figures(line)
    assert figures["share"] <= 5.0
    assert figures["slots"] == figures["pool"] // 2049
    # 32 queries x 32 layers x 32 heads x 128 x 2 bytes (+ 8 a cell) a slot.
    assert figures["slot_mib"] == round(32 * (32 * 32 * 128 * 2 + 8) / 2**20, 1)
    assert figures["rows"] >= 2049 and figures["row_gib"] > 15  # SGLang's rows: >= 2,048
    # --kv-query-slots overrides; a smaller budget lets more requests run, so more slots.
    fixed = dry_run(*flags, "--kv-query-slots", "16", model_dir=llama_8b)
    assert ring_figures(fixed.stdout)["slots"] == 16


def test_dry_run_gpu_memory_needs_the_dry_run_and_a_sane_size(llama_8b):
    real = subprocess.run(
        [sys.executable, "-m", "sglang_evict.cli.main", "serve", "--gpu-memory-gib", "80",
         "--model-path", str(llama_8b), "--device", "cuda", "--kv-budget", "2048"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert real.returncode == 2 and "add --dry-run or drop --gpu-memory-gib" in real.stderr
    for value in ("0", "nan", "lots"):
        bad = dry_run("--gpu-memory-gib", value, "--kv-budget", "2048", model_dir=llama_8b)
        assert bad.returncode == 2 and "argument --gpu-memory-gib" in bad.stderr


def test_the_pool_estimate_matches_what_sglang_measured_on_the_h200(tmp_path):
    """benches/results/engine_eviction_h200_graph.json (2026-11-28, SGLang 0.5.17 on an
    H200 of 143,771 MiB): the random 156M Llama of scripts/make_random_llama.py at
    --mem-fraction-static 0.6 got a KV pool of 10,893,632 tokens. The estimate, which
    leaves the CUDA context in, is at most 2 % above it, never below."""
    from pathlib import Path

    from sglang_evict.srt.pool_estimate import estimate_pool
    from sglang_evict.srt.server_args import parse_server_args

    results = Path(__file__).parents[1] / "benches/results/engine_eviction_h200_graph.json"
    measured = json.loads(results.read_text())["results"]["off"]["max_total_num_tokens"]
    config = {  # make_random_llama.py's defaults
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["--model-path", str(tmp_path), "--device", "cuda", "--mem-fraction-static", "0.6"]
    server_args = parse_server_args(argv, dry_run=True, gpu_memory_mib=143_771)
    estimate = estimate_pool(server_args, 143_771)
    assert measured <= estimate.pool_tokens <= measured * 1.02
