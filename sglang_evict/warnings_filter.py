"""Third-party notices known to say nothing to a user of this machine, silenced in one
place; every other warning still shows.

Importing SGLang 0.5.17 on a host without CUDA prints four notices about features the
plugin never uses there (Triton's FLA kernels, AWQ and GGUF quantisation, torch's CUDA
extension builder). ``install()`` filters exactly those, by category, module and message
(warnings) or by logger and message (log records), and is called by the CLI before
anything imports SGLang. Add an entry only for a notice that is harmless whatever the
user does, with the module that emits it.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownWarning:
    """A ``warnings.warn`` call: category, emitting module (regex), message (regex, from
    its start)."""

    category: type[Warning]
    module: str
    message: str


@dataclass(frozen=True)
class KnownLogRecord:
    """A log record: logger name (exact) and message (regex, from its start)."""

    logger: str
    message: str


KNOWN_WARNINGS = (
    # SGLang's FLA attention helpers fall back to torch without a GPU; the plugin's CPU
    # paths never call them.
    KnownWarning(
        UserWarning,
        r"sglang\.kernels\.ops\.attention\.fla\.utils",
        r"Triton is not supported on current platform, roll back to CPU",
    ),
    # Quantisation methods SGLang registers at import; only a quantised model uses them.
    KnownWarning(
        UserWarning,
        r"sglang\.srt\.layers\.quantization\.awq\.awq",
        r"Only CUDA, HIP and XPU support AWQ currently",
    ),
    KnownWarning(
        UserWarning,
        r"sglang\.srt\.layers\.quantization\.gguf",
        r"Only CUDA, MUSA and NPU support GGUF quantization currently",
    ),
)

KNOWN_LOG_RECORDS = (
    # torch's C++/CUDA extension builder, imported by SGLang, on a host without CUDA:
    # no extension is built by anything the CLI runs.
    KnownLogRecord("torch.utils.cpp_extension", r"No CUDA runtime is found"),
)


class _DropKnown(logging.Filter):
    def __init__(self, patterns: list[re.Pattern]) -> None:
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(pattern.match(message) for pattern in self.patterns)


def install() -> None:
    """Silence the known notices in this process (idempotent)."""
    for known in KNOWN_WARNINGS:
        warnings.filterwarnings(
            "ignore", message=known.message, category=known.category, module=known.module
        )
    by_logger: dict[str, list[re.Pattern]] = {}
    for record in KNOWN_LOG_RECORDS:
        by_logger.setdefault(record.logger, []).append(re.compile(record.message))
    for name, patterns in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(_DropKnown(patterns))
