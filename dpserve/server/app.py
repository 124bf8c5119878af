"""The FastAPI app: thin routes over `OpenAIServing`, one error handler.

Routes: /v1/completions, /v1/chat/completions, /v1/models, /health (200; 503
once the engine is dead), /ping (the same, vLLM's name), /metrics (Prometheus),
/version, /debug/request_state (sizes of the per-request state, for leak
checks), /debug/dp_state, /engines and /dashboard (`dpserve.server.engines`);
with `enable_admin_api` the admin routes (`dpserve.server.admin`,
`dpserve.server.control`). With an API key, every route but a short allowlist
needs it (`dpserve.server.auth`: one middleware in front of all of them); every
body is capped at `max_request_body_bytes` (`dpserve.server.bodies`: 413).
FastAPI's /docs and /redoc are off (they load scripts from a CDN);
/openapi.json is behind the key like any route.
While the server drains (`AsyncLLM.draining`, set on SIGTERM), /health and
every /v1 route answer 503 with `Retry-After` and code
"server_draining"; requests already in flight go on. The
`X-data-parallel-rank: k` header pins a request
to engine k (a bad value is a 400). Every error, whatever raised it, leaves as an
OpenAI-shaped body `{"error": {"message", "type", "param", "code"}}` with a
4xx status for bad input, never a 500. A client that disconnects, streaming
or not, has its request aborted in the engine.

With `enable_admin_api`, the operator routes of `server/control.py` (pause,
resume, sleep, wake_up, reset_prefix_cache, is_paused, is_sleeping) are
mounted; like every admin route their POSTs take only `Content-Type:
application/json` (415). Its `Admission` check answers 503 while paused or
asleep and 429 when every engine's queue is full.

Not here: starting uvicorn or the engine (`dpserve serve` does that).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from dpserve import __version__
from dpserve.frontend.async_llm import AsyncLLM
from dpserve.frontend.errors import EngineDeadError
from dpserve.server.admin import admin_router
from dpserve.server.auth import API_KEY_ENV, AuthMiddleware, AuthOptions
from dpserve.server.bodies import BodyLimit, require_json
from dpserve.server.control import Admission, control_router
from dpserve.server.engines import engines_router
from dpserve.server.extras import HTTPOptions, install_extras
from dpserve.server.limits import RequestLimits
from dpserve.server.metrics import CONTENT_TYPE, ServerMetrics
from dpserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from dpserve.server.scale import add_scale_route
from dpserve.server.serving import OpenAIServing, to_api_error

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20
DP_RANK_HEADER = "X-data-parallel-rank"
DRAIN_RETRY_AFTER_S = 5  # the Retry-After of a 503 while draining
_M = TypeVar("_M", bound=BaseModel)


def build_app(async_llm: AsyncLLM, served_model_name: str, api_key: str | None = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              api_server_index: int = 0, enable_admin_api: bool = False,
              max_num_queued: tuple[int | None, int | None] = (None, None),
              tool_call_parser: str | None = None,
              http_options: HTTPOptions | None = None,
              log_requests: bool = False, auth: AuthOptions | None = None,
              request_limits: RequestLimits | None = None) -> FastAPI:
    """An OpenAI-compatible app over `async_llm`.

    The app does not own `async_llm`: whoever built it shuts it down.
    `api_server_index` labels this API server's series in /metrics.
    `auth`: the accepted API keys and `--metrics-auth` (`dpserve.server.auth`);
    without it, `api_key` (default $DPSERVE_API_KEY) is the one key, if any.
    `enable_admin_api`: mount the admin routers (`dpserve.server.admin`,
    `dpserve.server.control`); without it they do not exist (404). The refusal of
    an admin API without a key is the command line's (`check_admin_exposure`).
    `max_num_queued`: (requests, prompt tokens) waiting per engine before a 429.
    `tool_call_parser`: parse tool calls for tool_choice "auto".
    `http_options`: CORS, model aliases, chat template (server/extras.py).
    `log_requests`: a log line per request arrival and finish (server/log_options.py).
    `request_limits`: the "request limits" options (server/limits.py).
    """
    if auth is None:
        auth = AuthOptions.from_key(api_key or os.environ.get(API_KEY_ENV))
    serving = OpenAIServing(async_llm, served_model_name, tool_call_parser, request_limits)
    http_options = http_options or HTTPOptions()
    serving.model_aliases = http_options.model_aliases
    serving.log_requests = log_requests
    if http_options.chat_template:
        async_llm.tokenizer.chat_template = http_options.chat_template
    names = (served_model_name, *http_options.model_aliases)
    metrics = ServerMetrics(served_model_name, api_server_index=api_server_index)
    async_llm.add_stats_listener(metrics)
    # Moves show in every engine message's wake: count them in this API server then.
    async_llm.add_stats_listener(_MovedListener(metrics, async_llm))
    app = FastAPI(title="dpserve", version=__version__, docs_url=None, redoc_url=None)
    app.state.serving, app.state.metrics = serving, metrics
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_drain_check(async_llm))])

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        return await _respond(request, serving.create_completion(
            body, _dp_rank(request), api_key_id=request.state.api_key_id))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest)
        return await _respond(request, serving.create_chat_completion(
            body, _dp_rank(request), api_key_id=request.state.api_key_id))

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, root=async_llm.config.model.path,
                         max_model_len=async_llm.max_model_len)

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[card(name) for name in names])

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        serving.check_model(model_id)
        return card(model_id)

    @app.get("/health")
    @app.get("/ping")
    @app.post("/ping")
    async def health(request: Request) -> Response:
        """200 while at least one rank serves (`?rank=R`: while rank R serves), else 503;
        the body lists every rank's state."""
        if async_llm.is_dead:
            raise EngineDeadError("the engine is dead")
        if async_llm.draining:
            raise _draining_error()
        ranks = _rank_states(async_llm)
        rank = request.query_params.get("rank")
        if rank is not None:
            if not rank.isdigit() or int(rank) not in {r["rank"] for r in ranks}:
                raise APIError(400, f"rank must be one of this server's ranks "
                               f"{[r['rank'] for r in ranks]}, got {rank!r}", param="rank")
            ranks = [r for r in ranks if r["rank"] == int(rank)]
        ok = any(r["state"] == "serving" for r in ranks)
        size = getattr(async_llm.client, "data_parallel_size", len(ranks))
        return JSONResponse({"status": "ok" if ok else "unavailable", "ranks": ranks,
                             "data_parallel_size": size}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        # The DP wave, as this API server last heard it from the coordinator.
        client = async_llm.client
        metrics.set_wave(getattr(client, "current_wave", 0))
        metrics.set_ranks({r["rank"]: (r["state"], r["incarnation"])
                           for r in _rank_states(async_llm)})
        metrics.record_moved(_moved(client))
        metrics.set_elastic(getattr(client, "data_parallel_size", 1),
                            getattr(client, "autoscale_decisions", None))
        return Response(metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    @app.get("/debug/request_state")
    async def request_state() -> dict[str, Any]:
        """Entries of every per-request structure, in this API server and in each live
        engine: all 0 (and every KV block free or cached) when nothing is in flight."""
        client = async_llm.client
        if hasattr(client, "call_utility_all"):
            engines = await client.call_utility_all("request_state_sizes", timeout=10)
        else:
            engines = {0: await client.call_utility("request_state_sizes")}
        return {"api_server": async_llm.request_state_sizes(),
                "engines": {str(rank): sizes for rank, sizes in engines.items()}}

    @app.get("/debug/dp_state")
    async def dp_state() -> dict[str, Any]:
        """Each live engine's DP state (lockstep, wave, dummy batches, all-reduces) and
        the routed experts it holds (MoE; None for a dense model or one engine)."""
        client = async_llm.client
        if not hasattr(client, "call_utility_all"):
            return {"engines": {"0": {"dp": None,
                                      "experts": await client.call_utility("expert_info")}}}
        dp = await client.call_utility_all("get_dp_state", timeout=10)
        experts = await client.call_utility_all("expert_info", timeout=10)
        return {"engines": {str(rank): {"dp": dp[rank], "experts": experts.get(rank)}
                            for rank in dp}}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    app.include_router(v1)
    # Middleware, innermost first: body cap, API key, then (extras) counts and CORS.
    app.add_middleware(BodyLimit, limit=max_request_body_bytes)
    app.add_middleware(AuthMiddleware, options=auth)
    install_extras(app, async_llm, serving, metrics.registry, http_options)
    app.include_router(engines_router(async_llm, admin=enable_admin_api))
    if hasattr(async_llm.client, "control"):  # pause / sleep / queue limits (control.py)
        async_llm.admission = Admission(
            async_llm.client, *max_num_queued, async_llm.config.scheduler.max_num_seqs)
    if enable_admin_api:
        admin = [Depends(require_json)]
        app.include_router(admin_router(async_llm, admin))
        add_scale_route(app, async_llm, admin)
        if hasattr(async_llm.client, "control"):
            app.include_router(control_router(async_llm.client), dependencies=admin)
    for exc_type in (APIError, ValidationError, RequestValidationError, ValueError,
                     EngineDeadError, StarletteHTTPException, Exception):
        app.add_exception_handler(exc_type, _error_response)
    return app


async def _error_response(request: Request, exc: Exception) -> JSONResponse:
    """The one error handler: every exception -> OpenAI error body."""
    error = to_api_error(exc)
    body = ErrorResponse(error=ErrorInfo(message=error.message, type=error.type,
                                         param=error.param, code=error.code))
    headers = {"WWW-Authenticate": "Bearer"} if error.status_code == 401 else error.headers
    return JSONResponse(body.model_dump(), status_code=error.status_code, headers=headers)


class _MovedListener:
    """After each engine message, bring the moved-request counters up to date."""

    def __init__(self, metrics: ServerMetrics, async_llm: AsyncLLM) -> None:
        self.metrics, self.async_llm = metrics, async_llm

    def record(self, engine_index: Any, scheduler_stats: Any, iteration: Any) -> None:
        self.metrics.record_moved(_moved(self.async_llm.client))


def _moved(client: Any) -> tuple[int, int, int]:
    """The engine client's totals of re-sent and migrated requests and recomputed tokens."""
    return tuple(getattr(client, name, 0)  # type: ignore[return-value]
                 for name in ("num_retries", "num_migrations", "recomputed_tokens"))


def _rank_states(async_llm: AsyncLLM) -> list[dict[str, Any]]:
    """Each rank's state as this API server knows it (one engine in-process: rank 0)."""
    engines = getattr(async_llm.client, "engines", None)
    if engines is None:
        return [{"rank": 0, "state": "serving", "incarnation": 0, "reason": ""}]
    return [{"rank": e.rank, "state": e.status.state.value,
             "incarnation": e.status.incarnation, "reason": e.status.reason}
            for e in engines.values()]


def _drain_check(async_llm: AsyncLLM) -> Any:
    async def check() -> None:
        if async_llm.draining:
            raise _draining_error()

    return check


def _draining_error() -> APIError:
    return APIError(503, "the server is shutting down and takes no new requests; retry "
                    "later or on another replica", type="server_error", code="server_draining",
                    headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)})


def _dp_rank(request: Request) -> int | None:
    """The engine a request pins with `X-data-parallel-rank` (None: any engine)."""
    value = request.headers.get(DP_RANK_HEADER)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise APIError(400, f"{DP_RANK_HEADER} must be an integer engine rank, got "
                       f"{value!r}", param=DP_RANK_HEADER) from None


async def _parse(request: Request, model: type[_M]) -> _M:
    """Read the body (capped by `BodyLimit`: 413) and validate it strictly."""
    return model.model_validate_json(await request.body(), strict=True)


async def _respond(request: Request, work: Awaitable[Any]) -> Response:
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
