"""`POST /scale_elastic_ep`: change the number of DP engines at run time (admin route).

Body `{"new_data_parallel_size": N}` (vLLM's route and body). The API server
asks the DP coordinator (`ClusterView.request_scale`), which has the
launcher start or drain engines (`dpserve.launch.scaler`), and answers when
the change is done:

    200  {"message", "old_data_parallel_size", "new_data_parallel_size"}
    400  N is not a whole number, < 1, above --data-parallel-size-max, or this
         server cannot change its engine count (OpenAI-shaped error body)
    409  another change runs (code "scale_in_progress"), or the placement cannot
         hold N engines: the cores or CUDA devices of this host, the Ray cluster's
         resources, as they are when the request comes (code "insufficient_capacity",
         the message says what is missing; no ceiling need be declared at start)
    503  the change failed (e.g. a new engine did not start; the size is the old one)

Mounted only with `--enable-admin-api`; behind the API key like every route, and
only as `Content-Type: application/json` (415); the body is capped like every
body (`--max-request-body-bytes`, 413).

Not here: carrying the change out (`dpserve.launch`), the coordinator's one-at-a-
time rule (`dpserve.launch.coordinator.autoscale.ScaleBook`).
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dpserve.frontend.async_llm import AsyncLLM
from dpserve.protocol import ScalePhase
from dpserve.server.errors import APIError

SCALE_ROUTE = "/scale_elastic_ep"
_SIZE_FIELD = "new_data_parallel_size"
_ANSWER_MARGIN_S = 900.0  # beyond --shutdown-timeout: engines loading, stopping


def scale_router(async_llm: AsyncLLM) -> APIRouter:
    """`POST /scale_elastic_ep` (mounted under the admin dependencies)."""
    router = APIRouter()
    cluster = async_llm.cluster
    parallel = async_llm.config.parallel
    size_max = parallel.data_parallel_size_max
    timeout = async_llm.config.shutdown_timeout + _ANSWER_MARGIN_S

    @router.post(SCALE_ROUTE)
    async def scale_elastic_ep(request: Request) -> JSONResponse:
        size = _parse_size(await request.body(), size_max)
        if not parallel.elastic or not cluster.elastic:
            raise APIError(400, "this server cannot change its engine count: it was started "
                           "with --no-enable-elastic-ep, or its engines span hosts without "
                           "Ray", param=_SIZE_FIELD)
        try:
            answer = await cluster.request_scale(size, timeout)
        except TimeoutError as e:
            raise APIError(503, str(e), type="server_error", code="scale_failed") from None
        if answer.phase is ScalePhase.REJECTED:
            raise APIError(409, f"cannot scale to {size} now: {answer.message}; retry when "
                           f"it is done", type="invalid_request_error",
                           code="scale_in_progress")
        if answer.phase is ScalePhase.REFUSED:
            raise APIError(409, f"cannot scale to {size} engines: {answer.message}",
                           type="invalid_request_error", code="insufficient_capacity")
        if answer.phase is ScalePhase.FAILED:
            raise APIError(503, f"scaling to {size} engines failed: {answer.message}",
                           type="server_error", code="scale_failed")
        return JSONResponse({"message": f"Scaled to {answer.new_size} data parallel engines",
                             "old_data_parallel_size": answer.old_size,
                             "new_data_parallel_size": answer.new_size})

    return router


def _parse_size(body: bytes, size_max: int | None) -> int:
    """`new_data_parallel_size` from the body, or a 400 that says what is wrong."""
    try:
        data = json.loads(body or b"null")
    except ValueError:
        raise APIError(400, "the body must be JSON: {\"new_data_parallel_size\": N}") from None
    if not isinstance(data, dict) or _SIZE_FIELD not in data:
        raise APIError(400, "the body must be {\"new_data_parallel_size\": N}",
                       param=_SIZE_FIELD)
    unknown = sorted(set(data) - {_SIZE_FIELD})
    if unknown:
        raise APIError(400, f"unknown field {unknown[0]!r}; the body is "
                       f"{{\"new_data_parallel_size\": N}}", param=unknown[0])
    size = data[_SIZE_FIELD]
    if isinstance(size, bool) or not isinstance(size, int):
        raise APIError(400, f"{_SIZE_FIELD} must be a whole number, got {size!r}",
                       param=_SIZE_FIELD)
    if size < 1:
        raise APIError(400, f"{_SIZE_FIELD} must be at least 1, got {size}",
                       param=_SIZE_FIELD)
    if size_max is not None and size > size_max:
        raise APIError(400, f"{_SIZE_FIELD} must be in [1, {size_max}] "
                       f"(--data-parallel-size-max), got {size}", param=_SIZE_FIELD)
    return size
