"""OpenTelemetry names and helpers shared by the scheduler side and the compactor.

Span tree of one pass (names defined once, here):

    compaction.pass                  scheduler: requests, tokens before/after, pages freed,
    ├── compaction.score             bytes moved, strategy, scorer, epoch, fencing token,
    ├── compaction.plan              outcome
    ├── compaction.rpc               the Compact call (gRPC client span beneath it)
    │   └── compactor.compact        compactor process (continued from W3C traceparent)
    │       ├── compactor.validate
    │       ├── compactor.lease_check
    │       └── compactor.kernel
    └── compaction.commit

Only the OpenTelemetry API is used here: without an SDK configured by the process owner
every span is a no-op. The plugin never installs exporters in SGLang's process (SGLang
does, with ``--enable-trace``); the compactor configures its own from ``OTEL_*``
variables (``configure_from_env``).
"""

from __future__ import annotations

import contextlib
import os

from opentelemetry import trace

TRACER_NAME = "sglang_evict"
SPAN_PASS = "compaction.pass"
SPAN_SCORE = "compaction.score"
SPAN_PLAN = "compaction.plan"
SPAN_RPC = "compaction.rpc"
SPAN_COMMIT = "compaction.commit"
SPAN_COMPACT = "compactor.compact"
SPAN_VALIDATE = "compactor.validate"
SPAN_LEASE_CHECK = "compactor.lease_check"
SPAN_KERNEL = "compactor.kernel"

# Attribute keys of compaction.pass
ATTR_REQUESTS = "compaction.requests"
ATTR_TOKENS_BEFORE = "compaction.tokens_before"
ATTR_TOKENS_AFTER = "compaction.tokens_after"
ATTR_PAGES_FREED = "compaction.pages_freed"
ATTR_BYTES_MOVED = "compaction.bytes_moved"
ATTR_STRATEGY = "compaction.strategy"
ATTR_SCORER = "compaction.scorer"
ATTR_EPOCH = "compaction.epoch"
ATTR_FENCING_TOKEN = "compaction.fencing_token"
ATTR_OUTCOME = "compaction.outcome"
ATTR_KERNEL = "compactor.kernel"
ATTR_SLOTS_MOVED = "compactor.slots_moved"


class _SpanNotRecorded:
    def set_attribute(self, key: str, value: object) -> None:
        pass

    def is_recording(self) -> bool:  # attributes worth computing only when recorded
        return False


class _TracerNotRecording:
    """What ``tracer`` returns while no tracer provider is installed: spans that cost
    a method call (OpenTelemetry's own no-op spans cost the host ~10-20 us each, and a
    pass, which runs between two decode steps, opens five)."""

    _span = contextlib.nullcontext(_SpanNotRecorded())

    def start_as_current_span(self, name: str, **_: object):
        return self._span


_NOT_RECORDING = _TracerNotRecording()


def tracer() -> trace.Tracer | _TracerNotRecording:
    """The project's tracer: OpenTelemetry's, once a tracer provider is installed in
    the process (SGLang's ``--enable-trace``, ``configure_from_env``); until then one
    whose spans do nothing. Ask again for each span tree (never keep it): the provider
    may be installed later."""
    if isinstance(
        trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider
    ):
        return _NOT_RECORDING
    return trace.get_tracer(TRACER_NAME)


def configure_from_env(service_name: str = "sglang-evict-compactor") -> bool:
    """Install an SDK tracer provider in this (compactor) process when ``OTEL_*``
    variables ask for one: ``OTEL_TRACES_EXPORTER`` (``otlp`` or ``console``; default
    ``otlp`` when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set) and ``OTEL_SERVICE_NAME``.
    Returns whether tracing was configured. Never called in SGLang's process."""
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER")
    if exporter_name is None:
        exporter_name = "otlp" if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") else "none"
    if exporter_name == "none":
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    elif exporter_name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as error:
            raise RuntimeError(
                "OTEL_TRACES_EXPORTER=otlp needs opentelemetry-exporter-otlp; install "
                "sglang-evict[tracing] or unset OTEL_EXPORTER_OTLP_ENDPOINT"
            ) from error
        exporter = OTLPSpanExporter()
    else:
        raise ValueError(
            f"unsupported OTEL_TRACES_EXPORTER {exporter_name!r}; known: otlp, console, none"
        )
    name = os.environ.get("OTEL_SERVICE_NAME", service_name)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return True
