"""Operator routes for pause / sleep (admin API).

Routes (`control_router`; mounted only with `--enable-admin-api`, behind the
API key like every route; POSTs take only `Content-Type: application/json`),
vLLM's names, acting on every rank at once:

    POST /pause?mode=abort|wait|keep   abort (default): requests in flight end now
                                       (finish_reason "abort"); wait: answers once
                                       they finished; keep: they freeze, keeping
                                       their KV, and go on after /resume
    POST /resume                       GET /is_paused   -> {"is_paused": bool}
    POST /sleep?level=1|2              requests in flight end (abort) first; 1 frees
                                       the KV cache, 2 the weights too
    POST /wake_up                      GET /is_sleeping -> {"is_sleeping": bool}
    POST /reset_prefix_cache

A change answers 200 with the state once every serving rank reached it
(`?timeout=` s, default 600, at most 3600: else 504, the state stays). With
the in-process engine (no engine process) a change is a 400.

Not here: the engine side and the fan-out (`dpserve.frontend.control`, through
`ClusterView.change_control`); refusing new requests while paused or asleep
(`dpserve.server.admission`).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from dpserve.control import PAUSE_MODES
from dpserve.frontend.cluster import ClusterView
from dpserve.protocol import ControlState
from dpserve.server.bodies import query_seconds
from dpserve.server.errors import APIError

DEFAULT_TIMEOUT_S = 600.0  # a change without ?timeout=


def control_router(cluster: ClusterView) -> APIRouter:
    """The pause / sleep routes over the engines' `ClusterView`."""
    router = APIRouter()

    async def change(request: Request, op: str, arg: str | int | None = None) -> dict:
        timeout = query_seconds(request, "timeout", DEFAULT_TIMEOUT_S)
        try:
            state = await cluster.change_control(op, arg, timeout=timeout)
        except TimeoutError as e:
            raise APIError(504, str(e), type="server_error", code="control_timeout") from None
        return {"status": "ok", **_flags(state)}

    @router.post("/pause")
    async def pause(request: Request) -> dict:
        mode = request.query_params.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise APIError(400, f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}",
                           param="mode")
        return await change(request, "pause", mode)

    @router.post("/resume")
    async def resume(request: Request) -> dict:
        return await change(request, "resume")

    @router.get("/is_paused")
    async def is_paused() -> dict:
        return {"is_paused": cluster.control.paused is not None}

    @router.post("/sleep")
    async def sleep(request: Request) -> dict:
        level = request.query_params.get("level", "1")
        if level not in ("1", "2"):
            raise APIError(400, f"level must be 1 or 2, got {level!r}", param="level")
        return await change(request, "sleep", int(level))

    @router.post("/wake_up")
    async def wake_up(request: Request) -> dict:
        return await change(request, "wake_up")

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict:
        return {"is_sleeping": cluster.control.sleep_level > 0}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> dict:
        return await change(request, "reset_prefix_cache")

    return router


def _flags(state: ControlState) -> dict:
    return {"is_paused": state.paused is not None, "pause_mode": state.paused,
            "is_sleeping": state.sleep_level > 0, "sleep_level": state.sleep_level}
