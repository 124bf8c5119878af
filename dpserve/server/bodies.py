"""Request bodies and query numbers: the one size-limited reader, JSON-only admin
posts, bounded seconds.

Scope:

* `BodyLimit`, an ASGI middleware in front of every route: a request whose
  Content-Length is over `--max-request-body-bytes` (an upload route's own cap:
  /v1/files, `--max-batch-file-bytes`) gets 413 at once; a body
  sent without one (chunked) is counted as the route reads it, and the read
  that crosses the limit raises a 413 `APIError` (the app's error handler
  answers it). Every route reads its body through it (`request.body()`,
  `request.stream()`), so none reads an unbounded one.
* `require_json`, the dependency of every admin / control route: a POST must
  say `Content-Type: application/json` (415 otherwise; `{}` is a fine body).
  An HTML form can only send form or text types, so a cross-site form post
  cannot reach these routes, and a cross-site fetch() with JSON needs a CORS
  preflight that no origin passes by default.
* `query_seconds`, a `?timeout=`-style query parameter: finite, positive and
  at most a bound, else 400 naming the bound.

Not here: the API key (`dpserve.server.auth`), request-field limits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dpserve.server.errors import APIError, send_error

MAX_WAIT_S = 3600.0  # the largest ?timeout= a control route accepts


def too_large(limit: int, option: str = "--max-request-body-bytes") -> APIError:
    return APIError(413, f"request body larger than {option} ({limit} bytes)",
                    code="request_too_large")


class BodyLimit:
    """Caps every request body at `limit` bytes (module docstring); `uploads`: the
    POST routes (by path) with a cap of their own, path -> (bytes, the flag to name)."""

    def __init__(self, app: ASGIApp, limit: int,
                 uploads: Mapping[str, tuple[int, str]] | None = None) -> None:
        self.app = app
        self.limit = limit
        self.uploads = dict(uploads or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, option = self.limit, "--max-request-body-bytes"
        path, root = scope["path"], scope.get("root_path", "")
        path = path[len(root):] if root and path.startswith(root) else path
        if scope["method"] == "POST" and path in self.uploads:
            limit, option = self.uploads[path]
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            await send_error(send, too_large(limit, option))
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise too_large(limit, option)
            return message

        await self.app(scope, limited, send)


async def require_json(request: Request) -> None:
    """415 for a POST that is not `Content-Type: application/json` (module docstring)."""
    if request.method != "POST":
        return
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"this route takes Content-Type: application/json (a body of {{}} "
                       f"will do), got {media_type or 'none'!r}", code="unsupported_media_type")


def query_seconds(request: Request, name: str, default: float,
                  maximum: float = MAX_WAIT_S) -> float:
    """`?name=S`: seconds in (0, maximum]; `default` when absent; else 400."""
    value = request.query_params.get(name)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and 0 < seconds <= maximum):
        raise APIError(400, f"{name} must be a number of seconds in (0, {maximum:g}], got "
                       f"{value!r}", param=name)
    return seconds
