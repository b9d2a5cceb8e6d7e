"""Per-request policy inside SGLang: where a request's overrides are read, checked and
kept, and where its eviction report leaves.

    where                                   what                            on a bad value
    TokenizerManager._validate_one_request  custom_params["sglang_evict"]   ValueError: HTTP 400
      (AFTER hook, the HTTP server's         resolved against the server's   (/generate, OpenAI
      process: every /generate, OpenAI and   limits (from SGLANG_EVICT_      routes, Engine);
      Engine request passes here)            CONFIG, read once)              nothing sent on
    Scheduler._add_request_to_queue         the same, again, before the     the request is
      (BEFORE hook)                         request is queued; the policy   finished with a 400
                                            is kept on the Req              abort before any
                                            (``POLICY_ATTR``)               eviction state exists
    EvictingRadixCache.cache_finished_req   the request's report into       -
                                            meta_info["sglang_evict"]

``custom_params`` is SGLang's own free-form sampling parameter, carried unchanged from
the client to the scheduler's ``Req`` (``SamplingParams.custom_params``); OpenAI routes
take it as a top-level body field (``extra_body={"custom_params": ...}``). A server
without ``--radix-cache-backend sglang-evict`` ignores it, like any custom parameter.

The report rides SGLang's ``customized_info``, the one per-request output channel a
plugin can fill: the output streamer sends each key's values per output token and the
tokenizer manager accumulates them into ``meta_info[key]``. The report is written once,
when the request finishes, at its last output token: ``meta_info["sglang_evict"]`` is a
list with one entry per output token sent in the final chunk, ``None`` but the last
(``sglang_evict.request_policy.report_of`` picks it).
"""

from __future__ import annotations

import logging
from functools import lru_cache

from sglang_evict.request_policy import (
    CARRIER_KEY,
    REPORT_FIELDS,
    REPORT_KEY,
    RequestLimits,
    RequestPolicy,
    RequestPolicyError,
    default_policy,
    resolve_request_policy,
)
from sglang_evict.scorers import SCORERS, needs_calibration
from sglang_evict.srt.active import EvictingCache
from sglang_evict.srt.server_args import BACKEND_NAME, config_from_env, server_scorers
from sglang_evict.srt.tp import RANK_INDEPENDENT_SCORERS
from sglang_evict.srt.versioned import req_kv

logger = logging.getLogger(__name__)

HOOK_VALIDATE_REQUEST = (
    "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
)
HOOK_ADD_REQUEST_TO_QUEUE = "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue"
# The attribute of SGLang's Req holding its resolved RequestPolicy (lives as the Req does).
POLICY_ATTR = "sglang_evict_policy"
# Passes, tokens evicted and peak KV of a request before it was retracted (its eviction
# state is dropped then: it is re-prefilled from its tokens), added to its final report.
CARRIED_ATTR = "sglang_evict_carried"


def request_scorers(config, tp_size: int = 1) -> tuple[str, ...]:
    """Scorers a request may choose on this server: the server's own, and every scorer
    the server runs (``server_scorers``) that needs no calibration file (a request
    cannot bring one), reads captured queries only when the server's scorer does
    (capture runs for that one), and, under tensor parallelism, keeps the same
    survivors on every rank without a reduction."""
    server_reads_queries = SCORERS[config.scorer].needs_queries
    chosen = [config.scorer]
    for name in server_scorers():
        if name == config.scorer or needs_calibration(name):
            continue
        if SCORERS[name].needs_queries and not server_reads_queries:
            continue
        if tp_size > 1 and name not in RANK_INDEPENDENT_SCORERS:
            continue
        chosen.append(name)
    return tuple(chosen)


def request_limits(config, tp_size: int = 1) -> RequestLimits:
    return RequestLimits.of(config, request_scorers(config, tp_size))


def overrides_of(custom_params):
    """A request's overrides (``custom_params["sglang_evict"]``), or None."""
    if not isinstance(custom_params, dict):
        return None
    return custom_params.get(CARRIER_KEY)


def resolve_for_custom_params(custom_params, config, limits: RequestLimits) -> RequestPolicy:
    """The policy of a request carrying ``custom_params``; ``RequestPolicyError`` if
    refused."""
    return resolve_request_policy(default_policy(config), overrides_of(custom_params), limits)


def attach_policy(req, config, limits: RequestLimits) -> RequestPolicy:
    """Resolve ``req``'s policy from its sampling parameters and keep it on the Req
    (``POLICY_ATTR``); raises ``RequestPolicyError`` and attaches nothing if refused."""
    policy = resolve_for_custom_params(req.sampling_params.custom_params, config, limits)
    setattr(req, POLICY_ATTR, policy)
    return policy


def policy_of(req) -> RequestPolicy | None:
    """The policy attached to ``req`` (None: the server's)."""
    return getattr(req, POLICY_ATTR, None)


# --- where the request enters: the tokenizer manager (the HTTP server's process) --------


@lru_cache(maxsize=4)
def _entrance(page_size: int, tp_size: int):
    """``(config, limits)`` of this server, from ``SGLANG_EVICT_CONFIG`` (read once)."""
    config = config_from_env(page_size)
    return config, request_limits(config, tp_size)


def _after_validate_one_request(result, tokenizer_manager, obj, *args, **kwargs):
    server_args = tokenizer_manager.server_args
    if getattr(server_args, "radix_cache_backend", None) != BACKEND_NAME:
        return result
    sampling_params = getattr(obj, "sampling_params", None)
    if not isinstance(sampling_params, dict):  # embedding requests carry none
        return result
    beam_width = sampling_params.get("beam_width")
    if isinstance(beam_width, int) and beam_width > 1:  # SGLang 0.5.23's beam search
        raise RequestPolicyError(
            "beam_width",
            f"sampling_params.beam_width={beam_width} is not supported with sglang-evict yet "
            "(beam members are decode rows without a request of their own); drop beam_width "
            "or send the request to a server without --radix-cache-backend sglang-evict",
        )
    custom_params = sampling_params.get("custom_params")
    if overrides_of(custom_params) is None:
        return result
    config, limits = _entrance(server_args.page_size or 1, server_args.tp_size or 1)
    resolve_for_custom_params(custom_params, config, limits)  # RequestPolicyError: a 400
    return result


# --- where the scheduler queues it: the second check, before any eviction state -----


def _before_add_request_to_queue(scheduler, req, *args, **kwargs):
    cache = getattr(scheduler, "tree_cache", None)
    retracted = kwargs.get("is_retracted", args[0] if args else False)
    if not isinstance(cache, EvictingCache) or retracted:
        return None
    if req.finished() or req.to_finish is not None:  # already refused by SGLang itself
        return None
    manager = cache.evictor
    limits = manager.request_limits or request_limits(manager.config)
    try:
        attach_policy(req, manager.config, limits)
    except RequestPolicyError as error:
        req.set_finish_with_abort(str(error))
    return None  # arguments unchanged


# --- where the report leaves -----------------------------------------------------------


def eviction_report(req, manager) -> dict:
    """What eviction did to ``req`` so far (read before its state is dropped): its
    policy, passes, tokens evicted, the most KV it held, failed passes and retractions,
    since it was admitted; the full-precision tokens it holds now; on a server with the
    tier also its tier tokens."""
    policy = policy_of(req) or manager.default_policy
    carried = getattr(req, CARRIED_ATTR, (0,) * len(REPORT_FIELDS))
    passes, evicted, peak, failed, retractions = carried
    state = manager.states.get(req.rid)
    kv = req_kv(req)
    held = kv.kv_allocated_len if req.kv is not None else kv.kv_committed_len
    report = {
        **policy.as_dict(),
        "passes": passes + (state.num_passes if state else 0),
        "tokens_evicted": evicted + (state.tokens_evicted if state else 0),
        "peak_kv_tokens": max(peak, state.peak_kv_tokens if state else 0, held),
        "passes_failed": failed + manager.failures.failed_passes.get(req.rid, 0),
        "retractions": retractions,
        "kv_tokens_held": held,
    }
    if manager.tier_arena is not None:  # a server with the tier: what its tier holds now
        report["tier_tokens_held"] = manager.tier_arena.tokens_of(req.rid)
    return report


def settle_report(req, manager) -> dict | None:
    """As ``req`` releases its KV (``cache_finished_req``): a finished request gets its
    report (returned); a retracted one keeps its counts for the report it gets when it
    finishes after its re-prefill (None)."""
    report = eviction_report(req, manager)
    if not req.finished():  # retraction: SGLang releases unfinished requests only then
        report["retractions"] += 1
        setattr(req, CARRIED_ATTR, tuple(report[key] for key in REPORT_FIELDS))
        return None
    write_report(req, report)
    return report


def write_report(req, report: dict) -> None:
    """Put ``report`` at ``req``'s last output token in SGLang's ``customized_info``."""
    num_tokens = len(req.output_ids_through_stop)
    if num_tokens == 0:
        return
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info[REPORT_KEY] = [None] * (num_tokens - 1) + [report]
