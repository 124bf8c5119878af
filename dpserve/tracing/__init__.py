"""OpenTelemetry traces of requests across dpserve's processes (`--otlp-traces-endpoint`,
`--trace-file`).

Scope: the options (`TracingConfig`, checked by `tracing_config`), this process's tracer
(`install` once at start-up with the process's service name, `shutdown` to flush before
exit, `active`), and `child_span`, the API server's context manager for a span under a
request's trace context. The context travels between processes as a W3C carrier
(`{"traceparent": ..., "tracestate": ...}`: `EngineCoreRequest.trace_headers`); the
span helpers are in `dpserve.tracing.spans`, the engine's per-request record in
`dpserve.tracing.engine_trace`, the exporters in `dpserve.tracing.provider`.

Zero cost when off: nothing here imports opentelemetry until `install` runs (the
options set), and the hot paths test one attribute (`request.trace_headers is not
None`, `Request.trace is not None`) before any of it. Spans carry sizes, ids, ranks
and timings, never a prompt's or an output's text or tokens (SECURITY.md).

Not here: where spans are made (the API server: `dpserve.server.trace_http` and
`dpserve.server.openai.serving`; routing: `dpserve.frontend.route_trace`; the engine:
`dpserve.engine.scheduler`'s hooks into `engine_trace`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from dpserve.tracing.options import EXTRA_HINT, TracingConfig, tracing_config
from dpserve.tracing.state import THIS_PROCESS, active, process_attributes, tracer

__all__ = ["EXTRA_HINT", "TracingConfig", "active", "child_span", "install",
           "process_attributes", "shutdown", "tracer", "tracing_config"]


# A process's role -> the attribute naming its index on every span it makes.
ROLE_ATTRIBUTES = {"engine": "dpserve.rank", "api-server": "dpserve.api_server"}


def install(config: TracingConfig | None, role: str, index: int, exporter: Any = None,
            ) -> None:
    """Start this process's tracer (nothing when `config` is None: tracing off): spans
    go to `config`'s exporters (or `exporter`, a SpanExporter: tests), batched off the
    calling threads. `role` ("engine", "api-server") and `index` (rank, API server
    index) name the service (`dpserve-engine-1`) and go on every span made here
    (`dpserve.rank=1`)."""
    if config is None:
        return
    from dpserve.tracing.provider import make_provider

    attributes = {ROLE_ATTRIBUTES[role]: index}
    THIS_PROCESS.provider = make_provider(config, f"dpserve-{role}-{index}", attributes,
                                          exporter)
    THIS_PROCESS.tracer = THIS_PROCESS.provider.get_tracer("dpserve")
    THIS_PROCESS.attributes = attributes


def shutdown(timeout_s: float = 5.0) -> None:
    """Export what is queued and stop (before the process exits; nothing when off)."""
    provider = THIS_PROCESS.provider
    if provider is None:
        return
    with contextlib.suppress(Exception):  # an unreachable collector must not stop the exit
        provider.force_flush(int(timeout_s * 1000))
        provider.shutdown()
    THIS_PROCESS.tracer = THIS_PROCESS.provider = None


_OFF: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


def child_span(name: str, carrier: dict[str, str] | None, **attributes: Any,
               ) -> contextlib.AbstractContextManager[Any]:
    """A span `name` under the context in `carrier` for the `with` block (a shared
    no-op when `carrier` is None: the request is not traced)."""
    if carrier is None or THIS_PROCESS.tracer is None:
        return _OFF
    return _span_block(name, carrier, attributes)


@contextlib.contextmanager
def _span_block(name: str, carrier: dict[str, str], attributes: dict[str, Any]
                ) -> Iterator[Any]:
    from dpserve.tracing.spans import start_span

    span = start_span(name, carrier, attributes=attributes)
    try:
        yield span
    except BaseException as e:
        span.set_attribute("error.type", type(e).__name__)
        raise
    finally:
        span.end()
