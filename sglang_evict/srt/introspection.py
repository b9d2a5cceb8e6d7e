"""What the plugin shows of itself inside SGLang: its state in ``get_server_info``, an
idle-time check that it holds no per-request state, and an optional log line per pass.

* ``Scheduler.get_internal_state`` (AFTER hook): the reply SGLang sends for
  ``/get_server_info`` (``internal_states[i]``) and ``Engine.get_server_info()`` gains a
  ``sglang_evict`` entry: requests with eviction state, passes, tokens evicted, pages
  freed, idle checks passed.
* ``Scheduler.on_idle`` (AFTER hook): when the scheduler is fully idle no request runs,
  so the plugin must hold no per-request state; like SGLang's own idle memory check it
  raises when ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE`` is on (SGLang's default)
  and warns otherwise.
* ``SGLANG_EVICT_LOG_PASSES=1``: one JSON log line per decode step with passes
  (``sglang-evict pass {...}``): each request's tokens before/after and pages freed, and
  the allocator's free slots before and after the pass, read from SGLang's allocator.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

HOOK_INTERNAL_STATE = "sglang.srt.managers.scheduler.Scheduler.get_internal_state"
HOOK_ON_IDLE = "sglang.srt.managers.scheduler.Scheduler.on_idle"
LOG_PASSES_ENV = "SGLANG_EVICT_LOG_PASSES"
PASS_LINE_PREFIX = "sglang-evict pass "  # engine_runner.parse_pass_lines reads it


@dataclass
class PassTotals:
    """Running totals of this scheduler's passes."""

    passes: int = 0
    tokens_evicted: int = 0
    pages_freed: int = 0
    pass_failures: int = 0
    idle_checks: int = 0  # idle-time checks passed (SGLang's own check runs just before)

    def add(self, results) -> None:
        for result in results:
            self.passes += 1
            self.tokens_evicted += result.tokens_evicted
            self.pages_freed += result.pages_freed


def log_passes_enabled() -> bool:
    return os.environ.get(LOG_PASSES_ENV, "") not in ("", "0", "false")


def log_pass(requests: list[dict], free_slots_before: int, free_slots_after: int) -> None:
    logger.info(
        "%s%s",
        PASS_LINE_PREFIX,
        json.dumps(
            {
                "requests": requests,
                "free_slots_before": free_slots_before,
                "free_slots_after": free_slots_after,
            },
            sort_keys=True,
        ),
    )


def plugin_report(manager, totals: PassTotals) -> dict:
    from sglang_evict.srt import capture

    report = {"tracked_requests": manager.num_tracked_requests(), **asdict(totals)}
    report["query_capture"] = capture.report()
    compactor = manager.compactor
    if hasattr(compactor, "sidecar_passes"):  # --kv-compactor grpc (FallbackCompactor)
        report["compactor"] = {
            "sidecar_up": bool(compactor.sidecar_up),
            "sidecar_passes": compactor.sidecar_passes,
            "fallback_passes": compactor.fallback_passes,
            "skipped_passes": compactor.skipped_passes,
        }
    return report


def _after_get_internal_state(result, *args, **kwargs):
    from sglang_evict.srt.backend import _Active

    state = getattr(result, "internal_state", None)  # GetInternalStateReqOutput
    if _Active.manager is not None and isinstance(state, dict):
        state["sglang_evict"] = plugin_report(_Active.manager, _Active.totals)
    return result


def _after_on_idle(result, scheduler, *args, **kwargs):
    from sglang_evict.srt.backend import _Active

    manager = _Active.manager
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
        _Active.totals.idle_checks += 1
    return result
