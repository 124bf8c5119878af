"""The root span of each traced API request (only installed when tracing is on).

Scope: `TraceMiddleware`, the outermost ASGI middleware of the app when this API
server traces (`dpserve.tracing.active()`): every POST under /v1 gets a span
"POST /v1/chat/completions" from its arrival to its response's last byte (a stream's
too), a child of the client's W3C `traceparent` when it sends one (the trace is then
the client's), else the root of a new trace. The span's context, as W3C headers, is
left in `request.state.trace_headers`, where `caller_of` (`dpserve.server.caller`)
takes it into `Caller.trace_headers`: the serving layer makes its child spans (parse,
chat template, tokenise, send) from it and every engine request carries it.

Attributes: method, path, status, this API server's index; no header or body value.

Not here: the tracer (`dpserve.tracing`), the serving layer's spans.
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

TRACED_PREFIX = "/v1/"


class TraceMiddleware:
    """A span per POST /v1/* request (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] != "POST"
                or not scope["path"].startswith(TRACED_PREFIX)):
            await self.app(scope, receive, send)
            return
        from dpserve.tracing.spans import carrier_of, start_span

        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                   if k in (b"traceparent", b"tracestate")}
        span = start_span(f"POST {scope['path']}", headers, attributes={
            "http.request.method": "POST", "url.path": scope["path"]})
        scope.setdefault("state", {})["trace_headers"] = carrier_of(span)
        status: dict[str, Any] = {}

        async def traced_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        except BaseException as e:
            span.set_attribute("error.type", type(e).__name__)
            raise
        finally:
            if "code" in status:
                span.set_attribute("http.response.status_code", status["code"])
            span.end()
