"""The engine's LoRA adapters: registered, on the host, resident in a slot.

Scope: IO-free bookkeeping the `EngineCore` holds (`--enable-lora`). Three tiers:

* registered: name -> path, a per-engine id (1, 2, ...) and a prefix-cache key
  (name + the weights file's sha256: a name reloaded with other weights never
  hits the old blocks; `block_hash.root_hash`);
* on the host: every worker's runner keeps the adapter's tensors in host memory,
  at most `--max-cpu-loras` of them (LRU; an adapter evicted from the host is
  read from its path again when a step needs it);
* resident: in one of `--max-loras` device slots (LRU; `pin_lora` keeps one
  there). A step's adapters are made resident before it runs (`plan`), and the
  scheduler admits a request only when every adapter of the running requests,
  plus the pinned ones, fits the slots at once (`fits`), so a step always fits.

`remove_lora` refuses new requests at once; the adapter is dropped (slot and
host memory freed, the name free again) when its last request in flight ends.

Not here: reading and applying the weights (`dpserve.model.lora`), the calls to
the workers (`EngineLoRA`, `dpserve.engine.lora_sync`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from dpserve.checkpoint.lora_config import WEIGHTS_FILE
from dpserve.engine_config import LoRAConfig
from dpserve.step import LoRAPlan, SchedulerOutput


@dataclass
class LoRAEntry:
    name: str
    lora_id: int  # this engine's id (> 0), what requests and the runners use
    path: str
    cache_key: str  # folded into the prefix-cache root of its requests
    pinned: bool = False
    slot: int | None = None  # the device slot holding it, if resident
    requests: set[str] = field(default_factory=set)  # request ids in flight with it
    removing: bool = False  # remove_lora called: no new requests; dropped when idle


def adapter_cache_key(name: str, path: str) -> str:
    """name + the sha256 of the adapter's weights file (see the module docstring)."""
    digest = hashlib.sha256()
    with open(Path(path) / WEIGHTS_FILE, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return f"{name}:{digest.hexdigest()}"


class LoRAManager:
    """See the module docstring. Calls that change what the workers hold return what
    they must do: `register` the host eviction, `plan` the slot loads (in the step),
    `release` / `remove` the adapter id to drop everywhere."""

    def __init__(self, config: LoRAConfig) -> None:
        self.config = config
        self.by_name: dict[str, LoRAEntry] = {}
        self.by_id: dict[int, LoRAEntry] = {}
        self.slots: list[int | None] = [None] * config.max_loras  # slot -> lora id
        self.slot_lru: OrderedDict[int, None] = OrderedDict()  # resident ids, oldest first
        self.host: OrderedDict[int, None] = OrderedDict()  # ids on the host, oldest first
        self.request_lora: dict[str, int] = {}  # request id in flight -> its adapter id
        self._next_id = 1
        self.loads = 0  # adapters put into a slot, cumulative
        self.evictions = 0  # adapters taken out of a slot for another, cumulative

    # ---- registry ------------------------------------------------------------

    def check_new(self, name: str) -> None:
        if not name or not isinstance(name, str):
            raise ValueError("a LoRA adapter needs a non-empty name")
        entry = self.by_name.get(name)
        if entry is not None:
            state = "is being removed" if entry.removing else "is already loaded"
            raise ValueError(f"LoRA adapter {name!r} {state}")

    def next_id(self) -> int:
        return self._next_id

    def register(self, name: str, path: str, cache_key: str) -> list[int]:
        """Record an adapter the workers loaded onto the host (as `next_id()`);
        returns the ids whose host copies must go (over --max-cpu-loras)."""
        entry = LoRAEntry(name, self._next_id, path, cache_key)
        self._next_id += 1
        self.by_name[name], self.by_id[entry.lora_id] = entry, entry
        self.host[entry.lora_id] = None
        return self._trim_host(keep=entry.lora_id)

    def get(self, name: str) -> LoRAEntry:
        """The adapter a new request names; ValueError if unknown or being removed."""
        entry = self.by_name.get(name)
        if entry is None:
            known = ", ".join(sorted(self.by_name)) or "none"
            raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {known})")
        if entry.removing:
            raise ValueError(f"LoRA adapter {name!r} is being removed")
        return entry

    def acquire(self, name: str, request_id: str) -> LoRAEntry:
        entry = self.get(name)
        entry.requests.add(request_id)
        self.request_lora[request_id] = entry.lora_id
        return entry

    def release(self, request_id: str) -> int | None:
        """Request `request_id` ended (any request: those without an adapter are not
        known here); returns the adapter id to drop now (the last request of an
        adapter being removed), else None."""
        lora_id = self.request_lora.pop(request_id, None)
        entry = self.by_id.get(lora_id) if lora_id is not None else None
        if entry is None:
            return None
        entry.requests.discard(request_id)
        if entry.removing and not entry.requests:
            self._forget(entry)
            return entry.lora_id
        return None

    def remove(self, name: str) -> int | None:
        """remove_lora: refuse new requests; returns the id to drop now when none is in
        flight (else it goes with its last request: `release`)."""
        entry = self.by_name.get(name)
        if entry is None or entry.removing:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        entry.removing = True
        if entry.requests:
            return None
        self._forget(entry)
        return entry.lora_id

    def pin(self, name: str) -> None:
        """Keep the adapter resident once loaded into a slot; at most max_loras - 1
        pinned, so that other adapters can still run."""
        entry = self.get(name)
        if entry.pinned:
            return
        pinned = sum(e.pinned for e in self.by_id.values())
        if pinned + 1 >= self.config.max_loras:
            raise ValueError(f"cannot pin {name!r}: {pinned} of max_loras "
                             f"{self.config.max_loras} slots pinned (one must stay free)")
        entry.pinned = True

    def listing(self) -> list[dict]:
        return [{"name": e.name, "lora_int_id": e.lora_id, "path": e.path,
                 "cache_key": e.cache_key,
                 "resident": e.slot is not None, "on_host": e.lora_id in self.host,
                 "pinned": e.pinned, "requests": len(e.requests), "removing": e.removing}
                for e in sorted(self.by_id.values(), key=lambda e: e.lora_id)]

    def forget_slots(self) -> None:
        """The workers' slots were emptied (the model reloaded on wake-up)."""
        for entry in self.by_id.values():
            entry.slot = None
        self.slots = [None] * self.config.max_loras
        self.slot_lru.clear()

    # ---- steps ---------------------------------------------------------------

    def fits(self, lora_ids: set[int]) -> bool:
        """Whether these adapters and the pinned ones fit the slots at once."""
        pinned = {e.lora_id for e in self.by_id.values() if e.pinned}
        return len(lora_ids | pinned) <= self.config.max_loras

    def plan(self, so: SchedulerOutput) -> None:
        """Make the step's adapters resident: set each scheduled request's `lora_slot`
        and `so.lora` (the slot loads and host drops the workers do first)."""
        used = {s.lora_id for s in so.scheduled if s.lora_id}
        if not used:
            return
        plan = LoRAPlan()
        for lora_id in sorted(used):
            entry = self.by_id[lora_id]
            if entry.slot is None:
                entry.slot = self._take_slot(used)
                self.slots[entry.slot] = lora_id
                plan.loads.append((entry.slot, lora_id, entry.path))
                self.loads += 1
                if lora_id not in self.host:  # read again from its path, kept on the host
                    self.host[lora_id] = None
                    plan.host_drops += self._trim_host(keep=lora_id)
            self.slot_lru[lora_id] = None
            self.slot_lru.move_to_end(lora_id)
            if lora_id in self.host:
                self.host.move_to_end(lora_id)
        for s in so.scheduled:
            if s.lora_id:
                s.lora_slot = self.by_id[s.lora_id].slot  # type: ignore[assignment]
        so.lora = plan if plan.loads or plan.host_drops else None

    def _take_slot(self, used: set[int]) -> int:
        if None in self.slots:
            return self.slots.index(None)
        for lora_id in self.slot_lru:  # least recently used first
            entry = self.by_id[lora_id]
            if not entry.pinned and lora_id not in used:
                del self.slot_lru[lora_id]
                slot, entry.slot = entry.slot, None
                self.evictions += 1
                return slot  # type: ignore[return-value]
        raise AssertionError("a step's adapters must fit the slots (Scheduler admits so)")

    def _trim_host(self, keep: int) -> list[int]:
        drops = []
        for lora_id in list(self.host):
            if len(self.host) <= self.config.max_cpu_loras:
                break
            if lora_id != keep:
                del self.host[lora_id]
                drops.append(lora_id)
        return drops

    def _forget(self, entry: LoRAEntry) -> None:
        del self.by_name[entry.name]
        del self.by_id[entry.lora_id]
        self.host.pop(entry.lora_id, None)
        self.slot_lru.pop(entry.lora_id, None)
        if entry.slot is not None:
            self.slots[entry.slot] = None
