"""Operator routes for pause / sleep, and the admission check of new requests.

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
(`?timeout=` s, default 600, at most 3600: else 504, the state stays). `Admission` is the
check `OpenAIServing` runs before a request is sent: 503 while paused or
asleep (code "server_paused" / "server_sleeping", Retry-After), 429 when
every serving rank's queue is at `--max-num-queued-requests` or
`--max-num-queued-tokens` (code "too_many_requests", Retry-After). Nothing is
sent to an engine then, so no DP wave starts.

Not here: the engine side and the fan-out (`dpserve.frontend.control`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from dpserve.control import PAUSE_MODES
from dpserve.frontend.control import change_control
from dpserve.protocol import ControlState
from dpserve.server.bodies import query_seconds
from dpserve.server.protocol import APIError

RETRY_AFTER_S = 1  # the Retry-After of a 503 (paused, asleep) or a 429 (queues full)
DEFAULT_TIMEOUT_S = 600.0  # a change without ?timeout=


def control_router(client: Any) -> APIRouter:
    """The pause / sleep routes over an `AsyncEngineClient`."""
    router = APIRouter()

    async def change(request: Request, op: str, arg: str | int | None = None) -> dict:
        timeout = query_seconds(request, "timeout", DEFAULT_TIMEOUT_S)
        try:
            state = await change_control(client, op, arg, timeout=timeout)
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
        return {"is_paused": client.control.paused is not None}

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
        return {"is_sleeping": client.control.sleep_level > 0}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> dict:
        return await change(request, "reset_prefix_cache")

    return router


def _flags(state: ControlState) -> dict:
    return {"is_paused": state.paused is not None, "pause_mode": state.paused,
            "is_sleeping": state.sleep_level > 0, "sleep_level": state.sleep_level}


class Admission:
    """The check before a request is sent (module docstring); `max_num_seqs` is how
    many requests an engine runs at once (without a coordinator, what is in flight
    past it counts as waiting)."""

    def __init__(self, client: Any, max_num_queued_requests: int | None,
                 max_num_queued_tokens: int | None, max_num_seqs: int) -> None:
        self.client = client
        self.max_requests = max_num_queued_requests
        self.max_tokens = max_num_queued_tokens
        self.max_num_seqs = max_num_seqs
        self.rejected = 0  # 429s answered

    def __call__(self, prompt_lens: list[int]) -> None:
        state: ControlState = getattr(self.client, "control", ControlState())
        if state.sleep_level > 0:
            raise _unavailable("the server is asleep (POST /wake_up); retry later",
                               "server_sleeping")
        if state.paused is not None:
            raise _unavailable("the server is paused (POST /resume); retry later",
                               "server_paused")
        if (self.max_requests or self.max_tokens) and self._all_full():
            self.rejected += 1
            raise APIError(429, "every engine's queue is full (--max-num-queued-requests "
                           "/ --max-num-queued-tokens); retry later", type="server_error",
                           code="too_many_requests",
                           headers={"Retry-After": str(RETRY_AFTER_S)})

    def _all_full(self) -> bool:
        engines = [e for e in self.client.engines.values() if e.serving]
        if not engines:
            return False  # the engine client answers that (503)
        return all(self._full(e) for e in engines)

    def _full(self, engine: Any) -> bool:
        requests, tokens = self.client.queued(engine)
        if not self.client.has_coordinator:
            requests = max(0, requests - self.max_num_seqs)
        return bool((self.max_requests and requests >= self.max_requests)
                    or (self.max_tokens and tokens >= self.max_tokens))


def _unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, type="server_error", code=code,
                    headers={"Retry-After": str(RETRY_AFTER_S)})
