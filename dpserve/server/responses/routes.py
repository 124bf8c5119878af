"""OpenAI's Responses API: /v1/responses (create, retrieve, delete, cancel, input_items).

A request runs as a chat completion through `OpenAIServing` (the same validation,
limits, tools, structured output, admission and engine streams as
/v1/chat/completions; `responses.protocol` translates both ways, `responses.stream`
writes the stream's typed events). Stored responses (`store`, default true) live in
the server's one `ResponseStore` (a SQLite file every API server shares), so a
`previous_response_id`, a retrieve or a cancel works on whichever API server it
lands, and after an API server restarts. A follow-up goes to the rank its chain's
last response ran on (kept in its row) while that rank may take it: its prefix is
there (`dpserve.server.sessions`).

Lifecycle of a stored response: its row is written `in_progress` before it runs (a
stream: once the chat request has passed validation), and its final object when it
ends; a foreground one whose request fails or whose client leaves before the end is
deleted again (it never answered). Cancel (`POST /v1/responses/{id}/cancel`, on any
API server) marks the row; the API server running it polls the store for marks every
`CANCEL_POLL_S` while it runs stored responses, then stops it (the engine request is
aborted) and it ends `cancelled`. `background: true` answers at once (`in_progress`)
and runs on; poll with a retrieve. A finished response cannot be cancelled (400), a cancelled one
answers as it is.

Errors are OpenAI's shape: an unknown id 404, a bad item 400 naming it
(`input[2].type`), a response over the store's per-response limit 413.

Not here: the chat path itself (`dpserve.server.openai.serving`), the SQL
(`dpserve.server.responses.store`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import sqlite3
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import RootModel, ValidationError

from dpserve.frontend.async_llm import AsyncLLM
from dpserve.frontend.errors import RequestError
from dpserve.protocol import Session
from dpserve.server.caller import ANONYMOUS, Caller, caller_of
from dpserve.server.errors import APIError, to_api_error
from dpserve.server.openai.protocol import ChatCompletionRequest, ChatCompletionResponse
from dpserve.server.openai.routes import drain_check, parse_body, respond
from dpserve.server.openai.serving import OpenAIServing
from dpserve.server.responses.protocol import (
    ResponsesRequest,
    chat_body,
    input_items,
    new_id,
    new_response,
    output_from_chat,
    status_of,
    usage,
    with_output,
)
from dpserve.server.responses.store import ResponseStore, StoredResponse, TooLarge
from dpserve.server.responses.stream import ResponseEvents
from dpserve.server.sessions import responses_chain_session, user_session

logger = logging.getLogger(__name__)

CANCEL_POLL_S = 0.5  # how often an API server running stored responses reads cancel marks
MAX_LIST_LIMIT = 100  # input_items' `limit`
# Chat field -> the Responses field a client named (errors from the chat path).
_PARAMS = {"messages": "input", "prompt": "input", "max_completion_tokens":
           "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text.format"}
JSONObject = RootModel[dict[str, Any]]


class ResponsesServing:
    """The Responses API over `serving` and `store` (module docstring)."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store
        self._running: dict[str, asyncio.Event] = {}  # stored id -> its cancel mark
        self._tasks: set[asyncio.Task[None]] = set()  # background runs
        self._poller: asyncio.Task[None] | None = None

    # ---- create --------------------------------------------------------------------

    async def create(self, req: ResponsesRequest, caller: Caller = ANONYMOUS,
                     ) -> JSONObject | AsyncIterator[str]:
        """`caller`: as in `OpenAIServing.create_completion`; its session is the
        X-Session-ID header's (None: the chain's or `user`'s, `_session`)."""
        model = self.serving.check_model(req.model) or self.serving.model_name
        if req.background and not req.store:
            raise RequestError("background responses must be stored (store: true)",
                               param="background")
        if req.background and req.stream:
            raise RequestError("streaming a background response is not supported",
                               param="stream")
        items = input_items(req.input)
        chain = await self._chain(req.previous_response_id)
        history = [item for r in chain for item in (*r.input_items, *r.response["output"])]
        chat = _renamed(lambda: chat_body(req, [*history, *items]))
        skeleton = new_response(req, new_id("resp"), model, "in_progress")
        session = _session(caller.session, chain, skeleton["id"], req.user)
        caller = dataclasses.replace(caller, session=session)
        if req.store:
            _checked_size(self.store, skeleton, items)
        if req.stream:
            return await self._stream(req, chat, skeleton, items, caller, session)
        if req.store:
            await self.store.put(skeleton, items, req.previous_response_id)
        cancelled = self._watch(skeleton["id"]) if req.store else asyncio.Event()
        run = self._run(chat, skeleton, cancelled, caller)
        if req.background:
            task = asyncio.create_task(self._background(run, skeleton, session))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return JSONObject(skeleton)
        try:
            response = await run
        except BaseException:
            if req.store:
                await asyncio.shield(self.store.delete(skeleton["id"]))
            raise
        finally:
            self._running.pop(skeleton["id"], None)
        if req.store:
            await self._finish(response, session)
        return JSONObject(response)

    async def _chain(self, previous_id: str | None) -> list[StoredResponse]:
        """The stored chain ending at `previous_id`, oldest first (none: [])."""
        if previous_id is None:
            return []
        chain = await self.store.conversation(previous_id)
        if chain is None:
            raise APIError(404, f"Previous response with id '{previous_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        return chain

    async def _run(self, chat: ChatCompletionRequest, skeleton: dict[str, Any],
                   cancelled: asyncio.Event, caller: Caller) -> dict[str, Any]:
        """Run the chat request unless `cancelled` is set first: the final response."""
        work = asyncio.ensure_future(_renamed_async(self.serving.create_chat_completion(
            chat, caller)))
        mark = asyncio.ensure_future(cancelled.wait())
        try:
            await asyncio.wait({work, mark}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            mark.cancel()
            if not work.done():
                work.cancel()  # aborts the engine request
                await asyncio.wait({work})
        if work.cancelled():
            return with_output(skeleton, [], "cancelled")
        result = work.result()
        assert isinstance(result, ChatCompletionResponse)
        choice = result.choices[0]
        status, details = status_of(choice.finish_reason)
        return with_output(skeleton, output_from_chat(choice.message), status,
                           incomplete_details=details, usage=usage(result.usage))

    async def _background(self, run: Any, skeleton: dict[str, Any], session: Session
                          ) -> None:
        try:
            response = await run
        except Exception as e:  # noqa: BLE001 - a background failure is its status
            error = to_api_error(e)
            response = with_output(skeleton, [], "failed", error={
                "code": error.code or error.type, "message": error.message})
        finally:
            self._running.pop(skeleton["id"], None)
        await self._finish(response, session)

    async def _stream(self, req: ResponsesRequest, chat: ChatCompletionRequest,
                      skeleton: dict[str, Any], items: list[dict[str, Any]],
                      caller: Caller, session: Session) -> AsyncIterator[str]:
        lines = await _renamed_async(self.serving.create_chat_completion(chat, caller))
        assert not isinstance(lines, ChatCompletionResponse)
        events = ResponseEvents(skeleton, functools.partial(self._finish, session=session)
                                if req.store else _nothing)

        async def run() -> AsyncIterator[str]:
            # Stored (and watched for cancel marks) once streaming starts: a stream that
            # never starts leaves nothing behind.
            if req.store:
                await self.store.put(skeleton, items, req.previous_response_id)
                events.cancelled = self._watch(skeleton["id"])
            try:
                async for event in events.run(lines):  # type: ignore[arg-type]
                    yield event
            finally:
                self._running.pop(skeleton["id"], None)
                if req.store and not events.finished:  # the client left mid-stream
                    await asyncio.shield(self.store.delete(skeleton["id"]))

        return run()

    async def _finish(self, response: dict[str, Any], session: Session) -> None:
        """The final write of a stored response (not over a cancel mark), with the rank
        its session went to (where a follow-up finds its prefix)."""
        rank = self.serving.llm.cluster.session_rank(session.key)
        try:
            try:
                await self.store.finish(response, rank)
            except TooLarge as e:  # stored as failed, saying why
                await self.store.finish(with_output(response, [], "failed", error={
                    "code": "response_too_large", "message": str(e)}), rank)
        except sqlite3.Error as e:
            logger.warning("response %s was not stored: %s", response["id"], e)

    # ---- cancel marks ----------------------------------------------------------------

    def _watch(self, response_id: str) -> asyncio.Event:
        """The cancel mark of a stored response this API server runs (polled)."""
        event = self._running[response_id] = asyncio.Event()
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll_cancels())
        return event

    async def _poll_cancels(self) -> None:
        while self._running:
            await asyncio.sleep(CANCEL_POLL_S)
            try:
                marked = await self.store.cancelled(list(self._running))
            except sqlite3.Error as e:
                logger.warning("cannot read cancel marks: %s", e)
                continue
            for response_id in marked:
                if response_id in self._running:
                    self._running[response_id].set()

    # ---- stored responses ------------------------------------------------------------

    async def retrieve(self, response_id: str) -> JSONObject:
        row = await self.store.get(response_id)
        if row is None:
            raise _not_found(response_id)
        return JSONObject(row.response)

    async def delete(self, response_id: str) -> JSONObject:
        if not await self.store.delete(response_id):
            raise _not_found(response_id)
        return JSONObject({"id": response_id, "object": "response", "deleted": True})

    async def cancel(self, response_id: str) -> JSONObject:
        row = await self.store.request_cancel(response_id)
        if row is None:
            raise _not_found(response_id)
        status = row.response["status"]
        if status != "cancelled":
            raise APIError(400, f"Cannot cancel a response with status '{status}': only a "
                           f"queued or in-progress response can be cancelled.",
                           param="response_id")
        if response_id in self._running:  # ours: at once, not at the next poll
            self._running[response_id].set()
        return JSONObject(row.response)

    async def input_items(self, response_id: str, request: Request) -> JSONObject:
        row = await self.store.get(response_id)
        if row is None:
            raise _not_found(response_id)
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
        limit = query.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= MAX_LIST_LIMIT:
            raise APIError(400, f"limit must be in [1, {MAX_LIST_LIMIT}], got {limit!r}",
                           param="limit")
        items = row.input_items if order == "asc" else row.input_items[::-1]
        after = query.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(400, f"after: no input item {after!r} in this response",
                               param="after")
            items = items[ids.index(after) + 1:]
        page = items[:int(limit)]
        return JSONObject({"object": "list", "data": page, "has_more": len(items) > len(page),
                           "first_id": page[0]["id"] if page else None,
                           "last_id": page[-1]["id"] if page else None})


def responses_router(async_llm: AsyncLLM, responses: ResponsesServing) -> APIRouter:
    """The /v1/responses routes (thin: parse, call `responses`, answer)."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(drain_check(async_llm))])

    @v1.post("/responses")
    async def create(request: Request) -> Response:
        body = await parse_body(request, ResponsesRequest)
        return await respond(request, responses.create(body, caller_of(request)))

    @v1.get("/responses/{response_id}")
    async def retrieve(response_id: str) -> Response:
        return _json(await responses.retrieve(response_id))

    @v1.delete("/responses/{response_id}")
    async def delete(response_id: str) -> Response:
        return _json(await responses.delete(response_id))

    @v1.post("/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> Response:
        return _json(await responses.cancel(response_id))

    @v1.get("/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request) -> Response:
        return _json(await responses.input_items(response_id, request))

    return v1


def _json(body: JSONObject) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                    code="response_not_found")


def _session(header: Session | None, chain: list[StoredResponse], own_id: str,
             user: str | None) -> Session:
    """The session a response continues (`dpserve.server.sessions`): the header's, else
    its chain's (`previous_response_id`), else `user`'s, else the chain it starts; with
    the rank the chain's last response ran on, when known."""
    rank = chain[-1].rank if chain else None
    if header is not None:
        return msgspec.structs.replace(header, rank=rank)
    if chain:
        return responses_chain_session(chain[0].response["id"], rank)
    return user_session(user) or responses_chain_session(own_id, None)


def _checked_size(store: ResponseStore, skeleton: dict[str, Any],
                  items: list[dict[str, Any]]) -> None:
    try:
        store.check_size(skeleton, items)
    except TooLarge as e:
        raise APIError(413, str(e), param="input", code="response_too_large") from None


def _renamed(build: Any) -> Any:
    """`build()`, its errors naming the Responses fields (module `_PARAMS`)."""
    try:
        return build()
    except (APIError, ValidationError, ValueError) as e:
        raise _rename(e) from None


async def _renamed_async(work: Any) -> Any:
    try:
        return await work
    except (APIError, ValidationError, ValueError) as e:
        raise _rename(e) from None


def _rename(e: Exception) -> APIError:
    error = to_api_error(e)
    error.param = _PARAMS.get(error.param or "", error.param)
    return error


async def _nothing(response: dict[str, Any]) -> None:
    return None
