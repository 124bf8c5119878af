"""Admin routes: they exist only with `--enable-admin-api` (`build_app` mounts them).

Scope: `admin_router`, every admin route behind the given dependencies (the
API key like every route, `dpserve.server.auth`; POSTs only as `Content-Type:
application/json`, `dpserve.server.bodies.require_json`, which `build_app`
passes in): pause / sleep (`dpserve.server.ops.control`), `POST /scale_elastic_ep`
(`dpserve.server.ops.scale`), LoRA adapter loads (`dpserve.server.ops.lora_routes`),
profiler sessions (`/start_profile`, `/stop_profile`: `dpserve.server.ops.profile_routes`)
and, here, the per-rank controls:

    POST /engines/{rank}/cordon     the rank gets no new requests, in every API
                                    server (through the DP coordinator); what it
                                    holds goes on. 200 once this API server sees it.
    POST /engines/{rank}/uncordon   undoes it.
    POST /engines/{rank}/drain      cordon, then wait until the rank holds no request
                                    (200; `?timeout=S`, default 300, at most 3600:
                                    504 after it);
                                    the rank stays cordoned.
    POST /engines/{rank}/restart    the launcher that runs the rank kills its engine
                                    and starts a new one at once (incarnation + 1),
                                    under any --engine-failure-policy and outside
                                    --max-engine-restarts; its requests move to other
                                    ranks as on a crash (drain first to avoid that).
                                    200 when the new one serves (`?timeout=S`,
                                    default 300, at most 3600: 504). A cordon
                                    outlives it.

Each answers the rank's /engines row. A rank this server does not have, or a
bad timeout: 400; an action not listed: 404; a server without a DP
coordinator (--data-parallel-size 1): 400. Ranks of `--headless` hosts are
not restarted (their launcher does not hear the coordinator): 504.

Not here: the read-only /engines and /dashboard (`dpserve.server.ops.engines`);
the coordinator and launcher sides (`dpserve.launch.coordinator`, `supervisor`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request

from dpserve.frontend.async_llm import AsyncLLM
from dpserve.frontend.cluster import ClusterView
from dpserve.frontend.errors import EngineDeadError
from dpserve.frontend.rank_table import RankView
from dpserve.server.bodies import query_seconds
from dpserve.server.errors import APIError
from dpserve.server.ops.control import control_router
from dpserve.server.ops.engines import engine_rows
from dpserve.server.ops.lora_routes import lora_router
from dpserve.server.ops.profile_routes import profile_router
from dpserve.server.ops.scale import scale_router

ACTIONS = ("cordon", "uncordon", "drain", "restart")
CONTROL_TIMEOUT_S = 10.0  # cordon / uncordon: the coordinator's update comes within this
DEFAULT_WAIT_S = 300.0  # drain / restart without ?timeout=
_POLL_S = 0.05
_DRAIN_SETTLE_S = 0.5  # requests other API servers sent just before the cordon land first


def admin_router(async_llm: AsyncLLM, dependencies: list[Any]) -> APIRouter:
    """Every admin route (module docstring) behind `dependencies`."""
    router = APIRouter(dependencies=dependencies)
    router.include_router(rank_router(async_llm))
    router.include_router(control_router(async_llm.cluster))
    router.include_router(scale_router(async_llm))
    router.include_router(lora_router(async_llm))
    router.include_router(profile_router(async_llm))
    return router


def rank_router(async_llm: AsyncLLM) -> APIRouter:
    """POST /engines/{rank}/{cordon,uncordon,drain,restart}."""
    router = APIRouter()
    cluster = async_llm.cluster

    @router.post("/engines/{rank}/{action}")
    async def control(rank: str, action: str, request: Request) -> dict[str, Any]:
        if action not in ACTIONS:
            raise APIError(404, f"no engine action {action!r}; one of {', '.join(ACTIONS)}",
                           code="not_found")
        number = _rank(cluster, rank)
        timeout = query_seconds(request, "timeout", DEFAULT_WAIT_S)
        if not cluster.has_coordinator:
            raise APIError(400, "per-rank controls go through the DP coordinator, and this "
                           "server has none (--data-parallel-size 1)", code="not_supported")
        if action == "restart":
            await _restart(cluster, number, timeout)
        else:
            await _cordon(cluster, number, action, timeout)
        rows = await engine_rows(async_llm)
        return next(row for row in rows if row["rank"] == number)

    return router


async def _restart(cluster: ClusterView, rank: int, timeout: float) -> None:
    old = _view(cluster, rank).incarnation
    await cluster.control_rank(rank, "restart")
    await _wait(cluster, lambda: _restarted(_view(cluster, rank), old), timeout,
                f"rank {rank} did not serve again within {timeout:g} s of its "
                f"restart (a --headless host's rank is not restarted from here)")


async def _cordon(cluster: ClusterView, rank: int, action: str, timeout: float) -> None:
    """cordon / uncordon, and for drain: cordon, then wait until the rank is empty."""
    cordon = action != "uncordon"
    await cluster.control_rank(rank, "cordon" if cordon else "uncordon")
    await _wait(cluster, lambda: _view(cluster, rank).cordoned == cordon, CONTROL_TIMEOUT_S,
                f"the DP coordinator did not confirm the {action} of rank {rank}")
    if action == "drain":
        await asyncio.sleep(_DRAIN_SETTLE_S)
        await _wait(cluster, lambda: _empty(_view(cluster, rank)), timeout,
                    f"rank {rank} still holds requests after {timeout:g} s; it "
                    f"stays cordoned")


def _view(cluster: ClusterView, rank: int) -> RankView:
    return next(r for r in cluster.ranks() if r.rank == rank)


def _rank(cluster: ClusterView, rank: str) -> int:
    ranks = [r.rank for r in cluster.ranks()]
    if not rank.isdigit() or int(rank) not in ranks:
        raise APIError(400, f"rank must be one of this server's ranks {ranks}, got {rank!r}",
                       param="rank")
    return int(rank)


def _restarted(view: RankView, old_incarnation: int) -> bool:
    return view.incarnation > old_incarnation and view.serving


def _empty(view: RankView) -> bool:
    """The rank holds no request: none in flight from here, and the coordinator's
    counts (which cover every API server's) are zero, or the rank is dead."""
    if view.in_flight:
        return False
    return view.state.value == "dead" or view.waiting + view.running == 0


async def _wait(cluster: ClusterView, done: Callable[[], bool], timeout: float,
                message: str) -> None:
    """Poll `done()` until true; 504 with `message` after `timeout` s, 503 when the
    engines die meanwhile."""
    deadline = time.monotonic() + timeout
    while not done():
        if cluster.dead:
            raise EngineDeadError(cluster.dead_reason)
        if time.monotonic() >= deadline:
            raise APIError(504, message, type="server_error", code="timeout")
        await asyncio.sleep(_POLL_S)
