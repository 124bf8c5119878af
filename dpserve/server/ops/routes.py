"""The operations routes: /health, /ping, /metrics, /version, /debug/*.

Scope: `ops_router(async_llm, metrics)`, read-only views for load balancers,
Prometheus and leak checks, all from the engines' `ClusterView`
(`AsyncLLM.cluster`):

    GET /health, GET|POST /ping   200 while at least one rank serves (`?rank=R`:
                                  while rank R serves), else 503 (also once the
                                  engines are dead, or while draining); the body
                                  lists every rank's state
    GET /metrics                  Prometheus (`dpserve.server.metrics.prometheus`)
    GET /version
    GET /debug/request_state      sizes of the per-request state, here and in
                                  each live engine (all 0 when idle)
    GET /debug/dp_state           each live engine's DP state and routed experts

`MovedListener` keeps the moved-request counters of /metrics current after
every engine message.

Not here: /engines and /dashboard (`dpserve.server.ops.engines`), admin routes.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from dpserve.frontend.async_llm import AsyncLLM
from dpserve.frontend.cluster import ClusterView
from dpserve.frontend.errors import EngineDeadError
from dpserve.server.errors import APIError
from dpserve.server.metrics.prometheus import CONTENT_TYPE, ServerMetrics
from dpserve.server.openai.routes import draining_error
from dpserve.version import __version__

_DEBUG_TIMEOUT_S = 10.0  # a /debug route's utility calls


def ops_router(async_llm: AsyncLLM, metrics: ServerMetrics) -> APIRouter:
    """The operations routes (module docstring)."""
    router = APIRouter()
    _health_routes(router, async_llm)
    _metrics_route(router, async_llm.cluster, metrics)
    _debug_routes(router, async_llm)

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    return router


def _health_routes(router: APIRouter, async_llm: AsyncLLM) -> None:
    """GET /health, GET|POST /ping."""
    cluster = async_llm.cluster

    @router.get("/health")
    @router.get("/ping")
    @router.post("/ping")
    async def health(request: Request) -> Response:
        """200 while at least one rank serves (`?rank=R`: while rank R serves), else 503;
        the body lists every rank's state."""
        if async_llm.is_dead:
            raise EngineDeadError("the engine is dead")
        if async_llm.draining:
            raise draining_error()
        ranks = rank_states(cluster)
        rank = request.query_params.get("rank")
        if rank is not None:
            if not rank.isdigit() or int(rank) not in {r["rank"] for r in ranks}:
                raise APIError(400, f"rank must be one of this server's ranks "
                               f"{[r['rank'] for r in ranks]}, got {rank!r}", param="rank")
            ranks = [r for r in ranks if r["rank"] == int(rank)]
        ok = any(r["state"] == "serving" for r in ranks)
        return JSONResponse({"status": "ok" if ok else "unavailable", "ranks": ranks,
                             "data_parallel_size": cluster.data_parallel_size},
                            status_code=200 if ok else 503)


def _metrics_route(router: APIRouter, cluster: ClusterView, metrics: ServerMetrics) -> None:
    """GET /metrics: the series set at scrape time from `cluster`, then rendered."""

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        metrics.set_wave(cluster.current_wave)  # as this API server last heard it
        metrics.set_ranks({r["rank"]: (r["state"], r["incarnation"])
                           for r in rank_states(cluster)})
        metrics.record_moved(_moved(cluster))
        metrics.set_elastic(cluster.data_parallel_size, cluster.autoscale_decisions)
        metrics.lora.update(cluster.ranks(), cluster.loras)
        return Response(metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def _debug_routes(router: APIRouter, async_llm: AsyncLLM) -> None:
    """GET /debug/request_state, GET /debug/dp_state (utility calls to every live engine)."""
    cluster = async_llm.cluster

    @router.get("/debug/request_state")
    async def request_state() -> dict[str, Any]:
        """Entries of every per-request structure, in this API server and in each live
        engine: all 0 (and every KV block free or cached) when nothing is in flight."""
        engines = await cluster.call_utility_all("request_state_sizes",
                                                 timeout=_DEBUG_TIMEOUT_S)
        return {"api_server": async_llm.request_state_sizes(),
                "engines": {str(rank): sizes for rank, sizes in engines.items()}}

    @router.get("/debug/dp_state")
    async def dp_state() -> dict[str, Any]:
        """Each live engine's DP state (lockstep, wave, dummy batches, all-reduces) and
        the routed experts it holds (MoE; None for a dense model)."""
        dp = await cluster.call_utility_all("get_dp_state", timeout=_DEBUG_TIMEOUT_S)
        experts = await cluster.call_utility_all("expert_info", timeout=_DEBUG_TIMEOUT_S)
        return {"engines": {str(rank): {"dp": dp[rank], "experts": experts.get(rank)}
                            for rank in dp}}


class MovedListener:
    """After each engine message, bring the moved-request counters up to date."""

    def __init__(self, metrics: ServerMetrics, cluster: ClusterView) -> None:
        self.metrics, self.cluster = metrics, cluster

    def record(self, engine_index: Any, scheduler_stats: Any, iteration: Any) -> None:
        self.metrics.record_moved(_moved(self.cluster))


def _moved(cluster: ClusterView) -> tuple[int, int, int]:
    """The engine client's totals of re-sent and migrated requests and recomputed tokens."""
    moved = cluster.moved
    return moved.retries, moved.migrations, moved.recomputed_tokens


def rank_states(cluster: ClusterView) -> list[dict[str, Any]]:
    """Each rank's state as this API server knows it."""
    return [{"rank": r.rank, "state": r.state.value, "incarnation": r.incarnation,
             "reason": r.reason} for r in cluster.ranks()]
