"""LoRA in one engine: its bookkeeping and its workers kept in step, as callers reach it.

Scope: `EngineLoRA`, the part an `EngineCore` holds (`--enable-lora`; without it
every call says LoRA is off). It drives the `LoRAManager` (IO-free) and carries
out what it returns on every worker of the rank (`collective_rpc`):

* the utilities `add_lora`, `remove_lora`, `list_loras`, `pin_lora`, registered
  in the core's `UtilityTable`;
* the request path: a request's adapter acquired at `add_request`, released when
  it ends, the step's slot loads planned after `schedule`;
* the DP-wide registry: `replay`, once the DP coordinator says READY (whose second
  frame is the registry, name -> path), loads each adapter this rank lacks before
  it registers with the front-ends, so a restarted, added or Ray rank never takes
  a request for an adapter it does not hold; `report`, what the heartbeat carries
  to the coordinator (and /engines, the routers).

Not here: the bookkeeping's rules (`dpserve.engine.lora_manager`), reading and
applying the weights (`dpserve.model.lora`), the registry itself
(`dpserve.launch.coordinator`), the load across ranks (`dpserve.frontend.lora`).
"""

from __future__ import annotations

import logging
from typing import Any

from dpserve.engine.lora_manager import LoRAManager, adapter_cache_key
from dpserve.engine.utilities import UtilityTable
from dpserve.engine_config import LoRAConfig
from dpserve.protocol import EngineCoreRequest, LoRAReport
from dpserve.step import SchedulerOutput

logger = logging.getLogger(__name__)


class EngineLoRA:
    """An engine's adapters (module docstring); `manager` is None with LoRA off."""

    def __init__(self, config: LoRAConfig | None, executor: Any) -> None:
        self.manager = LoRAManager(config) if config is not None else None
        self.executor = executor

    def register(self, table: UtilityTable) -> None:
        table.register(add_lora=self.add, remove_lora=self.remove, list_loras=self.listing,
                       pin_lora=self.pin)

    # ---- utilities -------------------------------------------------------------

    def add(self, name: str, path: str) -> dict[str, Any]:
        """Load the PEFT adapter in directory `path` (on this server's filesystem) as
        `name` on every worker: all of them or none (ValueError, one line: not an
        adapter, rank over max_lora_rank, a module the model lacks, a shape mismatch,
        a name in use). Returns its `list_loras` entry."""
        lora = self._on()
        lora.check_new(name)
        lora_id = lora.next_id()
        errors = self.executor.collective_rpc("load_lora", lora_id, str(path))
        error = next((e for e in errors if e is not None), None)
        try:
            if error is not None:
                raise ValueError(error)
            key = adapter_cache_key(name, path)
        except (OSError, ValueError) as e:
            self.executor.collective_rpc("drop_lora", lora_id)
            raise ValueError(str(e).splitlines()[0] if str(e) else repr(e)) from None
        for dropped in lora.register(name, str(path), key):
            self.executor.collective_rpc("drop_lora", dropped)
        logger.info("LoRA adapter %r loaded from %s (id %d)", name, path, lora_id)
        return next(e for e in lora.listing() if e["name"] == name)

    def remove(self, name: str) -> bool:
        """Refuse new requests for adapter `name` now; it is dropped (slot and host
        memory freed) once its requests in flight finish. ValueError if unknown."""
        dropped = self._on().remove(name)
        if dropped is not None:
            self.executor.collective_rpc("drop_lora", dropped)
        logger.info("LoRA adapter %r removed%s", name,
                    "" if dropped is not None else " (once its requests finish)")
        return True

    def listing(self) -> list[dict[str, Any]]:
        """Every adapter: name, lora_int_id (this engine's), path, cache_key (the
        prefix-cache root's key: name + weights sha256), resident (in a device slot),
        on_host, pinned, requests in flight, removing."""
        return self.manager.listing() if self.manager is not None else []

    def pin(self, name: str) -> bool:
        """Keep adapter `name` in its device slot once loaded (never evicted)."""
        self._on().pin(name)
        return True

    def _on(self) -> LoRAManager:
        if self.manager is None:
            raise ValueError("LoRA is not enabled on this engine (--enable-lora)")
        return self.manager

    # ---- the request path ---------------------------------------------------------

    def acquire(self, request: EngineCoreRequest) -> tuple[int, str | None]:
        """(adapter id, prefix-cache key) of the adapter a request names: (0, None) for
        none; ValueError for an adapter this engine does not hold."""
        name = request.lora_name
        if name is None:
            return 0, None
        if self.manager is None:
            raise ValueError(f"request {request.request_id!r} names LoRA adapter {name!r}, "
                             f"but LoRA is not enabled (--enable-lora)")
        if request.request_id in self.manager.request_lora:
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        entry = self.manager.acquire(name, request.request_id)
        return entry.lora_id, entry.cache_key

    def release(self, request_ids: list[str]) -> None:
        """Requests ended: an adapter being removed goes with its last one."""
        if self.manager is None:
            return
        for request_id in request_ids:
            dropped = self.manager.release(request_id)
            if dropped is not None:
                self.executor.collective_rpc("drop_lora", dropped)

    def plan(self, scheduler_output: SchedulerOutput) -> None:
        """Which slot holds each scheduled request's adapter (`LoRAManager.plan`)."""
        if self.manager is not None:
            self.manager.plan(scheduler_output)

    def wake_up(self) -> None:
        """After a sleep the slots come back empty: forget what each held."""
        if self.manager is not None:
            self.manager.forget_slots()
            self.executor.collective_rpc("clear_lora_slots")

    def num_requests(self) -> int:
        """Requests holding an adapter (a leak check: 0 once idle)."""
        return len(self.manager.request_lora) if self.manager is not None else 0

    # ---- the DP-wide registry -------------------------------------------------------

    def replay(self, registry: dict[str, str], rank: int) -> None:
        """Load every adapter of `registry` this engine does not hold. One that fails
        is logged and skipped: the rank serves the others (a request for it fails
        there with the engine's one-line error)."""
        if self.manager is None:
            if registry:
                logger.warning("engine %d: %d LoRA adapter(s) registered but LoRA is off here",
                               rank, len(registry))
            return
        for name, path in registry.items():
            if name in self.manager.by_name:
                continue
            try:
                self.add(name, path)
                logger.info("engine %d: LoRA adapter %r loaded from the registry", rank, name)
            except ValueError as e:
                logger.error("engine %d: registered LoRA adapter %r not loaded: %s", rank, name,
                             e)

    def report(self) -> LoRAReport | None:
        """The heartbeat's view of the adapters (None: LoRA off): the names resident in
        a device slot, those only in host memory, slot loads / evictions."""
        manager = self.manager
        if manager is None:
            return None
        resident, cached = [], []
        for entry in manager.by_id.values():
            if entry.removing:
                continue
            if entry.slot is not None:
                resident.append(entry.name)
            elif entry.lora_id in manager.host:
                cached.append(entry.name)
        return LoRAReport(resident=sorted(resident), cached=sorted(cached),
                          registered=len(manager.by_name), max_loras=manager.config.max_loras,
                          adapters={e.name: e.path for e in manager.by_name.values()
                                    if not e.removing},
                          loads=manager.loads, evictions=manager.evictions)
