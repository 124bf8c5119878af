"""The coordinator's LoRA adapter registry changes (`--enable-lora`).

Scope: `apply_lora_change`, one API server's `LoRAChange` applied to the DP-wide
registry (name -> path) that the coordinator publishes and hands each engine with
READY (`dpserve.launch.coordinator.proc`: the registry, its seeding from the first
heartbeat, its publishing).

Not here: loading adapters on the ranks (`dpserve.frontend.lora`).
"""

from __future__ import annotations

import logging

from dpserve.protocol import LoRAChange

logger = logging.getLogger("dpserve.launch.coordinator")


def apply_lora_change(loras: dict[str, str] | None, change: LoRAChange) -> bool:
    """An adapter loaded on every live rank (add) or being unloaded (remove): `loras`
    changes in place. True when the registry must be published (also when unchanged:
    the asker waits for it); False: dropped (LoRA off, an unknown op)."""
    if loras is None:
        logger.warning("LoRA change %s %r dropped: LoRA is off", change.op, change.name)
        return False
    if change.op == "add":
        loras[change.name] = change.path
    elif change.op == "remove":
        loras.pop(change.name, None)
    else:
        logger.warning("unknown LoRA change %r dropped", change.op)
        return False
    logger.info("LoRA adapter %r %s", change.name,
                f"registered ({change.path})" if change.op == "add" else "unregistered")
    return True
