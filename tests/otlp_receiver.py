"""A real OTLP/HTTP trace receiver for tests: what a collector would get from dpserve.

`OTLPReceiver` serves POST /v1/traces on 127.0.0.1 (a free port) in a thread, decodes
each `ExportTraceServiceRequest` protobuf with the opentelemetry-proto package (which
the OTLP exporter brings) and keeps every span in memory as a plain `Span`; tests wait
on `wait_for` (a condition over the spans, with a deadline), never on a sleep.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from helpers import wait_until
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class Span:
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str | None  # None: a root
    name: str
    service: str  # the resource's service.name
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    links: list[str] = field(default_factory=list)  # the span ids linked to


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class OTLPReceiver:
    """POST /v1/traces -> `spans` (module docstring). Use as a context manager."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        self.posts = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                status = 200 if self.path == "/v1/traces" else 404
                if status == 200:
                    receiver.take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> OTLPReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)

    def take(self, request: ExportTraceServiceRequest) -> None:
        got = []
        for resource_spans in request.resource_spans:
            service = _attrs(resource_spans.resource.attributes).get("service.name", "")
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    got.append(Span(
                        s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex() or None,
                        s.name, service, s.start_time_unix_nano, s.end_time_unix_nano,
                        _attrs(s.attributes),
                        [(e.name, _attrs(e.attributes)) for e in s.events],
                        [link.span_id.hex() for link in s.links]))
        with self.lock:
            self.spans.extend(got)
            self.posts += 1

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, check: Callable[[], object], timeout: float, what: str) -> Any:
        return wait_until(check, timeout, what)
