"""The FastAPI app: `build_app` assembles the routers, the middleware and one error handler.

Routers, each a module of thin routes: the OpenAI API (`openai.routes`), Anthropic's
Messages API (`anthropic.routes`, errors in Anthropic's shape), the Responses API
(`responses.routes`, over the one `ResponseStore`), embeddings (`embeddings.routes`),
files and batches (`batches.files_routes`, `batches.routes`; only with a state
directory, each API server running batches in the background), the operations
routes (`ops.routes`, `ops.engines`, `openai.extras` for /tokenize), and the admin
routes (`ops.admin`, only with `enable_admin_api`; their POSTs take only JSON, 415).
Every route with its status codes: docs/reference/http.md.

Invariants:
* Everything is built from explicit arguments; nothing is set on the parts
  afterwards. The engines are known only through `AsyncLLM.cluster`.
* With an API key, every route but a short allowlist needs it (`auth`: one
  middleware in front of all); every body is capped (`bodies`: 413).
* FastAPI's /docs and /redoc are off (they load scripts from a CDN);
  /openapi.json is behind the key like any route.
* Every error, whatever raised it, leaves as an OpenAI-shaped body
  `{"error": {"message", "type", "param", "code"}}` (Anthropic's shape on
  /v1/messages) with a 4xx status for bad input, never a 500.
* A client that disconnects, streaming or not, has its request aborted in the engine.

Not here: starting uvicorn or the engine (`dpserve serve` does that).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dpserve.frontend.async_llm import AsyncLLM
from dpserve.frontend.errors import EngineDeadError
from dpserve.server.admission import Admission
from dpserve.server.anthropic.routes import install_messages_api
from dpserve.server.auth import API_KEY_ENV, AuthMiddleware, AuthOptions
from dpserve.server.batches.options import BatchOptions
from dpserve.server.batches.routes import install_batches
from dpserve.server.bodies import BodyLimit, require_json
from dpserve.server.caller import DP_RANK_HEADER
from dpserve.server.embeddings.routes import install_embeddings_api
from dpserve.server.errors import APIError, to_api_error
from dpserve.server.limits import RequestLimits
from dpserve.server.metrics.pd import install_pd_metrics
from dpserve.server.metrics.prometheus import ServerMetrics
from dpserve.server.metrics.tenants import TenantMetrics
from dpserve.server.openai.extras import HTTPOptions, install_extras
from dpserve.server.openai.protocol import ErrorInfo, ErrorResponse
from dpserve.server.openai.routes import v1_router
from dpserve.server.openai.serving import OpenAIServing
from dpserve.server.ops.admin import admin_router
from dpserve.server.ops.engines import engines_router
from dpserve.server.ops.routes import MovedListener, ops_router
from dpserve.server.responses.routes import ResponsesServing, responses_router
from dpserve.server.responses.store import ResponseStoreOptions
from dpserve.server.tenants import TenantGate, TenantOptions
from dpserve.version import __version__

__all__ = ["DEFAULT_MAX_REQUEST_BODY_BYTES", "DP_RANK_HEADER", "build_app"]

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20


def build_app(async_llm: AsyncLLM, served_model_name: str, api_key: str | None = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              api_server_index: int = 0, enable_admin_api: bool = False,
              max_num_queued: tuple[int | None, int | None] = (None, None),
              tool_call_parser: str | None = None, http_options: HTTPOptions | None = None,
              log_requests: bool = False, auth: AuthOptions | None = None,
              request_limits: RequestLimits | None = None, tenants: TenantOptions | None = None,
              response_store: ResponseStoreOptions | None = None,
              batches: BatchOptions | None = None) -> FastAPI:
    """An OpenAI-compatible app over `async_llm`.

    The app does not own `async_llm`: whoever built it shuts it down (and gave it
    the chat template: `AsyncLLM(chat_template=...)`).
    `api_server_index` labels this API server's series in /metrics.
    `auth`: the accepted API keys and `--metrics-auth` (`dpserve.server.auth`);
    without it, `api_key` (default $DPSERVE_API_KEY) is the one key, if any.
    `enable_admin_api`: mount the admin router (`dpserve.server.ops.admin`); without
    it its routes do not exist (404). The refusal of an admin API without a key
    is the command line's (`check_admin_exposure`).
    `max_num_queued`: (requests, prompt tokens) waiting per engine before a 429.
    `tool_call_parser`: parse tool calls for tool_choice "auto". `http_options`: CORS,
    model aliases (server/openai/extras.py). `log_requests`: a log line per request arrival
    and finish (server/log_options.py). `request_limits`: the "request limits" options
    (server/limits.py). `response_store`: the Responses API's store (a file every API
    server shares; none: in memory). `batches`: /v1/files and /v1/batches over its
    state directory. `tenants`: tenants and their limits (`install_tenants`).
    """
    auth = auth or AuthOptions.from_key(api_key or os.environ.get(API_KEY_ENV))
    http_options = http_options or HTTPOptions()
    serving = _openai_serving(async_llm, served_model_name, max_num_queued, tool_call_parser,
                              request_limits, http_options, log_requests)
    metrics = _server_metrics(async_llm, served_model_name, api_server_index)
    app = FastAPI(title="dpserve", version=__version__, docs_url=None, redoc_url=None)
    app.state.serving, app.state.metrics = serving, metrics
    install_tenants(app, serving, metrics, auth, tenants or TenantOptions())
    uploads = _install_apis(app, async_llm, serving, metrics, response_store, batches,
                            api_server_index)
    # Middleware, innermost first: body cap, API key, then (extras) counts and CORS.
    app.add_middleware(BodyLimit, limit=max_request_body_bytes, uploads=uploads)
    app.add_middleware(AuthMiddleware, options=auth)
    install_messages_api(app, async_llm, serving)  # Anthropic's; its error shape wraps these
    install_extras(app, async_llm, serving, metrics.registry, http_options)
    app.include_router(engines_router(async_llm, admin=enable_admin_api))
    if enable_admin_api:
        app.include_router(admin_router(async_llm, [Depends(require_json)]))
    _install_error_handler(app)
    return app


def _openai_serving(async_llm: AsyncLLM, served_model_name: str,
                    max_num_queued: tuple[int | None, int | None], tool_call_parser: str | None,
                    request_limits: RequestLimits | None, http_options: HTTPOptions,
                    log_requests: bool) -> OpenAIServing:
    """The chat and completion path every API runs through, with its admission."""
    admission = Admission(async_llm.cluster, *max_num_queued,
                          max_num_seqs=async_llm.config.scheduler.max_num_seqs)
    return OpenAIServing(async_llm, served_model_name, tool_call_parser, request_limits,
                         admission=admission, model_aliases=http_options.model_aliases,
                         log_requests=log_requests)


def _server_metrics(async_llm: AsyncLLM, served_model_name: str,
                    api_server_index: int) -> ServerMetrics:
    """This API server's series, fed by `async_llm`'s stats listeners."""
    metrics = ServerMetrics(served_model_name, api_server_index=api_server_index)
    async_llm.add_stats_listener(metrics)  # and moves, in every engine message's wake:
    async_llm.add_stats_listener(MovedListener(metrics, async_llm.cluster))
    install_pd_metrics(async_llm, metrics.registry, served_model_name)  # with roles only
    return metrics


def _install_apis(app: FastAPI, async_llm: AsyncLLM, serving: OpenAIServing,
                  metrics: ServerMetrics, response_store: ResponseStoreOptions | None,
                  batches: BatchOptions | None, api_server_index: int,
                  ) -> dict[str, tuple[int, str]]:
    """OpenAI's /v1 (the model's names: served and aliases), the Responses API,
    embeddings, the ops routes, files and batches; the upload route's body cap."""
    app.include_router(v1_router(async_llm, serving,
                                 (serving.model_name, *serving.model_aliases)))
    responses = ResponsesServing(serving, (response_store or ResponseStoreOptions()).open())
    app.include_router(responses_router(async_llm, responses))
    install_embeddings_api(app, async_llm, serving)  # app.state.embeddings: batches too
    app.include_router(ops_router(async_llm, metrics))
    return install_batches(app, async_llm, serving, batches, api_server_index)


def _install_error_handler(app: FastAPI) -> None:
    """The one error handler, for every exception a route can raise."""
    for exc_type in (APIError, ValidationError, RequestValidationError, ValueError,
                     EngineDeadError, StarletteHTTPException, Exception):
        app.add_exception_handler(exc_type, _error_response)


def install_tenants(app: FastAPI, serving: OpenAIServing, metrics: ServerMetrics,
                    auth: AuthOptions, tenants: TenantOptions) -> None:
    """The per-tenant series (labels: the keys' and the limits file's names), the
    --tenant-header the callers read, and the gate of --tenant-limits in `serving`
    over the coordinator's ledger (`tenants.ledger_address`) or one in this process,
    closed when the app shuts down."""
    tenant_metrics = TenantMetrics(metrics.registry, metrics.model_name, [
        *(key.id for key in auth.keys), *(tenants.limits.names if tenants.limits else ())],
        metrics.api_server_index)
    serving.llm.add_stats_listener(tenant_metrics)
    app.state.tenant_header = tenants.header
    if tenants.limits is not None:
        serving.tenants = TenantGate(tenants.limits, tenants.ledger(), tenant_metrics.rejected)
        gate = serving.tenants

        @asynccontextmanager
        async def closing(_: Any) -> AsyncIterator[None]:
            try:
                yield
            finally:
                gate.close()

        app.include_router(APIRouter(lifespan=closing))


async def _error_response(request: Request, exc: Exception) -> JSONResponse:
    """The one error handler: every exception -> OpenAI error body."""
    error = to_api_error(exc)
    body = ErrorResponse(error=ErrorInfo(message=error.message, type=error.type,
                                         param=error.param, code=error.code))
    headers = {"WWW-Authenticate": "Bearer"} if error.status_code == 401 else error.headers
    return JSONResponse(body.model_dump(), status_code=error.status_code, headers=headers)
