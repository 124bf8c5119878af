"""Spans from and into W3C carriers (imported only when tracing is on).

Scope: `start_span` (a span whose parent is the context a carrier holds: the client's
`traceparent`, or the span of another dpserve process), `carrier_of` (a span's
context as a carrier, for the next process), `link_to` (a link to a carrier's span: a
migration links the placement it replaces), `record_span` (a finished span with
explicit times: the engine writes its spans when a request finishes).

Not here: the per-process tracer (`dpserve.tracing`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from dpserve.tracing.state import process_attributes, tracer

_PROPAGATOR = TraceContextTextMapPropagator()


def start_span(name: str, carrier: Mapping[str, str] | None, *,
               attributes: Mapping[str, Any] | None = None, start_ns: int | None = None,
               links: Sequence[trace.Link] = ()) -> trace.Span:
    """A span `name` (ended by the caller) under the carrier's context (None, or one
    without a valid `traceparent`: a new trace). Carries this process's attributes."""
    context = _PROPAGATOR.extract(dict(carrier)) if carrier else None
    return tracer().start_span(name, context=context, start_time=start_ns, links=links,
                               attributes={**process_attributes(), **(attributes or {})})


def carrier_of(span: trace.Span) -> dict[str, str]:
    """The span's context as W3C headers (traceparent, and tracestate when set)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def link_to(carrier: Mapping[str, str], **attributes: Any) -> list[trace.Link]:
    """A link to the span a carrier names ([] when it names none)."""
    ctx = trace.get_current_span(_PROPAGATOR.extract(dict(carrier))).get_span_context()
    return [trace.Link(ctx, attributes)] if ctx.is_valid else []


def record_span(name: str, parent: Mapping[str, str] | trace.Span | None, start_ns: int,
                end_ns: int, attributes: Mapping[str, Any] | None = None,
                events: Sequence[tuple[str, int, Mapping[str, Any]]] = (),
                links: Sequence[trace.Link] = ()) -> trace.Span:
    """A finished span from `start_ns` to `end_ns` (unix ns) under `parent` (a carrier,
    or a span of this process), with `events` (name, unix ns, attributes)."""
    if isinstance(parent, trace.Span):
        context = trace.set_span_in_context(parent)
        span = tracer().start_span(name, context=context, start_time=start_ns, links=links,
                                   attributes={**process_attributes(), **(attributes or {})})
    else:
        span = start_span(name, parent, attributes=attributes, start_ns=start_ns, links=links)
    for event, at_ns, attrs in events:
        span.add_event(event, dict(attrs), timestamp=at_ns)
    span.end(end_time=end_ns)
    return span
