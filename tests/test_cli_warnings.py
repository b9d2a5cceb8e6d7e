"""Known-harmless third-party notices are silenced by message and module; every other
warning and log record still shows."""

from __future__ import annotations

import logging
import warnings

import pytest

from sglang_evict import warnings_filter
from sglang_evict.warnings_filter import KNOWN_LOG_RECORDS, KNOWN_WARNINGS


def emitted(message: str, module: str, category=UserWarning) -> list[str]:
    """Messages recorded when ``module`` warns ``message`` with the filter installed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings_filter.install()
        warnings.warn_explicit(message, category, f"{module.replace('.', '/')}.py", 1, module)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("known", KNOWN_WARNINGS, ids=lambda k: k.module)
def test_known_notice_is_silenced_only_from_its_module(known):
    message = known.message.replace("\\", "") + "."
    module = known.module.replace("\\", "")
    assert emitted(message, module, known.category) == []
    assert emitted(message, "sglang.srt.other_module", known.category) == [message]
    assert emitted("something else went wrong", module, known.category) == [
        "something else went wrong"
    ]


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("known", KNOWN_LOG_RECORDS, ids=lambda k: k.logger)
def test_known_log_record_is_dropped_and_others_kept(known):
    warnings_filter.install()
    logger = logging.getLogger(known.logger)  # torch's loggers do not propagate
    recorder = Recorder()
    logger.addHandler(recorder)
    try:
        logger.warning(known.message + ", using CUDA_HOME='/usr/local'")
        logger.warning("a compiler failed")
    finally:
        logger.removeHandler(recorder)
    assert recorder.messages == ["a compiler failed"]


def test_installing_twice_adds_one_log_filter():
    warnings_filter.install()
    warnings_filter.install()
    for known in KNOWN_LOG_RECORDS:
        filters = logging.getLogger(known.logger).filters
        assert sum(isinstance(f, warnings_filter._DropKnown) for f in filters) == 1
