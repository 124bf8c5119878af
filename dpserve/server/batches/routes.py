"""OpenAI's Batch API: /v1/batches (create, retrieve, list, cancel), and
`install_batches`, which puts /v1/files, /v1/batches and the batch runner on an app.

A batch is a JSONL file uploaded to /v1/files (purpose "batch") of
/v1/chat/completions, /v1/completions or /v1/embeddings requests
(`dpserve.server.batches.format`). Create answers at once (status "validating");
the API servers' `BatchRunner`s run it in the background at the lowest priority
through the same serving functions as the HTTP routes (`serving_handlers`), and a
retrieve on any API server shows its status and `request_counts`; once completed,
`output_file_id` / `error_file_id` name its result files. Cancel marks it
"cancelling": its runner aborts the lines in flight and ends it "cancelled" with
the results so far. Batches live in the server's state directory and resume after
a restart on the same `--state-dir`.

Errors are OpenAI's shape: an unknown id 404 (a batch's, or its `input_file_id`),
a bad field 400 naming it, a cancel of a finished batch 409.

Not here: running batches (`dpserve.server.batches.runner`), the SQL
(`dpserve.server.batches.store`), files (`dpserve.server.batches.files_routes`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Protocol

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from dpserve.frontend.async_llm import AsyncLLM
from dpserve.server.batches.file_store import FileStore
from dpserve.server.batches.files_routes import (
    MULTIPART_SLACK,
    files_router,
    json_response,
    list_limit,
    list_page,
    not_found,
)
from dpserve.server.batches.format import CHAT, COMPLETIONS, EMBEDDINGS, ENDPOINTS
from dpserve.server.batches.options import BatchOptions
from dpserve.server.batches.runner import BatchHandler, BatchRunner
from dpserve.server.batches.state_db import StateDB
from dpserve.server.batches.store import UNFINISHED, BatchStore, init_batch_state
from dpserve.server.caller import ANONYMOUS, Caller, key_caller
from dpserve.server.errors import APIError
from dpserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from dpserve.server.openai.routes import drain_check, parse_body
from dpserve.server.openai.serving import OpenAIServing

COMPLETION_WINDOW_S = 24 * 3600
MAX_METADATA = (16, 64, 512)  # pairs, key length, value length (OpenAI's)
MAX_LIST_LIMIT = 100
STOP_WAIT_S = 5.0  # the app's shutdown waits this long for the runner to stop


class BatchCreate(BaseModel):
    """The body of POST /v1/batches."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None  # accepted; files do not expire


class BatchesServing:
    """The batch routes' logic over the shared stores (module docstring)."""

    def __init__(self, store: BatchStore, files: FileStore) -> None:
        self.store = store
        self.files = files

    async def create(self, req: BatchCreate, api_key_id: str | None) -> dict[str, Any]:
        if req.endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got "
                           f"{req.endpoint!r}", param="endpoint")
        if req.completion_window != "24h":
            raise APIError(400, f"completion_window must be '24h', got "
                           f"{req.completion_window!r}", param="completion_window")
        _check_metadata(req.metadata)
        found = await self.files.get(req.input_file_id)
        if found is None:
            raise not_found(req.input_file_id, "input_file_id")
        if found["purpose"] != "batch":
            raise APIError(400, f"input_file_id {req.input_file_id!r} has purpose "
                           f"{found['purpose']!r}, not 'batch'", param="input_file_id")
        now = int(time.time())
        batch = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch",
                 "endpoint": req.endpoint, "errors": None, "input_file_id": req.input_file_id,
                 "completion_window": "24h", "status": "validating", "output_file_id": None,
                 "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + COMPLETION_WINDOW_S, "finalizing_at": None,
                 "completed_at": None, "failed_at": None, "expired_at": None,
                 "cancelling_at": None, "cancelled_at": None, "metadata": req.metadata}
        if not await self.store.create(batch, api_key_id):
            raise not_found(req.input_file_id, "input_file_id")
        created = await self.store.get(batch["id"])
        assert created is not None
        return created

    async def retrieve(self, batch_id: str) -> dict[str, Any]:
        batch = await self.store.get(batch_id)
        if batch is None:
            raise _not_found(batch_id)
        return batch

    async def list(self, limit: int, after: str | None) -> dict[str, Any]:
        page = await self.store.list(limit, after)
        if page is None:
            raise APIError(400, f"after: no batch {after!r}", param="after")
        return list_page(*page)

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        batch = await self.store.request_cancel(batch_id)
        if batch is None:
            raise _not_found(batch_id)
        if batch["status"] not in UNFINISHED:
            raise APIError(409, f"Cannot cancel a batch with status '{batch['status']}'.",
                           param="batch_id", code="batch_not_cancellable")
        return batch


def batches_router(async_llm: AsyncLLM, batches: BatchesServing,
                   lifespan: Any = None) -> APIRouter:
    """The /v1/batches routes (thin: parse, call `batches`, answer); `lifespan`: the
    app's while they are served (the runner's)."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(drain_check(async_llm))],
                   lifespan=lifespan)

    @v1.post("/batches")
    async def create(request: Request) -> Response:
        body = await parse_body(request, BatchCreate)
        return json_response(await batches.create(body, request.state.api_key_id))

    @v1.get("/batches")
    async def list_batches(request: Request) -> Response:
        return json_response(await batches.list(list_limit(request, 20, MAX_LIST_LIMIT),
                                                request.query_params.get("after")))

    @v1.get("/batches/{batch_id}")
    async def retrieve(batch_id: str) -> Response:
        return json_response(await batches.retrieve(batch_id))

    @v1.post("/batches/{batch_id}/cancel")
    async def cancel(batch_id: str) -> Response:
        return json_response(await batches.cancel(batch_id))

    return v1


def serving_handlers(serving: OpenAIServing) -> dict[str, BatchHandler]:
    """Each batch endpoint's serving function: the HTTP route's, called with the
    line's body parsed as the route parses it."""
    async def chat(body: bytes, api_key_id: str | None) -> BaseModel:
        req = ChatCompletionRequest.model_validate_json(body, strict=True)
        answer = await serving.create_chat_completion(req, key_caller(api_key_id))
        assert isinstance(answer, BaseModel)  # a batch line never streams
        return answer

    async def completions(body: bytes, api_key_id: str | None) -> BaseModel:
        req = CompletionRequest.model_validate_json(body, strict=True)
        answer = await serving.create_completion(req, key_caller(api_key_id))
        assert isinstance(answer, BaseModel)
        return answer

    return {CHAT: chat, COMPLETIONS: completions}


class Embeddings(Protocol):
    """What a batch's /v1/embeddings lines run through: the route's serving object."""

    async def create_embedding(self, body: Any, caller: Caller = ANONYMOUS) -> BaseModel: ...


def embeddings_handler(embeddings: Embeddings) -> dict[str, BatchHandler]:
    """The /v1/embeddings entry of `install_batches`' `handlers` (for the server's
    embeddings serving object)."""
    async def embed(body: bytes, api_key_id: str | None) -> BaseModel:
        return await embeddings.create_embedding(json.loads(body), key_caller(api_key_id))

    return {EMBEDDINGS: embed}


def install_batches(app: FastAPI, async_llm: AsyncLLM, serving: OpenAIServing,
                    options: BatchOptions | None, api_server_index: int = 0,
                    handlers: Mapping[str, BatchHandler] | None = None
                    ) -> dict[str, tuple[int, str]]:
    """Mount /v1/files and /v1/batches over the state directory `options.state_dir`
    (opened now: a broken one fails the start) and run this API server's
    `BatchRunner` while the app runs (its lifespan); nothing without a state
    directory. `handlers`: more endpoints (url -> serving function) than chat and
    completions (default: /v1/embeddings when the app serves it, `embeddings_handler`;
    a line whose url has none is answered with an error line). Returns the upload
    route's body cap, for `BodyLimit` (path -> (bytes, flag))."""
    if options is None or options.state_dir is None:
        return {}
    init_batch_state(options.state_dir, sweep=False)  # the launcher's did (and swept)
    db = StateDB(options.state_dir)
    db.connect()
    files = FileStore(db)
    store = BatchStore(db, files)
    if handlers is None and hasattr(app.state, "embeddings"):  # install_embeddings_api ran
        handlers = embeddings_handler(app.state.embeddings)
    runner = BatchRunner(
        store, {**serving_handlers(serving), **(handlers or {})}, async_llm.cluster,
        stopping=lambda: async_llm.draining or async_llm.is_dead,
        runner_id=f"api-server-{api_server_index}/{os.getpid()}/{uuid.uuid4().hex[:8]}",
        concurrency=options.max_batch_concurrency,
        max_num_seqs=async_llm.config.scheduler.max_num_seqs)

    @asynccontextmanager
    async def running(_: Any) -> AsyncIterator[None]:
        task = asyncio.create_task(runner.run())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.wait({task}, timeout=STOP_WAIT_S)

    app.include_router(files_router(async_llm, files, options.max_batch_file_bytes))
    app.include_router(batches_router(async_llm, BatchesServing(store, files), running))
    return {"/v1/files": (options.max_batch_file_bytes + MULTIPART_SLACK,
                          "--max-batch-file-bytes")}


def _check_metadata(metadata: dict[str, str] | None) -> None:
    pairs, key_len, value_len = MAX_METADATA
    if metadata is None:
        return
    if len(metadata) > pairs:
        raise APIError(400, f"metadata may hold at most {pairs} pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > key_len or len(value) > value_len:
            raise APIError(400, f"metadata keys are at most {key_len} characters and values "
                           f"at most {value_len}", param=f"metadata.{key[:key_len]}")


def _not_found(batch_id: str) -> APIError:
    return APIError(404, f"No batch found with id '{batch_id}'.", param="batch_id",
                    code="batch_not_found")
