"""`APIError`: an error the server answers, with its status, type, param and code;
`to_api_error`: any exception -> the OpenAI-shaped error it is answered with;
`send_error`: an error answered straight from an ASGI middleware (before any route).

The app's one exception handler and the in-stream error event both use it:
bad input is a 400 naming its parameter, a rank that cannot take a request a
503 "engine_unavailable", dead engines a 503 "engine_dead", anything else a
500 without a traceback (logged here).

Not here: the error body's pydantic shape (`ErrorResponse`, in
`dpserve.server.openai.protocol`).
"""

from __future__ import annotations

import json
import logging

from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from dpserve.frontend.errors import EngineDeadError, EngineUnavailableError, RequestError
from dpserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_PARAM_FIELDS = set(SamplingParams.__struct_fields__)


class APIError(Exception):
    """An error answered as `{"error": {...}}` with `status_code`."""

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers  # extra response headers (e.g. Retry-After)


def to_api_error(exc: BaseException) -> APIError:
    """Any exception -> the OpenAI error it is answered with."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        named = not loc or err["msg"].startswith(str(err["loc"][0]))
        message = err["msg"] if named else f"{loc}: {err['msg']}"
        return APIError(400, message, param=str(err["loc"][0]) if err["loc"] else None)
    if isinstance(exc, RequestError):
        return APIError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, ValueError):
        name = str(exc).split(" ", 1)[0]
        return APIError(400, str(exc), param=name if name in _PARAM_FIELDS else None)
    if isinstance(exc, EngineUnavailableError):  # no rank serves it now; the server lives
        return APIError(503, str(exc), type="server_error", code="engine_unavailable")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error", code="engine_dead")
    if isinstance(exc, StarletteHTTPException) and 400 <= exc.status_code < 600:
        status, detail = exc.status_code, exc.detail or str(exc)
        return APIError(status, str(detail), type="invalid_request_error" if status < 500
                        else "server_error")
    logger.error("internal error", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}", type="server_error")


async def send_error(send: Send, error: APIError) -> None:
    """Answer `error` (its OpenAI body, status and extra headers) on an ASGI `send`."""
    body = json.dumps({"error": {"message": error.message, "type": error.type,
                                 "param": error.param, "code": error.code}}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items())]
    await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})
