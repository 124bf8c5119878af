"""`TierStore`: the KV host tier's index (pure logic: no sockets, no memory).

Scope: a fixed number of slots (the arena's bytes // the layout's slot bytes,
set by the first client's `hello`), each FREE, WRITING (reserved by one client,
being written, invisible to lookups) or READY (holds the block of one hash);
a hash -> slot map; read pins per slot; LRU order over READY slots. Every pin
and reservation belongs to the client that took it, by name, so a client that
says hello again (a restarted rank, a reconnect) or is gone (`drop_client`)
leaves nothing pinned or half-written behind.

Invariants (`check` asserts them; tests/engine/test_kv_tier_store.py drives them):
* The slot count is fixed: the tier never holds more than its budget.
* A pinned or WRITING slot is never evicted or handed out again.
* `lookup` returns the LEADING hashes that are READY (it stops at the first
  miss, as a prefix must), pinning each; a WRITING slot is a miss.
* `reserve` skips hashes the tier holds or is writing; it takes FREE slots,
  then evicts the least recently used READY, unpinned slot; it returns fewer
  slots than asked (maybe none) when everything else is pinned or WRITING.
* The first client's layout holds until the store restarts: a client with
  another layout key is refused (`LayoutError` names both keys).
* A pull between stores (`dpserve.kv_tier.transfer`) is a client too
  (`register`): it pins the leading blocks it holds, reserves the leading run it
  lacks (`reserve(leading=True)`), and `drop_client` at its end leaves nothing.

Not here: the process and its sockets (`dpserve.kv_tier.server`), the arena
(`dpserve.kv_tier.arena`).
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from dpserve.kv_tier.layout import TierLayout
from dpserve.kv_tier.messages import TierStats


class SlotState(enum.IntEnum):
    FREE = 0
    WRITING = 1
    READY = 2


class LayoutError(ValueError):
    """A client's layout does not match the store's (or fits no slot in the arena)."""


class UnknownClient(KeyError):
    """An op from a client that has not said hello (or was dropped)."""


@dataclass
class _Client:
    pins: collections.Counter[int] = field(default_factory=collections.Counter)
    writing: set[int] = field(default_factory=set)  # slots it reserved


class TierStore:
    """See the module docstring. One per store process; `generation` names it."""

    def __init__(self, arena_bytes: int, generation: int = 0) -> None:
        self.arena_bytes = arena_bytes
        self.generation = generation
        self.layout: TierLayout | None = None
        self.num_slots = 0
        self._slot_of: dict[bytes, int] = {}  # hash -> slot (WRITING or READY)
        self._hash: list[bytes | None] = []  # slot -> its hash
        self._state: list[SlotState] = []
        self._pins: list[int] = []  # slot -> read pins, every client's
        self._free: list[int] = []  # FREE slots (a stack)
        # READY slots with no pin, least recently used first: the eviction order.
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._clients: dict[str, _Client] = {}
        self._counts = collections.Counter[str]()  # queries, hits, saved, evictions
        self._in_state = collections.Counter[SlotState]()  # slots per state (stats in O(1))
        self._pinned = 0  # slots with a pin

    # ---- clients -------------------------------------------------------------

    def hello(self, client: str, layout: TierLayout) -> int:
        """Register `client` (dropping what it held before); the slot count. The first
        hello fixes the layout; another layout is a LayoutError."""
        if self.layout is None:
            num_slots = self.arena_bytes // layout.slot_bytes if layout.slot_bytes > 0 else 0
            if num_slots < 1:
                raise LayoutError(f"--kv-offload-memory ({self.arena_bytes} bytes) holds no "
                                  f"KV block of {layout.slot_bytes} bytes ({layout.key})")
            self._set_layout(layout, num_slots)
        elif layout != self.layout:
            raise LayoutError(f"the KV tier holds blocks of layout '{self.layout.key}' "
                              f"({self.layout.slot_bytes} bytes a slot); this client's is "
                              f"'{layout.key}' ({layout.slot_bytes} bytes)")
        self.drop_client(client)
        self._clients[client] = _Client()
        return self.num_slots

    def register(self, client: str) -> None:
        """Register `client` under the store's layout (a pull's own owner of pins and
        reservations) unless it is known; LayoutError when no layout is set yet."""
        if self.layout is None:
            raise LayoutError("the KV tier has no layout yet (no engine has connected)")
        self._clients.setdefault(client, _Client())

    def _set_layout(self, layout: TierLayout, num_slots: int) -> None:
        self.layout = layout
        self.num_slots = num_slots
        self._hash = [None] * num_slots
        self._state = [SlotState.FREE] * num_slots
        self._in_state[SlotState.FREE] = num_slots
        self._pins = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # slot 0 first

    def drop_client(self, client: str) -> tuple[int, int]:
        """Forget `client`: its pins released, its reservations freed. Returns (pins,
        reservations) dropped; (0, 0) for a client it does not know."""
        state = self._clients.pop(client, None)
        if state is None:
            return 0, 0
        for slot, count in state.pins.items():
            self._unpin(slot, count)
        for slot in state.writing:
            self._free_slot(slot)
        return sum(state.pins.values()), len(state.writing)

    def clients(self) -> list[str]:
        return list(self._clients)

    def _client(self, client: str) -> _Client:
        try:
            return self._clients[client]
        except KeyError:
            raise UnknownClient(client) from None

    # ---- ops -----------------------------------------------------------------

    def lookup(self, client: str, hashes: Iterable[bytes], *, count: bool = True
               ) -> list[int]:
        """The slots of the leading READY `hashes`, each pinned for `client`; `count`:
        in the queries and hits (an engine's lookups; not a pull's)."""
        owner = self._client(client)
        slots = []
        queries = 0
        for h in hashes:
            queries += 1
            slot = self._slot_of.get(h)
            if slot is None or self._state[slot] is not SlotState.READY:
                break
            self._pins[slot] += 1
            self._pinned += self._pins[slot] == 1
            owner.pins[slot] += 1
            self._evictable.pop(slot, None)  # pinned: not evictable; MRU once released
            slots.append(slot)
        if count:
            self._counts["queries"] += queries
            self._counts["hits"] += len(slots)
        return slots

    def held(self, hashes: Iterable[bytes]) -> int:
        """How many leading `hashes` are READY (no pin, no count, no LRU move)."""
        n = 0
        for h in hashes:
            slot = self._slot_of.get(h)
            if slot is None or self._state[slot] is not SlotState.READY:
                break
            n += 1
        return n

    def release(self, client: str, slots: Iterable[int]) -> None:
        """Unpin `slots` that `client` pinned (others, e.g. from before its last
        hello, are ignored)."""
        owner = self._client(client)
        for slot in slots:
            if owner.pins.get(slot, 0) > 0:
                owner.pins[slot] -= 1
                if owner.pins[slot] == 0:
                    del owner.pins[slot]
                self._unpin(slot, 1)

    def reserve(self, client: str, hashes: Iterable[bytes], *, leading: bool = False
                ) -> dict[bytes, int]:
        """A WRITING slot for each of `hashes` the tier neither holds nor is writing,
        while slots can be found (FREE, else the LRU READY unpinned one). `leading`:
        a hash the tier holds or is writing ends the run instead (a pull's)."""
        owner = self._client(client)
        granted: dict[bytes, int] = {}
        for h in hashes:
            if h in self._slot_of or h in granted:
                if leading:
                    break
                continue
            slot = self._take_slot()
            if slot is None:
                break  # everything else is pinned or being written
            self._set_state(slot, SlotState.WRITING)
            self._hash[slot] = h
            self._slot_of[h] = slot
            owner.writing.add(slot)
            granted[h] = slot
        return granted

    def commit(self, client: str, hashes: Iterable[bytes]) -> None:
        """`client`'s reserved `hashes` are written: READY (most recently used)."""
        owner = self._client(client)
        for slot in self._reserved_by(owner, hashes):
            self._set_state(slot, SlotState.READY)
            self._evictable[slot] = None
            self._counts["saved"] += 1

    def abort(self, client: str, hashes: Iterable[bytes]) -> None:
        """`client`'s reserved `hashes` were not written: FREE."""
        owner = self._client(client)
        for slot in self._reserved_by(owner, hashes):
            self._free_slot(slot)

    def stats(self) -> TierStats:
        return TierStats(
            generation=self.generation, num_slots=self.num_slots,
            slot_bytes=self.layout.slot_bytes if self.layout else 0,
            ready=self._in_state[SlotState.READY], writing=self._in_state[SlotState.WRITING],
            pinned=self._pinned, clients=len(self._clients),
            queries=self._counts["queries"], hits=self._counts["hits"],
            saved=self._counts["saved"], evictions=self._counts["evictions"])

    # ---- slots ---------------------------------------------------------------

    def _reserved_by(self, owner: _Client, hashes: Iterable[bytes]) -> list[int]:
        """The slots of `hashes` that `owner` holds WRITING (taken out of its set)."""
        slots = []
        for h in hashes:
            slot = self._slot_of.get(h)
            if slot is not None and slot in owner.writing:
                owner.writing.discard(slot)
                slots.append(slot)
        return slots

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._evictable:
            return None
        slot, _ = self._evictable.popitem(last=False)  # least recently used
        del self._slot_of[self._hash[slot]]  # type: ignore[arg-type]
        self._hash[slot] = None
        self._counts["evictions"] += 1
        return slot

    def _unpin(self, slot: int, count: int) -> None:
        self._pins[slot] -= count
        if self._pins[slot] == 0:
            self._pinned -= 1
            if self._state[slot] is SlotState.READY:
                self._evictable[slot] = None  # most recently used

    def _free_slot(self, slot: int) -> None:
        h = self._hash[slot]
        if h is not None:
            del self._slot_of[h]
        self._hash[slot] = None
        self._set_state(slot, SlotState.FREE)
        self._evictable.pop(slot, None)
        self._free.append(slot)

    def _set_state(self, slot: int, state: SlotState) -> None:
        self._in_state[self._state[slot]] -= 1
        self._in_state[state] += 1
        self._state[slot] = state

    def check(self) -> None:
        """AssertionError unless the invariants of the module docstring hold."""
        held = {s: h for h, s in self._slot_of.items()}
        assert len(held) == len(self._slot_of), "two hashes share a slot"
        assert set(self._free).isdisjoint(held) and len(set(self._free)) == len(self._free)
        assert len(self._free) + len(held) == self.num_slots, "a slot is lost"
        for slot in range(self.num_slots):
            state = self._state[slot]
            assert (state is SlotState.FREE) == (slot not in held), f"slot {slot}: {state}"
            assert self._hash[slot] == held.get(slot)
            evictable = state is SlotState.READY and self._pins[slot] == 0
            assert (slot in self._evictable) == evictable, f"slot {slot} LRU membership"
            assert self._pins[slot] == sum(c.pins[slot] for c in self._clients.values())
            assert self._pins[slot] == 0 or state is SlotState.READY, f"slot {slot} pinned"
        assert all(self._in_state[s] == self._state.count(s) for s in SlotState)
        assert self._pinned == sum(1 for p in self._pins if p)
        writing = [s for c in self._clients.values() for s in c.writing]
        assert sorted(writing) == [s for s in range(self.num_slots)
                                   if self._state[s] is SlotState.WRITING]
