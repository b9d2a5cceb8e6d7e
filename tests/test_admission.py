"""Budget-aware admission and pressure passes, on SGLang's own ``PrefillAdder`` and
``ScheduleBatch.check_decode_mem`` over its memory classes (the hooks wrapped onto them
exactly as SGLang's ``HookRegistry`` does), and the pure arithmetic beneath them."""

from __future__ import annotations

from array import array

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import (
    CLIP_MAX_NEW_TOKENS,
    AddReqResult,
    PrefillAdder,
)
from sglang.srt.plugins.hook_registry import HookType, _wrap_fn
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_evict.admission import (
    PressureCandidate,
    choose_pressure_passes,
    growth_tokens,
    survivors_cap,
    tier_admits,
)
from sglang_evict.config import EvictionConfig
from sglang_evict.srt import admission as srt_admission
from sglang_evict.srt.active import Active, PassTotals
from sglang_evict.srt.request_policy import attach_policy
from sglang_evict.srt.versioned import admission_offset, req_kv
from tests.sglang_harness import Engine

BUDGET, CADENCE, SINKS, WINDOW = 64, 16, 4, 16
RATIO = 0.7


def policy(page_size: int = 1, **overrides) -> EvictionConfig:
    values = dict(
        kv_budget_tokens=BUDGET,
        cadence_tokens=CADENCE,
        sink_tokens=SINKS,
        window_tokens=WINDOW,
        scorer="streaming",
        page_size=page_size,
        request_max_budget_tokens=256,
    )
    return EvictionConfig(**{**values, **overrides})


@pytest.fixture
def hooked(monkeypatch):
    """SGLang's methods wrapped with the plugin's hooks as ``HookRegistry`` wraps them,
    and fresh pass totals."""
    monkeypatch.setattr(
        PrefillAdder,
        "_get_running_request_total_token_offset",
        _wrap_fn(
            PrefillAdder._get_running_request_total_token_offset,
            srt_admission._after_running_offset,
            HookType.AFTER,
        ),
    )
    monkeypatch.setattr(
        PrefillAdder,
        "add_one_req",
        _wrap_fn(PrefillAdder.add_one_req, srt_admission._around_add_one_req, HookType.AROUND),
    )
    monkeypatch.setattr(
        ScheduleBatch,
        "check_decode_mem",
        _wrap_fn(
            ScheduleBatch.check_decode_mem, srt_admission._after_check_decode_mem, HookType.AFTER
        ),
    )
    monkeypatch.setattr(Active, "totals", PassTotals())


def prompt(seed: int, length: int = 20) -> list[int]:
    return [(seed * 31 + 7 * i) % 500 + 1 for i in range(length)]


def running(engine: Engine, count: int, steps: int, **custom) -> list:
    custom_params = {"sglang_evict": custom} if custom else None
    reqs = [
        engine.add_request(f"r{i}", prompt(i), custom_params=custom_params) for i in range(count)
    ]
    for step in range(steps):
        engine.decode_batch(reqs, [600 + step] * count)
    engine.check()
    return reqs


def waiting(engine: Engine, rid: str, tokens: list[int], max_new_tokens: int, **custom) -> Req:
    """A request as it waits in SGLang's queue: its policy attached (the queue hook),
    its prefix matched (``init_next_round_input``)."""
    params = SamplingParams(
        max_new_tokens=max_new_tokens, custom_params={"sglang_evict": custom} if custom else None
    )
    req = Req(rid, "", array("q", tokens), params)
    manager = engine.driver.evictor
    if manager is not None:
        attach_policy(req, manager.config, manager.request_limits)
    req.init_next_round_input(engine.cache)
    return req


def adder(engine: Engine, running_reqs: list) -> PrefillAdder:
    batch = engine.driver.schedule_batch(running_reqs) if running_reqs else None
    return PrefillAdder(
        engine.page_size,
        engine.cache,
        engine.allocator,
        batch,
        RATIO,
        rem_input_tokens=16384,
        rem_chunk_tokens=None,
    )


def pool_room(engine: Engine) -> int:
    return engine.allocator.available_size() + engine.cache.evictable_size()


# --- the arithmetic ---------------------------------------------------------------------


@given(st.integers(0, 50), st.integers(0, 50), st.integers(1, 40))
def test_the_tier_admits_a_request_whose_groups_fit_beside_those_promised(reserved, need, arena):
    admitted = tier_admits(reserved_groups=reserved, request_groups=need, arena_groups=arena)
    if need == 0:
        assert admitted
    elif need > arena:  # larger than the arena: admitted alone, never beside others
        assert admitted == (reserved == 0)
    else:
        assert admitted == (reserved + need <= arena)


def test_the_tier_admission_refuses_negative_counts():
    with pytest.raises(ValueError, match="reserved_groups=-1"):
        tier_admits(reserved_groups=-1, request_groups=1, arena_groups=4)


def test_survivors_cap_is_the_budget_or_the_protected_tokens_when_larger():
    assert survivors_cap(lead_end=20, window_tokens=16, budget=64) == 64
    # A 100-token protected prompt plus the window exceed the budget.
    assert survivors_cap(lead_end=100, window_tokens=16, budget=64) == 116


@pytest.mark.parametrize(
    "prompt_len,num_shared,evict_prompt,cap",
    [
        (20, 0, False, BUDGET),
        (100, 0, False, 100 + WINDOW),  # the protected prompt and the window
        (100, 0, True, BUDGET),  # an evictable prompt: the sinks and the window only
        (100, 70, True, 80 + WINDOW),  # a shared prefix is kept in whole pages of 16
    ],
)
def test_a_requests_cap_follows_the_pass_counts(prompt_len, num_shared, evict_prompt, cap):
    engine = Engine(page_size=16, config=policy(16, evict_prompt=evict_prompt), num_tokens=1024)
    req = waiting(engine, "w", prompt(1, prompt_len), max_new_tokens=4000)
    growth = srt_admission.request_growth(
        engine.cache.evictor, req, kv_len=prompt_len, num_shared=num_shared
    )
    expected = growth_tokens(kv_len=prompt_len, survivors_cap=cap, cadence=CADENCE, page_size=16)
    assert growth == expected


def test_growth_is_what_is_left_below_the_cap_plus_cadence_and_a_page():
    assert growth_tokens(kv_len=20, survivors_cap=64, cadence=16, page_size=1) == 61
    assert growth_tokens(kv_len=79, survivors_cap=64, cadence=16, page_size=16) == 17
    assert growth_tokens(kv_len=500, survivors_cap=64, cadence=16, page_size=16) == 16
    with pytest.raises(ValueError):
        growth_tokens(kv_len=-1, survivors_cap=64, cadence=16, page_size=1)


def test_grouped_passes_let_a_request_grow_the_group_length_less_one_more():
    grouped = growth_tokens(
        kv_len=20, survivors_cap=64, cadence=16, page_size=1, pass_group_steps=8
    )
    assert grouped == 61 + 7
    with pytest.raises(ValueError):
        growth_tokens(kv_len=20, survivors_cap=64, cadence=16, page_size=1, pass_group_steps=0)


def test_admission_counts_the_group_length_of_the_server():
    engine = Engine(page_size=16, config=policy(16, pass_group_steps=8), num_tokens=1024)
    req = waiting(engine, "w", prompt(1, 40), max_new_tokens=4000)
    growth = srt_admission.request_growth(engine.cache.evictor, req, kv_len=40, num_shared=0)
    cap = srt_admission.request_growth(
        Engine(page_size=16, config=policy(16), num_tokens=1024).cache.evictor,
        req,
        kv_len=40,
        num_shared=0,
    )
    assert growth == cap + 7


candidates = st.lists(
    st.tuples(st.integers(1, 300), st.integers(0, 20)), min_size=0, max_size=12
).map(lambda rows: [PressureCandidate(i, t, p) for i, (t, p) in enumerate(rows)])


@given(candidates, st.integers(-10, 2000), st.sampled_from([1, 16]))
def test_pressure_choice_covers_the_shortfall_most_evictable_first(cands, shortfall, page_size):
    chosen = choose_pressure_passes(cands, shortfall, page_size)
    by_index = {c.index: c for c in cands}
    assert chosen == sorted(set(chosen))
    assert all(by_index[i].pages_freed > 0 for i in chosen)
    freed = sum(by_index[i].pages_freed for i in chosen) * page_size
    useful = [c for c in cands if c.pages_freed > 0]
    if shortfall <= 0:
        assert chosen == []
    elif freed < shortfall:  # not enough: every request that frees a page is compacted
        assert len(chosen) == len(useful)
    else:  # enough, and no chosen request was needless: dropping the last one falls short
        ordered = sorted((by_index[i] for i in chosen), key=lambda c: (-c.tokens_evicted, c.index))
        assert freed - ordered[-1].pages_freed * page_size < shortfall
        skipped = [c for c in useful if c.index not in chosen]
        assert all(c.tokens_evicted <= ordered[-1].tokens_evicted for c in skipped)


# --- SGLang's admission ----------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_running_evicting_request_reserves_its_bounded_growth(hooked, page_size):
    engine = Engine(page_size=page_size, config=policy(page_size), num_tokens=4096)
    reqs = running(engine, 3, steps=70)  # 90 tokens each: passes have run
    assert any(engine.cache.evictor.position_offset(r.rid) for r in reqs)
    # One request about to finish: 3 tokens left, below its bounded growth, all counted
    # (SGLang's ratio would count 2.1).
    reqs[0].sampling_params.max_new_tokens = len(reqs[0].output_ids) + 3
    room = pool_room(engine)
    offsets = [
        min(
            min(r.sampling_params.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS),
            growth_tokens(
                kv_len=req_kv(r).kv_committed_len,
                survivors_cap=BUDGET,
                cadence=CADENCE,
                page_size=page_size,
            ),
        )
        for r in reqs
    ]
    assert adder(engine, reqs).rem_total_tokens == room - sum(offsets)
    assert offsets[0] == 3
    assert all(offset <= BUDGET + CADENCE + page_size for offset in offsets)


def test_a_new_request_is_admitted_by_its_bounded_growth_and_reserves_exactly_that(hooked):
    engine = Engine(page_size=1, config=policy(), num_tokens=1024)
    req = waiting(engine, "new", prompt(9), max_new_tokens=2000)
    growth = growth_tokens(kv_len=20, survivors_cap=BUDGET, cadence=CADENCE, page_size=1)
    add = adder(engine, [])
    # SGLang's own figure, prompt + 2000 + a page, exceeds the 1024-token pool.
    assert 20 + 2000 + 1 >= add.rem_total_tokens
    assert add.add_one_req(req, False, None) == AddReqResult.CONTINUE
    assert [r.rid for r in add.can_run_list] == ["new"]
    # _update_prefill_budget: prompt + (bounded) new tokens + one page of overhead.
    assert admission_offset(add) == 20 + growth + 1
    add.tree_cache.dec_lock_ref(req.last_node)


def test_a_refused_request_leaves_the_adder_as_it_was(hooked):
    engine = Engine(page_size=1, config=policy(), num_tokens=64)
    add = adder(engine, [])
    before = admission_offset(add)
    req = waiting(engine, "big", prompt(3, 60), max_new_tokens=2000)
    assert add.add_one_req(req, False, None) == AddReqResult.NO_TOKEN
    assert admission_offset(add) == before and add.can_run_list == []


def test_a_first_chunk_reserves_no_generation_as_in_sglang(hooked):
    engine = Engine(page_size=1, config=policy(), num_tokens=2048)
    req = waiting(engine, "long", prompt(4, 300), max_new_tokens=2000)
    add = PrefillAdder(1, engine.cache, engine.allocator, None, RATIO, 16384, rem_chunk_tokens=128)
    add.add_one_req(req, False, None)
    assert add.new_chunked_req is req
    assert admission_offset(add) == 128 + 1  # the chunk and a page, as SGLang reserves
    add.tree_cache.dec_lock_ref(req.last_node)


@pytest.mark.parametrize(
    "config,custom",
    [
        (policy(admission="sglang"), {}),
        (policy(request_allow_disable=True), {"enabled": False}),
        (None, {}),  # plain SGLang's radix cache
    ],
    ids=["admission-sglang", "eviction-off-for-the-request", "plain-sglang"],
)
def test_requests_that_do_not_evict_keep_sglangs_arithmetic(hooked, config, custom):
    engine = Engine(page_size=1, config=config, num_tokens=8192)
    reqs = running(engine, 2, steps=30, **custom)
    add = adder(engine, reqs)
    sglang_offsets = sum(
        min(r.sampling_params.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS) * RATIO
        for r in reqs
    )
    assert admission_offset(add) == sglang_offsets
    req = waiting(engine, "new", prompt(7), max_new_tokens=900, **custom)
    assert add.add_one_req(req, False, None) == AddReqResult.CONTINUE
    assert admission_offset(add) == sglang_offsets + 20 + 900 + 1


def test_a_request_budget_counts_in_its_reservation(hooked):
    engine = Engine(page_size=1, config=policy(), num_tokens=4096)
    add = adder(engine, [])
    req = waiting(engine, "wide", prompt(5), max_new_tokens=3000, kv_budget_tokens=200)
    assert add.add_one_req(req, False, None) == AddReqResult.CONTINUE
    growth = growth_tokens(kv_len=20, survivors_cap=200, cadence=CADENCE, page_size=1)
    assert admission_offset(add) == 20 + growth + 1
    add.tree_cache.dec_lock_ref(req.last_node)


# --- pressure passes -------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_step_that_cannot_allocate_compacts_the_most_evictable_request_first(hooked, page_size):
    """Three requests below their pass trigger (budget 64 + cadence 16) fill the pool;
    the step's check compacts just enough of them, the longest first, and the step
    fits without a retraction. Every invariant holds afterwards and decoding goes on."""
    prompt_lens = (20, 24, 28)
    # Full before any request reaches its trigger: 210 tokens, or 15 pages of 16.
    num_tokens = 210 if page_size == 1 else 240
    engine = Engine(page_size=page_size, config=policy(page_size), num_tokens=num_tokens)
    reqs = [engine.add_request(f"r{i}", prompt(i, n)) for i, n in enumerate(prompt_lens)]
    step = 0
    while engine.driver.schedule_batch(reqs).new_tokens_required_next_decode() <= (
        engine.allocator.available_size()
    ):
        engine.decode_batch(reqs, [700 + step] * 3)
        step += 1
    engine.check()
    assert engine.pass_log == []  # no pass was due: every request is below 80 tokens
    batch = engine.driver.schedule_batch(reqs)
    free_before = engine.free_token_count()
    assert batch.check_decode_mem() is True
    totals = Active.totals
    assert totals.pressure_passes == totals.passes >= 1
    assert totals.pressure_steps == totals.pressure_steps_relieved == 1
    compacted = [r for r in reqs if engine.cache.evictor.position_offset(r.rid)]
    longest = max(reqs, key=lambda r: req_kv(r).kv_committed_len + engine.position_offset(r))
    assert longest in compacted
    assert all(req_kv(r).kv_committed_len == BUDGET for r in compacted)
    assert engine.free_token_count() > free_before
    engine.check()
    for more in range(40):
        batch = engine.driver.schedule_batch(reqs)
        assert batch.check_decode_mem()
        engine.decode_batch(reqs, [800 + more] * 3)
        engine.check()


def test_when_nothing_is_evictable_sglang_retracts_as_before(hooked):
    """Every request at or below its budget: no pass can free anything, the check
    stays false (SGLang retracts) and nothing was touched."""
    engine = Engine(page_size=1, config=policy(), num_tokens=3 * 40)
    reqs = [engine.add_request(f"r{i}", prompt(i)) for i in range(3)]
    for step in range(20):
        engine.decode_batch(reqs, [900 + step] * 3)
    batch = engine.driver.schedule_batch(reqs)
    assert engine.allocator.available_size() == 0
    assert batch.check_decode_mem() is False
    assert Active.totals.passes == 0 and Active.totals.pressure_steps == 0
    engine.check()


def test_pressure_passes_can_be_turned_off(hooked):
    engine = Engine(page_size=1, config=policy(pressure_passes=False), num_tokens=3 * 76)
    reqs = [engine.add_request(f"r{i}", prompt(i)) for i in range(3)]
    for step in range(56):
        engine.decode_batch(reqs, [900 + step] * 3)
    assert engine.allocator.available_size() == 0
    assert engine.driver.schedule_batch(reqs).check_decode_mem() is False
    assert Active.totals.passes == 0


# --- flags and config ------------------------------------------------------------------


def test_serve_flags_set_admission_and_pressure_passes():
    from sglang_evict.cli import flags as cli_flags
    from sglang_evict.cli import main as cli

    args, _ = cli.build_parser().parse_known_args(["serve", "--kv-budget", "256"])
    args.page_size = 1
    config = cli_flags.config_from_args(args)
    assert (config.admission, config.pressure_passes) == ("bounded", True)
    argv = ["serve", "--kv-budget", "256", "--kv-admission", "sglang", "--kv-no-pressure-passes"]
    args, _ = cli.build_parser().parse_known_args(argv)
    args.page_size = 1
    config = cli_flags.config_from_args(args)
    assert (config.admission, config.pressure_passes) == ("sglang", False)
    assert '"admission": "sglang"' in config.to_json()


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("admission", "greedy", "unknown admission 'greedy'; known: \\['bounded', 'sglang'\\]"),
        ("pressure_passes", "yes", "pressure_passes must be true or false"),
    ],
)
def test_bad_admission_settings_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        policy(**{field: value})


# --- the tier's arena in admission ----------------------------------------------------


def _tier_request(rid: str, config: EvictionConfig, **custom) -> Req:
    from sglang_evict.request_policy import RequestLimits

    params = SamplingParams(
        max_new_tokens=512, custom_params={"sglang_evict": custom} if custom else None
    )
    req = Req(rid, "", array("q", prompt(1)), params)
    attach_policy(req, config, RequestLimits.of(config, ("streaming",)))
    return req


def test_a_request_waits_while_the_tiers_arena_is_promised_to_others(hooked, monkeypatch):
    """SGLang's adder sees ``NO_TOKEN`` (the request waits, nothing reserved) while the
    groups running and admitted requests may demote leave the arena too little room;
    a request asking no tier is admitted by the pool alone."""
    from types import SimpleNamespace

    from sglang_evict.srt.backend import EvictingRadixCache
    from sglang_evict.tier.arena import TierArena

    config = policy(tier_bits=3, tier_group_tokens=16, tier_max_tokens=64)  # 4 groups each
    arena = TierArena(
        config.tier_format(64), num_groups=10, num_layers=1, kv_heads=1, full_dtype=torch.float32
    )
    manager = SimpleNamespace(config=config, tier_arena=arena, default_policy=None)
    cache = EvictingRadixCache.__new__(EvictingRadixCache)
    cache.disable, cache.evictor = False, manager
    running = [_tier_request("a", config), _tier_request("b", config, tier_tokens=32)]
    adder = SimpleNamespace(
        tree_cache=cache, running_batch=SimpleNamespace(reqs=running), can_run_list=[]
    )
    calls = []
    # the pool's side (tested above on SGLang's adder) left out: SGLang's own arithmetic
    monkeypatch.setattr(srt_admission, "request_growth", lambda *args, **kwargs: None)
    monkeypatch.setattr(srt_admission, "matched_prefix_len", lambda req: 0)

    def original(adder, req, *args, **kwargs):
        calls.append(req.rid)
        return AddReqResult.CONTINUE

    # 4 + 2 groups promised: a third request's 4 fit the 10, a fourth's do not
    third = _tier_request("c", config)
    assert srt_admission._around_add_one_req(original, adder, third, False, None) is (
        AddReqResult.CONTINUE
    )
    adder.can_run_list.append(third)
    fourth = _tier_request("d", config)
    assert srt_admission._around_add_one_req(original, adder, fourth, False, None) is (
        AddReqResult.NO_TOKEN
    )
    assert calls == ["c"] and Active.totals.tier_admission_waits == 1
    no_tier = _tier_request("e", config, tier_tokens=0)
    assert srt_admission._around_add_one_req(original, adder, no_tier, False, None) is (
        AddReqResult.CONTINUE
    )
    assert calls == ["c", "e"]
