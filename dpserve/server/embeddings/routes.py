"""The /v1/embeddings route (OpenAI's embeddings API), thin over `EmbeddingServing`.

`POST /v1/embeddings`: the body parsed strictly (`EmbeddingRequest`), the serving call
cancelled (its engine requests aborted) when the client leaves, the answer as JSON;
503 while the server drains, `X-data-parallel-rank: k` pins the inputs to engine k,
errors in OpenAI's shape (the app's one handler), as on every /v1 route.

Not here: the serving logic (server/embeddings/serving.py).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response

from dpserve.frontend.async_llm import AsyncLLM
from dpserve.server.caller import caller_of
from dpserve.server.embeddings.protocol import EmbeddingRequest
from dpserve.server.embeddings.serving import EmbeddingServing
from dpserve.server.openai.routes import drain_check, parse_body, respond
from dpserve.server.openai.serving import OpenAIServing


def install_embeddings_api(app: FastAPI, async_llm: AsyncLLM, serving: OpenAIServing) -> None:
    """Mount /v1/embeddings over `serving`; its `EmbeddingServing` is `app.state.embeddings`
    (the batch runner's entry: `create_embedding(body)`)."""
    app.state.embeddings = EmbeddingServing(serving)
    app.include_router(embeddings_router(async_llm, app.state.embeddings))


def embeddings_router(async_llm: AsyncLLM, embeddings: EmbeddingServing) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(drain_check(async_llm))])

    @router.post("/embeddings")
    async def create_embedding(request: Request) -> Response:
        body = await parse_body(request, EmbeddingRequest)
        return await respond(request, embeddings.create_embedding(
            body, caller_of(request)))

    return router
