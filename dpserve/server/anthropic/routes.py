"""The routes of Anthropic's Messages API, and its error shape.

Scope: `install_messages_api(app, async_llm, serving)` mounts

* `POST /v1/messages`: Anthropic's message, or its event stream (`stream: true`);
* `POST /v1/messages/count_tokens`: `{"input_tokens": N}`, the prompt as the chat
  template renders it (with the tools);

as thin routes over `AnthropicServing` (the same strict parsing, drain 503,
`X-data-parallel-rank`, `X-Session-ID` and disconnect handling as the OpenAI routes:
`dpserve.server.openai.routes`), and `AnthropicErrors`, an ASGI middleware that
gives every error answered on these paths Anthropic's body, `{"type": "error",
"error": {"type", "message"}}` (type by status: 400 invalid_request_error, 401
authentication_error, 404 not_found_error, 413 request_too_large, ...), whatever
answered it: the API key check (`x-api-key` or `Authorization: Bearer`,
`dpserve.server.auth`), the body limit (`dpserve.server.bodies`), the app's
error handler, or an unexpected exception (a 500). The status and headers are
kept; a success passes through untouched (streams are not buffered).

Not here: the translation (`dpserve.server.anthropic.serving`), the schemas
(`dpserve.server.anthropic.protocol`).
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dpserve.frontend.async_llm import AsyncLLM
from dpserve.frontend.errors import RequestError
from dpserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest, error_body
from dpserve.server.anthropic.serving import AnthropicServing
from dpserve.server.auth import route_path
from dpserve.server.caller import caller_of
from dpserve.server.errors import to_api_error
from dpserve.server.openai.routes import drain_check, parse_body, respond
from dpserve.server.openai.serving import OpenAIServing

MESSAGES_PATH = "/v1/messages"
_M = TypeVar("_M", bound=BaseModel)


def install_messages_api(app: FastAPI, async_llm: AsyncLLM, serving: OpenAIServing) -> None:
    """The routes over `serving`'s chat path, and their error shape. Called after the
    auth and body-limit middleware are added, so that this one wraps them."""
    app.include_router(messages_router(async_llm, AnthropicServing(serving)))
    app.add_middleware(AnthropicErrors)


def messages_router(async_llm: AsyncLLM, anthropic: AnthropicServing) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(drain_check(async_llm))])

    @router.post("/messages")
    async def messages(request: Request) -> Response:
        body = await _parse(request, MessagesRequest)
        return await respond(request, anthropic.create_message(
            body, caller_of(request)))

    @router.post("/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        body = await _parse(request, CountTokensRequest)
        return await respond(request, anthropic.count_tokens(body))

    return router


async def _parse(request: Request, model: type[_M]) -> _M:
    """The body, strictly parsed; a bad field is a 400 naming it by Anthropic's path."""
    try:
        return await parse_body(request, model)
    except ValidationError as e:
        raise validation_error(e) from None


_BRANCH = re.compile(r"\[|^(str|int|float|bool|none)$")  # a union member in a pydantic loc


def validation_error(e: ValidationError) -> RequestError:
    """The deepest failing field of `e` (in a union, the member that got furthest) at
    its path as Anthropic writes it (`messages.0.content.1.tool_use_id`)."""
    err = max(e.errors(), key=lambda x: len(x["loc"]))
    path = ".".join(str(p) for p in err["loc"] if not _BRANCH.search(str(p)))
    return RequestError(f"{path}: {err['msg']}" if path else err["msg"], param=path or None)


def is_messages_path(scope: Scope) -> bool:
    path = route_path(scope)
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


class AnthropicErrors:
    """Every error answered on /v1/messages[/...] in Anthropic's shape (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_messages_path(scope):
            await self.app(scope, receive, send)
            return
        error_start: Message | None = None  # the start of an error response, held
        body: list[bytes] = []
        started = False

        async def reshape(message: Message) -> None:
            nonlocal error_start, started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400:
                    error_start = message
                    return
            elif error_start is not None and message["type"] == "http.response.body":
                body.append(message.get("body", b""))
                if not message.get("more_body"):
                    await _send_reshaped(send, error_start, b"".join(body))
                return
            await send(message)

        try:
            await self.app(scope, receive, reshape)
        except Exception as e:  # noqa: BLE001 - answered here, in this API's shape
            if started:
                raise
            error = to_api_error(e)  # logs it
            await _send(send, error.status_code, error_body(error.status_code, error.message),
                        [])


async def _send_reshaped(send: Send, start: Message, raw: bytes) -> None:
    """The held error response, its OpenAI body as Anthropic's (any other body as is)."""
    headers = [(k, v) for k, v in start.get("headers", [])
               if k.lower() not in (b"content-length", b"content-type")]
    try:
        error = json.loads(raw)["error"]
        message = error["message"] if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        await send(start)
        await send({"type": "http.response.body", "body": raw})
        return
    await _send(send, start["status"], error_body(start["status"], str(message)), headers)


async def _send(send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]],
                ) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        *headers, (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
