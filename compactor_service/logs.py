"""The compactor's log lines: JSON (or text), bounded, with URL credentials redacted.

Every line goes through ``_bounded``: the message and each ``extra`` field are cut to a
fixed length (client-supplied strings cannot make a line long) and every
``scheme://user:password@`` is replaced by ``scheme://user:***@`` (``secrets.redact_text``),
whatever part of the program produced the text.

Lines a client can cause at will (the servicer's refusals) also go through a
``LogRateLimiter``: a flood of refused calls (11.4 MB of log in 90 s, measured) costs a
few lines per client and cause and a count of the rest.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from compactor_service.limits import (
    REFUSAL_LINES_IN_ALL,
    REFUSAL_LINES_PER_KEY,
    REFUSAL_LOG_INTERVAL_S,
    REFUSAL_LOG_KEYS,
)
from compactor_service.secrets import redact_text

MAX_MESSAGE_CHARS = 1000
MAX_FIELD_CHARS = 500
MAX_TRACEBACK_CHARS = 4000


def _bounded(text: str, limit: int) -> str:
    text = redact_text(text)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, message and any ``extra`` fields."""

    _standard = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": _bounded(record.getMessage(), MAX_MESSAGE_CHARS),
        }
        for key, value in vars(record).items():
            if key in self._standard:
                continue
            if not isinstance(value, (int, float, bool, type(None))):
                value = _bounded(str(value), MAX_FIELD_CHARS)
            entry[key] = value
        if record.exc_info:
            entry["exc"] = _bounded(self.formatException(record.exc_info), MAX_TRACEBACK_CHARS)
        return json.dumps(entry)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return _bounded(super().format(record), MAX_MESSAGE_CHARS + MAX_TRACEBACK_CHARS)


@dataclass(frozen=True)
class Suppressed:
    """``count`` events of ``key`` were not logged over ``seconds``; ``key`` None: the
    events of ``kinds`` keys whose own summary did not fit (see ``LogRateLimiter``)."""

    key: Hashable | None
    count: int
    seconds: float
    kinds: int = 1


@dataclass
class _Window:
    start_s: float
    logged: int = 0
    suppressed: int = 0


class LogRateLimiter:
    """Which events of a key (e.g. client and cause) get a log line: at most ``per_key``
    in a window of ``interval_s`` from the key's first event, and ``in_all`` lines (the
    summaries included) per window across keys; the rest are counted.

    A key's count is reported once its window ends (``Suppressed``, from the next
    ``admit`` of that key, from ``expired``, which the server calls periodically, or
    from ``drain`` at shutdown); a count whose line would exceed ``in_all``, or of a key
    dropped because ``max_keys`` are tracked (least recently used first), is added to
    one summary for the whole window (``key`` None). So a window has at most
    ``in_all + 1`` lines whatever the number of keys, memory holds ``max_keys``
    windows, and every event is either logged or counted in exactly one summary.
    Thread-safe; ``clock`` is injectable for tests."""

    def __init__(
        self,
        per_key: int = REFUSAL_LINES_PER_KEY,
        in_all: int = REFUSAL_LINES_IN_ALL,
        interval_s: float = REFUSAL_LOG_INTERVAL_S,
        max_keys: int = REFUSAL_LOG_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_key, self.in_all, self.interval_s = per_key, in_all, interval_s
        self.max_keys, self.clock = max_keys, clock
        self._windows: OrderedDict[Hashable, _Window] = OrderedDict()
        self._all = _Window(clock())  # lines in all; ``suppressed``: the overflow
        self._overflow_kinds = 0
        self._lock = threading.Lock()

    def admit(self, key: Hashable) -> tuple[bool, list[Suppressed]]:
        """Whether to log this event of ``key``, and the summaries now due."""
        with self._lock:
            now = self.clock()
            due = self._roll(now)
            window = self._windows.get(key)
            if window is not None and now - window.start_s >= self.interval_s:
                del self._windows[key]
                self._summarise(key, window, now, due)
                window = None
            if window is None:
                window = self._windows[key] = _Window(now)
                while len(self._windows) > self.max_keys:
                    self._overflow(self._windows.popitem(last=False)[1])
            else:
                self._windows.move_to_end(key)
            if window.logged < self.per_key and self._all.logged < self.in_all:
                window.logged += 1
                self._all.logged += 1
                return True, due
            window.suppressed += 1
            return False, due

    def expired(self) -> list[Suppressed]:
        """The summaries of windows that have ended (their keys are forgotten)."""
        with self._lock:
            now = self.clock()
            due = self._roll(now)
            for key, window in list(self._windows.items()):
                if now - window.start_s >= self.interval_s:
                    del self._windows[key]
                    self._summarise(key, window, now, due)
            return due

    def drain(self) -> list[Suppressed]:
        """Every count not reported yet, windows ended or not (shutdown)."""
        with self._lock:
            now = self.clock()
            due = self._roll(now)
            while self._windows:
                key, window = self._windows.popitem(last=False)
                if window.suppressed:
                    due.append(Suppressed(key, window.suppressed, self._seconds(window, now)))
            if self._all.suppressed:
                due.append(self._overflow_summary(now))
            return due

    def _seconds(self, window: _Window, now: float) -> float:
        return min(now - window.start_s, self.interval_s)

    def _summarise(self, key: Hashable, window: _Window, now: float, due: list) -> None:
        if not window.suppressed:
            return
        if self._all.logged < self.in_all:
            self._all.logged += 1
            due.append(Suppressed(key, window.suppressed, self._seconds(window, now)))
        else:
            self._overflow(window)

    def _overflow(self, window: _Window) -> None:
        if window.suppressed:
            self._all.suppressed += window.suppressed
            self._overflow_kinds += 1

    def _overflow_summary(self, now: float) -> Suppressed:
        summary = Suppressed(
            None, self._all.suppressed, self._seconds(self._all, now), self._overflow_kinds
        )
        self._all.suppressed = self._overflow_kinds = 0
        return summary

    def _roll(self, now: float) -> list[Suppressed]:
        """Start a new window in all if this one ended; its overflow summary is due."""
        if now - self._all.start_s < self.interval_s:
            return []
        due = [self._overflow_summary(now)] if self._all.suppressed else []
        self._all = _Window(now)
        return due


LOG_FORMATS = {"json": JsonFormatter, "text": TextFormatter}
LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(log_format: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LOG_FORMATS[log_format]())
    root = logging.getLogger("sglang_evict")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
