"""An engine's share of the DP-wide LoRA registry: replay it at start, report it.

Scope: `replay_registry`, called once the DP coordinator says READY (whose second
frame is the registry, name -> path): a rank that starts after adapters were
loaded at run time (restarted, added by scaling or the autoscaler, a Ray actor)
loads each one it lacks before it registers with the front-ends, so it never
takes a request for an adapter it does not hold. `lora_report`, what the
heartbeat carries to the coordinator (and /engines, the routers): the names
resident in a device slot, those only in host memory, slot loads / evictions.

Not here: the adapters themselves (`dpserve.engine.lora_manager`, `EngineCore.
add_lora`), the registry (`dpserve.launch.coordinator`), the load across ranks
(`dpserve.frontend.lora`).
"""

from __future__ import annotations

import logging
from typing import Any

from dpserve.engine.lora_manager import LoRAManager
from dpserve.protocol import LoRAReport

logger = logging.getLogger(__name__)


def replay_registry(core: Any, registry: dict[str, str], rank: int) -> None:
    """Load into `core` (an `EngineCore`) every adapter of `registry` it does not hold.
    One that fails is logged and skipped: the rank serves the others (a request
    for it fails there with the engine's one-line error)."""
    manager: LoRAManager | None = getattr(core, "lora", None)
    if manager is None:
        if registry:
            logger.warning("engine %d: %d LoRA adapter(s) registered but LoRA is off here",
                           rank, len(registry))
        return
    for name, path in registry.items():
        if name in manager.by_name:
            continue
        try:
            core.add_lora(name, path)
            logger.info("engine %d: LoRA adapter %r loaded from the registry", rank, name)
        except ValueError as e:
            logger.error("engine %d: registered LoRA adapter %r not loaded: %s", rank, name, e)


def lora_report(manager: LoRAManager | None) -> LoRAReport | None:
    """The heartbeat's view of an engine's adapters (None: LoRA off)."""
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
