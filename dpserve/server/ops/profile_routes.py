"""`POST /start_profile` and `POST /stop_profile` (vLLM's routes; admin API).

Scope: `profile_router`, two admin routes over the engines' `start_profile` /
`stop_profile` utilities (`dpserve.profiling`): a torch profiler session on every
worker of every live rank, then one Chrome trace file per worker in the engines'
`--profile-dir`.

    POST /start_profile   200 {"profiling": [ranks]}; 409 when a session runs
                          already on some rank (the others' go on: stop them all)
    POST /stop_profile    200 {"files": {rank: [paths, one per worker]}} (a rank
                          with no session: []); 409 when no rank had one

A server started without `--profile-dir`: 400 naming it. A session is one
operator's: there is no per-caller state, and a second start is refused rather
than silently nested. Writing a trace takes a while (seconds for a long session):
each call waits up to `PROFILE_TIMEOUT_S` per rank, then 504.

Not here: the engines' side (`dpserve.profiling.Profiler`), the admin mount
(`dpserve.server.ops.admin`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from dpserve.frontend.async_llm import AsyncLLM
from dpserve.server.errors import APIError

PROFILE_TIMEOUT_S = 120.0  # one rank's start or stop (writing the trace included)


def profile_router(async_llm: AsyncLLM) -> APIRouter:
    router = APIRouter()
    cluster = async_llm.cluster

    def check_enabled() -> None:
        if async_llm.config.profile_dir is None:
            raise APIError(400, "profiling is off: start the server with --profile-dir DIR",
                           param="--profile-dir", code="profiling_disabled")

    @router.post("/start_profile")
    async def start_profile() -> dict[str, Any]:
        check_enabled()
        started = await _on_every_rank(cluster, "start_profile")
        if not all(started.values()):
            raise APIError(409, "a profiler session runs already on rank(s) "
                           f"{sorted(r for r, ok in started.items() if not ok)}: "
                           "POST /stop_profile first", code="profiling_running")
        return {"profiling": sorted(started)}

    @router.post("/stop_profile")
    async def stop_profile() -> dict[str, Any]:
        check_enabled()
        files = await _on_every_rank(cluster, "stop_profile")
        if not any(files.values()):
            raise APIError(409, "no profiler session runs: POST /start_profile first",
                           code="profiling_not_running")
        return {"files": {str(rank): paths for rank, paths in sorted(files.items())}}

    return router


async def _on_every_rank(cluster: Any, method: str) -> dict[int, Any]:
    try:
        return await cluster.call_utility_all(method, timeout=PROFILE_TIMEOUT_S)
    except TimeoutError:
        raise APIError(504, f"{method}: an engine did not answer within "
                       f"{PROFILE_TIMEOUT_S:.0f} s", code="timeout") from None
