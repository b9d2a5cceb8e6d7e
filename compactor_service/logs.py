"""The compactor's log lines: JSON (or text), bounded, with URL credentials redacted.

Every line goes through ``_bounded``: the message and each ``extra`` field are cut to a
fixed length (client-supplied strings cannot make a line long) and every
``scheme://user:password@`` is replaced by ``scheme://user:***@`` (``secrets.redact_text``),
whatever part of the program produced the text.
"""

from __future__ import annotations

import json
import logging
import sys

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


LOG_FORMATS = {"json": JsonFormatter, "text": TextFormatter}
LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(log_format: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LOG_FORMATS[log_format]())
    root = logging.getLogger("sglang_evict")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
