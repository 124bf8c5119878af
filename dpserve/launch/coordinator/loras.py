"""The coordinator's LoRA adapter registry (`--enable-lora`; IO-free).

Scope: `LoRARegistry`, the DP-wide registry, name -> path, starting with
--lora-modules. An API server that loaded an adapter on every live rank
(`dpserve.frontend.lora`) sends `LoRAChange` add; one that unloads, remove
(`apply_lora_change`). The registry goes out in every publish, and with READY to
each engine (its second frame), so a restarted, added or Ray rank loads what it
lacks before it serves.

Invariant: a restarted coordinator publishes no registry until an engine's
heartbeat lists its adapters, paths included (`seed`): it never tells the
front-ends that adapters loaded at run time are gone.

Not here: loading adapters on the ranks (`dpserve.frontend.lora`), the sockets
(`dpserve.launch.coordinator.proc`).
"""

from __future__ import annotations

import logging

import msgspec

from dpserve.protocol import COORDINATOR_READY, EngineReport, LoRAChange

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


class LoRARegistry:
    """The registry (`loras` None: LoRA off) and whether it may be published yet."""

    def __init__(self, loras: dict[str, str] | None) -> None:
        self.loras = dict(loras) if loras is not None else None
        # Published once confirmed: by a change, or by the first engine heartbeat (its
        # adapters: a restarted coordinator learns what was loaded at run time).
        self.heard = False

    def apply(self, change: LoRAChange) -> bool:
        """A change from an API server; True: publish the registry now."""
        if not apply_lora_change(self.loras, change):
            return False
        self.heard = True
        return True

    def seed(self, report: EngineReport) -> bool:
        """The first heartbeat with adapters completes the registry (a restarted
        coordinator starts with --lora-modules only); True: publish it now."""
        if self.heard or self.loras is None or report.lora is None:
            return False
        self.loras.update(report.lora.adapters)
        self.heard = True
        return True

    def published(self) -> dict[str, str] | None:
        """What a publish carries (None: LoRA off, or not confirmed yet)."""
        return self.loras if self.heard else None

    def ready_frames(self) -> list[bytes]:
        """READY; with LoRA on, the registry as a second frame."""
        if self.loras is None:
            return [COORDINATOR_READY]
        return [COORDINATOR_READY, msgspec.msgpack.encode(self.loras)]
