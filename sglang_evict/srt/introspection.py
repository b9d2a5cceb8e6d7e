"""What the plugin shows of itself inside SGLang: its state in ``get_server_info``, an
idle-time check that it holds no per-request state, and an optional log line per pass.

* ``Scheduler.get_internal_state`` (AFTER hook): the reply SGLang sends for
  ``/get_server_info`` (``internal_states[i]``) and ``Engine.get_server_info()`` gains a
  ``sglang_evict`` entry: requests with eviction state, passes, tokens evicted, pages
  freed, idle checks passed, and SGLang's own pool accounting (``pool``: the
  allocator's free slots, the radix tree's evictable and protected tokens).
  ``SGLANG_EVICT_DEBUG_TREE=1`` adds ``radix_tree``: every tree node's tokens, slots,
  lock count and, per slot, a SHA-256 prefix of its K/V rows in every layer (reads the
  pool: a debugging aid, a synchronisation on a GPU; the tests use it to see that
  shared prefixes stay where they are, byte for byte, even when a node is split).
* ``Scheduler.on_idle`` (AFTER hook): when the scheduler is fully idle no request runs,
  so the plugin must hold no per-request state; like SGLang's own idle memory check it
  raises when ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE`` is on (SGLang's default)
  and warns otherwise.
* ``SGLANG_EVICT_LOG_PASSES=1``: one JSON log line per decode step with passes
  (``sglang-evict pass {...}``): each request's tokens before/after and pages freed, and
  the allocator's free slots before and after the pass, read from SGLang's allocator,
  the pass's host time (``duration_ms``, as ``pass_duration_seconds`` observes it)
  and the scheduler's decode step count (``decode_step``, ``EvictionManager.decode_steps``);
  and one per finished request (``sglang-evict request {...}``): its id and the report
  its ``meta_info["sglang_evict"]`` carries (for clients that do not see meta_info,
  such as the OpenAI routes).
* ``SGLANG_EVICT_LOG_KEPT=1`` (with the above): each request of a pass record also
  lists what it keeps from there on: ``kept_positions`` (the logical positions held in
  full precision, in row order), ``tier_positions`` (each tier group's positions) and
  ``next_position`` (the position of the token it generates next). Reads the device
  after every pass (a synchronisation on a GPU): the trace the masked reference
  replays (``sglang_evict.models.masked_reference``), for tests and debugging.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict

from sglang_evict.srt.active import Active, PassTotals

logger = logging.getLogger(__name__)

HOOK_INTERNAL_STATE = "sglang.srt.managers.scheduler.Scheduler.get_internal_state"
HOOK_ON_IDLE = "sglang.srt.managers.scheduler.Scheduler.on_idle"
LOG_PASSES_ENV = "SGLANG_EVICT_LOG_PASSES"
PASS_LINE_PREFIX = "sglang-evict pass "  # engine_runner.parse_pass_lines reads it
REQUEST_LINE_PREFIX = "sglang-evict request "
DEBUG_TREE_ENV = "SGLANG_EVICT_DEBUG_TREE"
LOG_KEPT_ENV = "SGLANG_EVICT_LOG_KEPT"


def _switched_on(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0", "false")


def log_passes_enabled() -> bool:
    return _switched_on(LOG_PASSES_ENV)


def log_kept_enabled() -> bool:
    return _switched_on(LOG_KEPT_ENV)


def kept_record(manager, rid: str, kv_len: int) -> dict:
    """What request ``rid`` keeps after a pass (``LOG_KEPT_ENV``; reads the device)."""
    arena = manager.tier_arena
    return {
        "kept_positions": manager.positions(rid, kv_len).tolist(),
        "tier_positions": [] if arena is None else arena.positions_of(rid),
        "next_position": kv_len + manager.position_offset(rid),
    }


def log_pass(
    requests: list[dict],
    free_slots_before: int,
    free_slots_after: int,
    *,
    duration_ms: float,
    decode_step: int,
    pressure: bool = False,
) -> None:
    logger.info(
        "%s%s",
        PASS_LINE_PREFIX,
        json.dumps(
            {
                "requests": requests,
                "duration_ms": round(duration_ms, 4),
                "decode_step": decode_step,
                "free_slots_before": free_slots_before,
                "free_slots_after": free_slots_after,
                "pressure": pressure,
            },
            sort_keys=True,
        ),
    )


def log_request(rid: str, report: dict) -> None:
    logger.info("%s%s", REQUEST_LINE_PREFIX, json.dumps({"rid": rid, **report}, sort_keys=True))


def plugin_report(manager, totals: PassTotals) -> dict:
    from sglang_evict.srt import capture, tier, windows

    report = {"tracked_requests": manager.num_tracked_requests(), **asdict(totals)}
    report["pass_failure_streak"] = manager.failures.streak
    report["forced_completions"] = manager.forced_completions
    report["query_capture"] = capture.report()
    report["tier"] = tier.report()
    report["windows"] = dict(windows.CALLS)
    if manager.group_choice is not None:  # --kv-pass-group-steps auto: the choice
        report["pass_grouping"] = {"mode": "auto", **manager.group_choice.report()}
    else:
        report["pass_grouping"] = {"mode": "fixed", "pass_group_steps": manager.pass_group_steps}
    report["pass_graphs"] = None if manager.graphs is None else manager.graphs.report()
    compactor = manager.compactor
    if hasattr(compactor, "sidecar_passes"):  # --kv-compactor grpc (FallbackCompactor)
        report["compactor"] = {
            "sidecar_up": bool(compactor.sidecar_up),
            "sidecar_passes": compactor.sidecar_passes,
            "fallback_passes": compactor.fallback_passes,
            "skipped_passes": compactor.skipped_passes,
        }
    return report


def pool_report(cache) -> dict:
    """SGLang's own accounting of the KV pool (host counters: no device read)."""
    return {
        "free_slots": int(cache.token_to_kv_pool_allocator.available_size()),
        "tree_evictable_tokens": int(cache.evictable_size()),
        "tree_protected_tokens": int(cache.protected_size()),
    }


def tree_digest(cache) -> list[dict]:
    """Every radix-tree node by id: its id, parent id, token ids, slots, lock count
    and, per slot, the first 16 hex digits of the SHA-256 of that slot's K and V rows
    in every layer (reads the pool)."""
    import hashlib

    import torch

    pool = cache.evictor.pool
    buffers = [*pool.k_buffers, *pool.v_buffers]
    nodes, stack = [], list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        slots = node.value.to(torch.int64) if node.value is not None else torch.zeros(0)
        rows = torch.cat(
            [b.index_select(0, slots.to(b.device)).reshape(len(slots), -1) for b in buffers],
            dim=1,
        )
        data = rows.contiguous().cpu().view(torch.uint8).numpy()
        nodes.append(
            {
                "id": node.id,
                "parent": None if node.parent is cache.root_node else node.parent.id,
                "tokens": list(node.key.token_ids),
                "slots": slots.tolist(),
                "lock_ref": node.lock_ref,
                "kv_sha256": [hashlib.sha256(row.tobytes()).hexdigest()[:16] for row in data],
            }
        )
    return sorted(nodes, key=lambda entry: entry["id"])


def prefix_entries(digest: list[dict], tokens: list[int]) -> list[tuple[int, int, str]]:
    """``(token, slot, K/V hash)`` of each leading token of ``tokens`` a ``tree_digest``
    holds, from the root down; per token, so a node split in between changes nothing."""
    children: dict = {}
    for node in digest:
        children.setdefault(node["parent"], []).append(node)
    entries, parent = [], None
    while len(entries) < len(tokens):
        at = len(entries)
        node = next((n for n in children.get(parent, []) if n["tokens"][0] == tokens[at]), None)
        if node is None:
            break
        for token, slot, kv in zip(node["tokens"], node["slots"], node["kv_sha256"], strict=True):
            if len(entries) == len(tokens) or token != tokens[len(entries)]:
                return entries
            entries.append((token, slot, kv))
        parent = node["id"]
    return entries


def _after_get_internal_state(result, scheduler, *args, **kwargs):
    state = getattr(result, "internal_state", None)  # GetInternalStateReqOutput
    if Active.manager is None or not isinstance(state, dict):
        return result
    report = plugin_report(Active.manager, Active.totals)
    cache = scheduler.tree_cache
    report["pool"] = pool_report(cache)
    if os.environ.get(DEBUG_TREE_ENV, "") not in ("", "0", "false"):
        report["radix_tree"] = tree_digest(cache)
    state["sglang_evict"] = report
    return result


def _after_on_idle(result, scheduler, *args, **kwargs):
    manager = Active.manager
    if manager is None or not scheduler.is_fully_idle():
        return result
    tracked = manager.num_tracked_requests()
    if tracked:
        message = (
            f"sglang-evict holds eviction state of {tracked} request(s) while the scheduler "
            f"is idle: a finish, abort or retraction path did not release it"
        )
        from sglang.srt.environ import envs

        if envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE.get():
            raise ValueError(message)
        logger.warning(message)
    else:
        problem = tier_problem(manager.tier_arena) or ring_problem(manager.query_ring)
        if problem:
            from sglang.srt.environ import envs

            if envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE.get():
                raise ValueError(problem)
            logger.error(problem)
            return result
        Active.totals.idle_checks += 1
    return result


def idle_problem(what: str, check, holders, held_as: str) -> str | None:
    """What is wrong with a per-request store at an idle point: ``check()`` raising
    ``AssertionError`` (an invariant broken), or ``holders`` (requests still holding
    ``held_as`` with no request running); None when nothing is."""
    try:
        check()
    except AssertionError as error:
        return f"sglang-evict: {what} breaks an invariant while idle: {error}"
    if holders:
        return (
            f"sglang-evict: {held_as} of {sorted(holders)[:8]} held by {what} while the "
            f"scheduler is idle: a finish, abort or retraction path did not release them"
        )
    return None


def ring_problem(ring) -> str | None:
    """The query ring's idle problem (``idle_problem``; None without a ring)."""
    if ring is None:
        return None
    return idle_problem("the query ring", ring.check_invariants, ring.slot_holders(), "slots")


def tier_problem(arena) -> str | None:
    """The tier's arena's idle problem (``idle_problem``; None without a tier)."""
    if arena is None:
        return None
    return idle_problem("the tier's arena", arena.check, arena.owned, "groups")
