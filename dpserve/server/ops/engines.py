"""`GET /engines` and `/dashboard`: the read-only view of every DP rank.

Scope: `engines_router(async_llm, admin)` (no admin flag needed; /engines is
behind the API key like every data route, while the dashboard page and its two
static files are open: they hold no data), and `engine_rows(...)`, the per-rank
rows that both /engines and the admin routes (`dpserve.server.ops.admin`) answer
with. Their fields and where each comes from: docs/reference/http.md.

Invariants:
* With a DP coordinator (N > 1) every figure is what the coordinator last
  published, so every API server answers alike; without one the engine is asked
  (`get_stats`, `tp_worker_info`) and tokens/s is taken between this server's polls.
* `tp_workers` lists worker 0 (the engine core's process) first; empty while a
  rank cannot say (dead, restarting).
* The dashboard is one HTML page with its script and style sheet in `static/`
  (package data; no build step, nothing from a CDN). It polls /engines every
  second with the API key typed into the page (kept in the page only); its URLs
  are relative, so it works under --root-path. Every dashboard response carries
  `DASHBOARD_HEADERS`: a Content-Security-Policy allowing only this origin's
  script and style (no inline code, no framing, no form targets),
  `X-Frame-Options: DENY`, `X-Content-Type-Options: nosniff` and
  `Referrer-Policy: no-referrer`.

Not here: cordon / drain / restart (`dpserve.server.ops.admin`).
"""

from __future__ import annotations

import importlib.resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from dpserve.frontend.async_llm import AsyncLLM
from dpserve.frontend.cluster import ClusterView
from dpserve.protocol import LoRAReport, SchedulerStats, TPWorkerInfo
from dpserve.rank_info import TokenRate
from dpserve.server.errors import APIError
from dpserve.server.metrics.kv_tier import has_tier

_STATIC = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
_STATS_TIMEOUT_S = 2.0  # N = 1: how long /engines waits for the engine's figures
DASHBOARD_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def engines_router(async_llm: AsyncLLM, admin: bool) -> APIRouter:
    """GET /engines, GET /dashboard (+ its two static files); `admin`: the admin routes
    are on (the page shows its buttons)."""
    router = APIRouter()
    rates: dict[int, TokenRate] = {}  # N = 1 only: tokens/s between polls

    @router.get("/engines")
    async def engines() -> dict[str, Any]:
        rows = await engine_rows(async_llm, rates)
        return {"data_parallel_size": async_llm.cluster.data_parallel_size,
                "tensor_parallel_size": async_llm.config.parallel.tensor_parallel_size,
                "admin": admin, "engines": rows}

    @router.get("/dashboard")
    async def dashboard() -> Response:
        return Response(_static("dashboard.html"), media_type="text/html",
                        headers=DASHBOARD_HEADERS)

    @router.get("/dashboard/{name}")
    async def dashboard_file(name: str) -> Response:
        if name not in _STATIC:
            raise APIError(404, f"no dashboard file {name!r}", code="not_found")
        return Response(_static(name), media_type=_STATIC[name], headers=DASHBOARD_HEADERS)

    return router


def _static(name: str) -> bytes:
    return importlib.resources.files("dpserve.server.ops").joinpath("static", name).read_bytes()


async def engine_rows(async_llm: AsyncLLM, rates: dict[int, TokenRate] | None = None
                      ) -> list[dict[str, Any]]:
    """One row per rank this API server sends to (module docstring)."""
    cluster = async_llm.cluster
    views = cluster.ranks()
    if not cluster.has_coordinator:
        rows = await _local_rows(cluster, rates if rates is not None else {})
    else:
        rows = [_row(r.rank, r.state.value, r.incarnation, r.waiting, r.running,
                     r.info.kv_cache_usage, r.info.tokens_per_s, r.info.wave,
                     r.info.cordoned, r.info.host, r.info.pid, r.info.ttft_s,
                     r.info.tp_workers, r.info.lora, r.stats)
                for r in views]
    for row, view in zip(rows, views):
        row.update(role=view.role, handoffs=view.handoffs)
    return rows


async def _local_rows(cluster: ClusterView, rates: dict[int, TokenRate]
                      ) -> list[dict[str, Any]]:
    """No coordinator: ask each engine for its figures (N = 1, or in-process)."""
    rows = []
    for view in cluster.ranks():
        stats = await _stats(cluster, view.rank)
        workers = await _workers(cluster, view.rank) if stats is not None else []
        rate = rates.setdefault(view.rank, TokenRate())
        if stats is not None:
            rate.add(stats.num_generated_tokens)
        rows.append(_row(view.rank, view.state.value, view.incarnation,
                         stats.num_waiting if stats else 0,
                         stats.num_running if stats else 0,
                         stats.kv_cache_usage if stats else 0.0, rate.rate(),
                         stats.wave if stats else 0, False, "",
                         workers[0].pid if workers else None, 0.0, workers,
                         await _loras(cluster, view.rank) if stats is not None else None,
                         stats))
    return rows


async def _stats(cluster: ClusterView, rank: int) -> SchedulerStats | None:
    """The engine's figures now; None when it cannot answer (dead, restarting)."""
    try:
        return await cluster.call_utility("get_stats", engine=rank, timeout=_STATS_TIMEOUT_S,
                                          result_type=SchedulerStats)
    except Exception:  # noqa: BLE001 - a rank that cannot answer shows zeros
        return None


async def _workers(cluster: ClusterView, rank: int) -> list[TPWorkerInfo]:
    """The engine's tensor-parallel workers now; none when it cannot answer."""
    try:
        return await cluster.call_utility("tp_worker_info", engine=rank,
                                          timeout=_STATS_TIMEOUT_S,
                                          result_type=list[TPWorkerInfo])
    except Exception:  # noqa: BLE001 - as _stats
        return []


async def _loras(cluster: ClusterView, rank: int) -> LoRAReport | None:
    """N = 1: the engine's adapters now (`list_loras`); None when LoRA is off or it
    cannot answer. (No slot loads / evictions: those come with heartbeats.)"""
    if cluster.loras is None:
        return None
    try:
        listing = await cluster.call_utility("list_loras", engine=rank,
                                             timeout=_STATS_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - as _stats
        return None
    return LoRAReport(resident=[e["name"] for e in listing if e["resident"]],
                      cached=[e["name"] for e in listing
                              if e["on_host"] and not e["resident"]],
                      registered=len(listing))


def _row(rank: int, state: str, incarnation: int, waiting: int, running: int,
         kv_cache_usage: float, tokens_per_s: float, wave: int, cordoned: bool, host: str,
         pid: int | None, ttft_s: float = 0.0,
         tp_workers: list[TPWorkerInfo] | None = None,
         lora: LoRAReport | None = None, stats: SchedulerStats | None = None
         ) -> dict[str, Any]:
    return {"rank": rank, "state": state, "cordoned": cordoned, "waiting": waiting,
            "running": running, "kv_cache_usage": kv_cache_usage,
            "tokens_per_s": tokens_per_s, "wave": wave, "restarts": incarnation,
            "incarnation": incarnation, "host": host, "pid": pid, "ttft_s": ttft_s,
            "tp_workers": [{"tp_rank": w.tp_rank, "pid": w.pid, "device": w.device,
                            "rss_bytes": w.rss_bytes} for w in tp_workers or []],
            "lora": None if lora is None else {
                "resident": lora.resident, "cached": lora.cached, "loads": lora.loads,
                "evictions": lora.evictions, "max_loras": lora.max_loras},
            "kv_tier": _tier(stats), "spec_decode": _spec_decode(stats)}


def _spec_decode(s: SchedulerStats | None) -> dict[str, Any] | None:
    """The rank's speculative decoding figures; None before its first draft."""
    if s is None or not s.spec_decode_num_drafts:
        return None
    drafts, proposed = s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens
    accepted = s.spec_decode_num_accepted_tokens
    return {"drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts}


def _tier(s: SchedulerStats | None) -> dict[str, Any] | None:
    """The rank's KV host tier figures (module docstring); None without a tier."""
    if s is None or not has_tier(s):
        return None
    return {"hits": s.kv_tier_hits, "queries": s.kv_tier_queries,
            "loaded_bytes": s.kv_tier_loaded_bytes, "saved_bytes": s.kv_tier_saved_bytes,
            "load_seconds": s.kv_tier_load_seconds, "used_blocks": s.kv_tier_used_blocks,
            "num_blocks": s.kv_tier_num_blocks}
