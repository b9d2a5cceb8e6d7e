"""SGLang's admission and retraction see an evicting request's bounded KV.

SGLang 0.5.17's ``PrefillAdder`` (``managers/schedule_policy.py``) admits a waiting
request when the pool's free and evictable tokens, less what running and already
admitted requests may still take, cover its prompt plus ``min(max_new_tokens,
CLIP_MAX_NEW_TOKENS)`` plus a page; a running request may still take
``min(max_new_tokens - generated, CLIP) x new_token_ratio``. Under a budget an
evicting request's KV never grows past ``sglang_evict.admission.growth_tokens``, so
with ``--kv-admission bounded`` (the default) both figures are capped by it:

* ``PrefillAdder._get_running_request_total_token_offset`` (AFTER hook): a running
  evicting request's figure becomes ``min(rest of max_new_tokens (clipped), growth)``,
  unscaled by ``new_token_ratio``: SGLang's ratio guesses how early requests stop, and
  the bound needs no guess, so admitted evicting requests never outgrow the pool
  (``sglang_evict.admission.bounded_new_tokens``).
* ``PrefillAdder.add_one_req`` (AROUND hook): what the adder holds back
  (``versioned.add_to_admission_offset``) is credited with ``SGLang's estimate -
  bounded`` for the admission checks, and once
  the request is admitted whole (not a first chunk) the reservation SGLang added for
  it (``_update_prefill_budget``: prompt + ``min(max_new_tokens, CLIP)`` + a page)
  is corrected by the same kind of credit, so it holds prompt + bounded growth + a
  page. A request not admitted, or admitted as a first chunk (SGLang reserves no
  generation for it), gets its credit back.

Under the quantized tier a request's bound includes its tier: ``add_one_req`` answers
``NO_TOKEN`` (SGLang's "the pool is full": the request waits) when the tier's arena
cannot hold the groups the request may demote beside those its running and admitted
requests may hold (``sglang_evict.admission.tier_admits``).

With a query-reading scorer a request a pass may read the queries of needs one of the
query ring's slots (``sglang_evict.srt.capture.needs_query_slot``): ``add_one_req``
answers ``NO_TOKEN`` when none is free, and reserves one for the request it admits
(whole or as a first chunk), whatever ``--kv-admission`` says. Under bounded admission
the default slot count (``query_capture.default_slots``) covers every such request the
pool lets run, so only requests asking a budget below the server's, or
``--kv-query-slots`` below the default, can wait for one.

A request that does not evict (its policy turns eviction off, or plain SGLang) keeps
SGLang's arithmetic. No copy of the scheduler: the figures SGLang computes are
replaced, the decisions stay SGLang's.

Pressure relief (``ScheduleBatch.check_decode_mem``, AFTER hook): when a decode step
cannot allocate (``Scheduler.update_running_batch`` is about to retract), passes run at
once on the evicting requests with the most evictable tokens until the freed pages
cover the step (``sglang_evict.admission.choose_pressure_passes``), under the same
protection rules as every pass (the counts of ``sglang_evict.passes.batch.counts``: the
budget, sinks, protected prompt, window and shared prefix are kept). SGLang retracts
only if that cannot free enough; ``retract_decode``'s own checks re-run it for the
requests still in the batch. These passes count as ``pressure`` passes
(``sglang_evict:pressure_passes_total``, the pass log's ``"pressure": true``).
Ordering is that of every pass (``sglang_evict.srt.hooks``): ``check_decode_mem`` runs
on the scheduler's stream just before ``prepare_for_decode``, and the pass waits, on
the device, for the in-flight forward.
"""

from __future__ import annotations

from sglang.srt.managers import schedule_policy

from sglang_evict.admission import (
    PressureCandidate,
    bounded_new_tokens,
    choose_pressure_passes,
    growth_tokens,
    survivors_cap,
    tier_admits,
)
from sglang_evict.srt.active import Active
from sglang_evict.srt.backend import EvictingRadixCache
from sglang_evict.srt.capture import needs_query_slot
from sglang_evict.srt.hooks import due_request, passable, run_passes, supported_allocation
from sglang_evict.srt.request_policy import policy_of
from sglang_evict.srt.versioned import add_to_admission_offset, matched_prefix_len, req_kv
from sglang_evict.tier.policy import due_cold_tokens

HOOK_RUNNING_OFFSET = (
    "sglang.srt.managers.schedule_policy.PrefillAdder._get_running_request_total_token_offset"
)
HOOK_ADD_ONE_REQ = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"
HOOK_CHECK_DECODE_MEM = "sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem"


def _bounded_manager(tree_cache):
    """The eviction manager when ``tree_cache`` is the plugin's and admission is bounded."""
    if not isinstance(tree_cache, EvictingRadixCache) or tree_cache.disable:
        return None
    manager = tree_cache.evictor
    return manager if manager.config.admission == "bounded" else None


def request_growth(manager, req, *, kv_len: int, num_shared: int) -> int | None:
    """KV tokens ``req`` may still add holding ``kv_len`` (``growth_tokens``), or None
    when it does not evict."""
    policy = policy_of(req) or manager.default_policy
    if not policy.enabled:
        return None
    config = manager.config
    # The pass counts' leading range: sinks + protected, the prompt (unless evictable)
    # and the shared prefix in whole pages.
    lead_end = manager.lead_end(kv_len, num_shared, len(req.origin_input_ids))
    cap = survivors_cap(
        lead_end=lead_end, window_tokens=config.window_tokens, budget=policy.kv_budget_tokens
    )
    return growth_tokens(
        kv_len=kv_len,
        survivors_cap=cap,
        # Under a tier a pass is due once a whole group is cold (``tier.policy``); the
        # tier's own bytes live in its arena, outside the pool admission counts.
        cadence=due_cold_tokens(
            policy.cadence_tokens, manager.tier_policy if policy.tier_tokens else None
        ),
        page_size=config.page_size,
        pass_group_steps=config.group_steps_bound,
    )


def _after_running_offset(result, adder, req, *args, **kwargs):
    manager = _bounded_manager(adder.tree_cache)
    if manager is None:
        return result
    kv = req_kv(req)
    growth = request_growth(
        manager, req, kv_len=kv.kv_committed_len, num_shared=kv.cache_protected_len
    )
    if growth is None:
        return result
    rest = max(req.sampling_params.max_new_tokens - len(req.output_ids), 0)
    return bounded_new_tokens(min(rest, _clip_max_new_tokens()), growth)


def tier_groups_bound(manager, req) -> int:
    """The most tier groups ``req`` may hold (0: no tier)."""
    if getattr(manager, "tier_arena", None) is None:
        return 0
    policy = policy_of(req) or manager.default_policy
    if not policy.enabled or not policy.tier_tokens:
        return 0
    return policy.tier_tokens // manager.tier_arena.fmt.group_tokens


def _tier_waits(manager, adder, req) -> bool:
    need = tier_groups_bound(manager, req)
    if need == 0:
        return False
    running = adder.running_batch.reqs if adder.running_batch is not None else []
    reserved = sum(tier_groups_bound(manager, r) for r in (*running, *adder.can_run_list))
    arena_groups = manager.tier_arena.num_groups
    return not tier_admits(reserved_groups=reserved, request_groups=need, arena_groups=arena_groups)


def _slot_ring(tree_cache, req):
    """The query ring when ``req`` needs one of its shared slots and holds none yet."""
    if not isinstance(tree_cache, EvictingRadixCache) or tree_cache.disable:
        return None
    manager = tree_cache.evictor
    ring = getattr(manager, "query_ring", None)
    if ring is None or ring.shape.dedicated or ring.holds(req.rid):
        return None
    return ring if needs_query_slot(manager, req) else None


def _around_add_one_req(original, adder, req, *args, **kwargs):
    ring = _slot_ring(adder.tree_cache, req)
    if ring is not None and ring.free_slots == 0:
        Active.totals.query_slot_waits += 1
        return schedule_policy.AddReqResult.NO_TOKEN
    result = _add_one_req(original, adder, req, *args, **kwargs)
    if ring is not None and (
        adder.new_chunked_req is req or any(r is req for r in adder.can_run_list)
    ):
        ring.reserve(req.rid)
    return result


def _add_one_req(original, adder, req, *args, **kwargs):
    manager = _bounded_manager(adder.tree_cache)
    growth = None
    if manager is not None and _tier_waits(manager, adder, req):
        Active.totals.tier_admission_waits += 1
        return schedule_policy.AddReqResult.NO_TOKEN
    if manager is not None:
        fill_len = len(req.full_untruncated_fill_ids)
        growth = request_growth(manager, req, kv_len=fill_len, num_shared=matched_prefix_len(req))
    if growth is None:
        return original(adder, req, *args, **kwargs)
    clip = _clip_max_new_tokens()
    max_new = req.sampling_params.max_new_tokens
    # What SGLang's checks use (the rest of max_new_tokens) and what it reserves once
    # the request is admitted whole (all of it), each capped by the bounded growth.
    checked = min(max(max_new - len(req.output_ids), 0), clip)
    reserved = min(max_new, clip)
    check_credit = checked - bounded_new_tokens(checked, growth)
    reserve_credit = reserved - bounded_new_tokens(reserved, growth)
    add_to_admission_offset(adder, -check_credit)
    try:
        return original(adder, req, *args, **kwargs)
    finally:
        admitted_whole = adder.new_chunked_req is not req and any(
            r is req for r in adder.can_run_list
        )
        add_to_admission_offset(adder, check_credit - (reserve_credit if admitted_whole else 0))


def _clip_max_new_tokens() -> int:
    """SGLang's clip of a request's estimated new tokens (read at call time: tests and
    operators may set ``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION`` before the import)."""
    return schedule_policy.CLIP_MAX_NEW_TOKENS


def relieve_pressure(manager, batch, selected_indices=None) -> list:
    """Pressure passes for a decode step that cannot allocate: the most evictable
    requests of ``batch`` (of ``selected_indices``, when given) compacted now, until
    the pages they free cover the step's shortfall. Returns their ``PassResult``s."""
    allocator = manager.pool.allocator
    shortfall = batch.new_tokens_required_next_decode(selected_indices) - allocator.available_size()
    indices = range(len(batch.reqs)) if selected_indices is None else selected_indices
    candidates, due = [], {}
    for i in indices:
        req = batch.reqs[i]
        policy = policy_of(req)
        if not passable(req) or not (policy or manager.default_policy).enabled:
            continue
        kv = req_kv(req)
        counts = manager.counts(
            req.rid, kv.kv_committed_len, kv.cache_protected_len, len(req.origin_input_ids), policy
        )
        if counts.tokens_evicted > 0 and supported_allocation(req):
            candidates.append(PressureCandidate(i, counts.tokens_evicted, counts.pages_freed))
            due[i] = due_request(req, policy)
    chosen = choose_pressure_passes(candidates, shortfall, manager.config.page_size)
    return run_passes(manager, batch, [(i, due[i]) for i in chosen], pressure=True)


def _after_check_decode_mem(fits, batch, *args, **kwargs):
    if fits:
        return fits
    cache = batch.tree_cache
    if (
        not isinstance(cache, EvictingRadixCache)
        or cache.disable
        or not cache.evictor.config.pressure_passes
        or not batch.spec_algorithm.is_none()
    ):
        return fits
    selected = args[0] if args else kwargs.get("selected_indices")
    manager = cache.evictor
    if not relieve_pressure(manager, batch, selected):
        return fits
    Active.totals.pressure_steps += 1
    fits = manager.pool.allocator.available_size() >= batch.new_tokens_required_next_decode(
        selected
    )
    Active.totals.pressure_steps_relieved += int(fits)
    return fits
