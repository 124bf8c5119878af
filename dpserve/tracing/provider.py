"""This process's TracerProvider and its exporters (imported only when tracing is on).

Scope: `make_provider` (a resource naming the service, one BatchSpanProcessor per
destination: the OTLP/HTTP exporter for `--otlp-traces-endpoint`, `JsonlSpanExporter`
for `--trace-file`; batches as OpenTelemetry's environment says, e.g.
`OTEL_BSP_SCHEDULE_DELAY` ms between exports, 5000 by default, and
`dpserve.tracing.shutdown` exports the rest at exit), and `JsonlSpanExporter`: one
JSON object per span per line, appended to a file every dpserve process shares (opened
O_APPEND, each batch written with one write(), so lines of two processes never
interleave).

Not here: the options and the per-process state (`dpserve.tracing`), making spans
(`dpserve.tracing.spans`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from dpserve.tracing.options import TracingConfig


def make_provider(config: TracingConfig, service_name: str, attributes: Mapping[str, Any],
                  exporter: SpanExporter | None = None) -> TracerProvider:
    """A provider exporting to `config`'s destinations in batches (or synchronously to
    `exporter`, when given: tests)."""
    provider = TracerProvider(resource=Resource.create({"service.name": service_name,
                                                        **attributes}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return provider
    if config.otlp_traces_endpoint is not None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=config.otlp_traces_endpoint)))
    if config.trace_file is not None:
        provider.add_span_processor(BatchSpanProcessor(
            JsonlSpanExporter(config.trace_file)))
    return provider


class JsonlSpanExporter(SpanExporter):
    """Spans as JSON lines appended to `path` (created 0600): trace_id, span_id,
    parent_span_id (hex; null for a root), name, start/end (unix ns), attributes,
    events, links, service and resource."""

    def __init__(self, path: str) -> None:
        self.fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.fd is None:
            return SpanExportResult.FAILURE
        data = "".join(json.dumps(span_record(s), separators=(",", ":")) + "\n"
                       for s in spans).encode()
        try:
            while data:  # one write() for the batch, unless the kernel takes part of it
                data = data[os.write(self.fd, data):]
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One span as the JSONL file holds it."""
    ctx = span.get_span_context()
    assert ctx is not None
    resource = dict(span.resource.attributes) if span.resource is not None else {}
    return {
        "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "name": span.name, "start_unix_ns": span.start_time, "end_unix_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "time_unix_ns": e.timestamp,
                    "attributes": dict(e.attributes or {})} for e in span.events],
        "links": [{"trace_id": f"{link.context.trace_id:032x}",
                   "span_id": f"{link.context.span_id:016x}",
                   "attributes": dict(link.attributes or {})} for link in span.links],
        "service": resource.get("service.name"), "resource": resource,
    }
