"""The OpenAI routes: /v1/completions, /v1/chat/completions, /v1/models[/{id}].

`model` may name the base model (any of its names) or a LoRA adapter the
server holds (`ClusterView.loras`: the request runs with it); any other name is
a 404 `model_not_found`. /v1/models lists the adapters after the base model,
each with `root` = its path and `parent` = the base model's id.

Scope: `v1_router(serving, ...)`, thin routes over `OpenAIServing`: parse the
body strictly, run the serving call unless the client leaves first (then it is
cancelled, which aborts its requests in the engine), answer JSON or an SSE
stream. While the server drains (`AsyncLLM.draining`, set on SIGTERM) every
route answers 503 with `Retry-After` and code "server_draining"; requests
already in flight go on. Each route reads its `Caller` (`dpserve.server.caller`):
the `X-data-parallel-rank: k` header pins a request to engine k (a bad value is
a 400); an `X-Session-ID` header (or the body's `user`) keeps a conversation on
one engine while it may take it (`dpserve.server.sessions`; the pin wins).

`parse_body`, `respond` and `drain_check` are shared with the
routes of the other APIs on /v1 (`dpserve.server.anthropic.routes`).

Not here: the serving logic (`dpserve.server.openai.serving`), /tokenize and
/detokenize (`dpserve.server.openai.extras`), the error handler (`dpserve.server.app`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Send

from dpserve.frontend.async_llm import AsyncLLM
from dpserve.server.caller import caller_of
from dpserve.server.errors import APIError
from dpserve.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from dpserve.server.openai.serving import OpenAIServing
from dpserve.tracing import child_span

DRAIN_RETRY_AFTER_S = 5  # the Retry-After of a 503 while draining
_M = TypeVar("_M", bound=BaseModel)


def v1_router(async_llm: AsyncLLM, serving: OpenAIServing, names: Sequence[str]
              ) -> APIRouter:
    """The /v1 routes over `serving`; `names`: the model names /v1/models lists."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(drain_check(async_llm))])

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        return await respond(request, serving.create_completion(
            body, caller_of(request)))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        return await respond(request, serving.create_chat_completion(
            body, caller_of(request)))

    def card(name: str) -> ModelCard:
        """The base model by `name`, or the LoRA adapter `name` (its `parent`: the base)."""
        path = (async_llm.cluster.loras or {}).get(name) if name not in names else None
        if path is not None:
            return ModelCard(id=name, root=path, parent=names[0],
                             max_model_len=async_llm.max_model_len)
        return ModelCard(id=name, root=async_llm.config.model.path,
                         max_model_len=async_llm.max_model_len)

    @v1.get("/models")
    async def models() -> ModelList:
        adapters = sorted(async_llm.cluster.loras or ())
        return ModelList(data=[card(name) for name in [*names, *adapters]])

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        serving.check_model(model_id)
        return card(model_id)

    return v1


def draining_error() -> APIError:
    """The 503 of every /v1 route and /health while the server drains."""
    return APIError(503, "the server is shutting down and takes no new requests; retry "
                    "later or on another replica", type="server_error", code="server_draining",
                    headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)})


def drain_check(async_llm: AsyncLLM) -> Any:
    """The dependency of every /v1 route (this router's and /v1/messages'): the 503
    of `draining_error` while the server drains."""
    async def check() -> None:
        if async_llm.draining:
            raise draining_error()

    return check


async def parse_body(request: Request, model: type[_M]) -> _M:
    """Read the body (capped by `BodyLimit`: 413) and validate it strictly (a span
    "parse" when the request is traced: `dpserve.server.trace_http`)."""
    with child_span("parse", getattr(request.state, "trace_headers", None)):
        return model.model_validate_json(await request.body(), strict=True)


async def respond(request: Request, work: Awaitable[Any]) -> Response:
    """Await the serving call unless the client leaves first (then it is cancelled,
    which aborts its requests); wrap the result as JSON or an SSE stream."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done():  # the client left: wait for the cancellation to run
        await asyncio.wait({task})
        return Response(status_code=499)  # nobody reads it
    result = task.result()
    if isinstance(result, BaseModel):
        return Response(result.model_dump_json(), media_type="application/json")
    return _SSEResponse(result, media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache"})


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _SSEResponse(StreamingResponse):
    """A stream that always closes its generator, so the requests behind it are
    aborted when the client disconnects (not when it is garbage-collected)."""

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
