"""LoRA adapters across every rank and API server: the two-phase load and the unload.

Scope: `load_adapter(cluster, name, path)` and `unload_adapter(cluster, name)`,
what `POST /v1/load_lora_adapter` / `unload_lora_adapter` do, over a
`ClusterView` (`dpserve.frontend.cluster`), whose `loras` is the DP-wide
registry (name -> path) as this front-end knows it and whose `change_lora`
records a change (to the DP coordinator, which publishes it to every API
server, waiting until this one hears it back; without a coordinator, in this
front-end's own copy).

A load is two-phase: 1. every serving rank (cordoned ones too) runs
the engine utility `add_lora` at once, which validates and loads, all or nothing on that
rank; 2. if every rank loaded it, the registry gets it (every API server now
accepts `model: <name>`; a rank that starts later gets it with READY,
`dpserve.engine.lora_sync`) and a rank that started serving meanwhile is
given it too; if any rank refused (or died), the ranks that loaded it unload
it, and `LoRAError` names the first failing rank. An unload leaves the
registry first (no new request names it on any API server), then every serving
rank runs `remove_lora` (requests in flight with it finish).

`LoRAReplay`: without a coordinator, a restarted rank gets the registry from
the engine client before its first request that names an adapter.

Not here: the HTTP routes and status codes' bodies (`dpserve.server.ops.lora_routes`),
the engine's adapters (`dpserve.engine.lora_manager`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from dpserve.frontend.engine_sockets import UtilityCallError
from dpserve.protocol import LoRAChange

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 120.0  # one rank's add_lora (reading and checking the weights)


class LoRAError(Exception):
    """A load or unload refused: `status` 400 (bad adapter, name in use, LoRA off),
    404 (unknown name) or 503 (a rank could not answer)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def registry(cluster: Any) -> dict[str, str]:
    """The adapters this front-end serves (name -> path); LoRAError 400 when LoRA is off."""
    loras = cluster.loras
    if loras is None:
        raise LoRAError(400, "LoRA adapters are not enabled on this server (--enable-lora)",
                        "lora_not_enabled")
    return loras


def _serving(cluster: Any) -> list[int]:
    return [r.rank for r in cluster.ranks() if r.serving]


async def _add_on(cluster: Any, ranks: list[int], name: str, path: str
                  ) -> dict[int, BaseException | None]:
    """add_lora on each rank at once: rank -> None (loaded) or what it raised."""
    results = await asyncio.gather(*(cluster.call_utility(
        "add_lora", name, path, engine=rank, timeout=LOAD_TIMEOUT_S) for rank in ranks),
        return_exceptions=True)
    return {rank: r if isinstance(r, BaseException) else None
            for rank, r in zip(ranks, results)}


async def _remove_on(cluster: Any, ranks: list[int], name: str) -> None:
    """remove_lora on each rank; failures (a rank that died, never held it) are logged."""
    results = await asyncio.gather(*(cluster.call_utility(
        "remove_lora", name, engine=rank) for rank in ranks), return_exceptions=True)
    for rank, r in zip(ranks, results):
        if isinstance(r, BaseException):
            logger.warning("LoRA adapter %r not removed from rank %d: %s", name, rank, r)


async def load_adapter(cluster: Any, name: str, path: str) -> None:
    """Load adapter `name` from `path` on every serving rank, or on none (module
    docstring); LoRAError says why not."""
    if name in registry(cluster):
        raise LoRAError(400, f"The lora adapter '{name}' has already been loaded.",
                        "lora_already_loaded")
    ranks = _serving(cluster)
    if not ranks:
        raise LoRAError(503, "no rank is serving: nothing can load the adapter now",
                        "engine_unavailable")
    # 1. Every serving rank validates and loads it.
    outcome = await _add_on(cluster, ranks, name, path)
    failed = {rank: e for rank, e in outcome.items() if e is not None}
    if failed:
        loaded = [rank for rank, e in outcome.items() if e is None]
        await _remove_on(cluster, loaded, name)
        rank, error = min(failed.items())
        bad_adapter = isinstance(error, (UtilityCallError, ValueError))  # the engine said no
        raise LoRAError(400 if bad_adapter else 503,
                        f"LoRA adapter {name!r} not loaded (on no rank): rank {rank}: "
                        f"{str(error).splitlines()[0] if str(error) else repr(error)}",
                        "invalid_lora_adapter" if bad_adapter else "engine_unavailable")
    # 2. Every API server serves it; a rank that began serving meanwhile gets it too.
    await cluster.change_lora(LoRAChange("add", name, path))
    late = [rank for rank in _serving(cluster) if rank not in outcome]
    for rank, error in (await _add_on(cluster, late, name, path)).items():
        if error is not None and "already loaded" not in str(error):
            logger.error("LoRA adapter %r not loaded on rank %d (it started serving "
                         "during the load): %s", name, rank, error)
    logger.info("LoRA adapter %r loaded from %s on ranks %s", name, path,
                sorted([*outcome, *late]))


async def unload_adapter(cluster: Any, name: str) -> None:
    """Unload adapter `name` everywhere (module docstring); LoRAError 404 if unknown."""
    if name not in registry(cluster):
        raise LoRAError(404, f"The lora adapter '{name}' cannot be found.",
                        "lora_not_found")
    await cluster.change_lora(LoRAChange("remove", name))
    await _remove_on(cluster, _serving(cluster), name)
    logger.info("LoRA adapter %r unloaded", name)


class LoRAReplay:
    """Ranks that missed the registry get it from the engine client.

    `ensure`: without a DP coordinator (one API server, N = 1) no READY carries the
    registry: before the first request naming an adapter goes to a restarted rank
    (incarnation > 0), every registered adapter is loaded there; the first process
    of a rank loaded --lora-modules itself and got every run-time load.

    `reconcile` (with a coordinator; API server 0 only, after each update): a
    serving rank whose heartbeat (`EngineInfo.lora.adapters`) lacks an adapter
    registered for `SETTLE_S` gets `add_lora`, retried every `RETRY_S` while it
    fails. It closes the window where a rank got READY (and the registry) just
    before a load was committed, and heals a replay that failed (files back).
    """

    SETTLE_S = 3.0  # heartbeats show a new adapter within this
    RETRY_S = 5.0

    def __init__(self) -> None:
        self._done: dict[int, int] = {}  # rank -> the incarnation replayed to
        self._locks: dict[int, asyncio.Lock] = {}
        self._seen: dict[str, float] = {}  # registered name -> when first seen here
        self._next_try: dict[tuple[int, int, str], float] = {}  # (rank, incarnation, name)
        self._tasks: set[asyncio.Task[None]] = set()

    def reconcile(self, client: Any) -> None:
        """See the class docstring; called on the event loop after each update."""
        registry = client.news.loras
        if not registry or client.client_index != 0 or not client.has_coordinator:
            return
        now = time.monotonic()
        self._seen = {name: self._seen.get(name, now) for name in registry}
        for engine in client.table.engines.values():
            report = engine.info.lora
            if not engine.serving or report is None:
                continue
            for name in registry.keys() - report.adapters.keys():
                key = (engine.rank, engine.status.incarnation, name)
                if now - self._seen[name] < self.SETTLE_S or \
                        self._next_try.get(key, 0.0) > now:
                    continue
                self._next_try[key] = now + self.RETRY_S
                task = asyncio.get_running_loop().create_task(
                    self._heal(client, engine.rank, name, registry[name]))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _heal(client: Any, rank: int, name: str, path: str) -> None:
        try:
            await client.call_utility("add_lora", name, path, engine=rank,
                                      timeout=LOAD_TIMEOUT_S)
            logger.warning("LoRA adapter %r was missing on rank %d: loaded", name, rank)
        except Exception as e:  # noqa: BLE001 - retried after RETRY_S; logged
            if "already loaded" not in str(e):
                logger.error("LoRA adapter %r missing on rank %d, not loaded: %s", name,
                             rank, e)

    async def ensure(self, client: Any, rank: int, incarnation: int,
                     lora_name: str | None) -> None:
        registry = client.news.loras
        if lora_name is None or client.has_coordinator or not registry or incarnation == 0:
            return
        async with self._locks.setdefault(rank, asyncio.Lock()):
            if self._done.get(rank) == incarnation:
                return
            for name, path in dict(registry).items():
                try:
                    await client.call_utility("add_lora", name, path, engine=rank,
                                              timeout=LOAD_TIMEOUT_S)
                except UtilityCallError as e:
                    if "already loaded" not in str(e):
                        logger.error("LoRA adapter %r not loaded on restarted rank %d: %s",
                                     name, rank, e)
            self._done[rank] = incarnation
            logger.info("rank %d (incarnation %d): %d LoRA adapter(s) loaded again", rank,
                        incarnation, len(registry))
