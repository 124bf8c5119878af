"""`KVTierClient`: an engine core's client of its host's KV store. It never blocks for
long and never raises for a store problem.

Scope: one client per engine core (TP worker 0); the ops of
`dpserve.kv_tier.messages`, each one round trip bounded by `timeout_s`, while
which the store process's liveness is checked every `_SLICE_S`. A store that
does not answer in time, has exited or refuses the client makes the tier DOWN:
`arena_name` is None, every call is a miss (`lookup` -> [], `reserve` -> {})
or a no-op without any IO, and the first call after a back-off (0.5 s,
doubling to 5 s) says hello again, on a fresh socket (late replies to
abandoned calls are dropped by sequence number too). Each transition
is logged once.

A hello (the first, or after DOWN) registers the client by `name` (default:
"pid<pid>"; an engine passes its rank, so a restarted rank's hello drops what
its dead predecessor held) and drops its earlier pins and reservations at the
store; the client forgets them too, so a `release`, `commit` or `abort` of a
slot or hash from before it is ignored. A hello may name a new arena (a
restarted store: `generation` changes): the caller maps `arena_name` again
(`dpserve.kv_tier.arena.attach_arena`) and may keep the old mapping until its
copies from it are done.

Not here: what the engine does with the slots (`dpserve.engine`), the store
(`dpserve.kv_tier.server`).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

import msgspec
import psutil
import zmq

from dpserve.kv_tier.layout import TierLayout
from dpserve.kv_tier.messages import (
    Abort,
    Call,
    Commit,
    GetStats,
    Hello,
    Lookup,
    Op,
    Release,
    Reply,
    Reserve,
    TierStats,
)
from dpserve.security import secure

logger = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 5.0
_SLICE_S = 0.05  # while waiting for a reply: how often the store's liveness is checked


class KVTierClient:
    """See the module docstring. Thread-safe (one lock around each call)."""

    def __init__(self, address: str, layout: TierLayout, *, secret: str | None = None,
                 timeout_s: float = 1.0, name: str | None = None) -> None:
        layout.check()
        self.address = address
        self.layout = layout
        self.name = name or f"pid{os.getpid()}"
        self.timeout_s = timeout_s
        self.arena_name: str | None = None  # the mapped segment; None: the tier is down
        self.arena_bytes = 0
        self.num_slots = 0
        self.generation = -1  # the store's, as of the last hello
        self._secret = secret
        self._ctx = zmq.Context(io_threads=1)
        self._sock: zmq.Socket | None = None
        self._store: psutil.Process | None = None
        self._seq = 0
        self._pins: collections.Counter[int] = collections.Counter()  # slot -> our pins
        self._writing: set[bytes] = set()  # hashes we reserved, not yet committed
        self._backoff = FIRST_BACKOFF_S
        self._retry_at = 0.0
        self._up: bool | None = None  # None until the first hello's outcome
        self._closed = False
        self._lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Reply)
        with self._lock:
            self._hello()

    # ---- ops -------------------------------------------------------------------

    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """The slots of the leading `hashes` the tier holds, each pinned until
        `release`; [] when the tier is down."""
        hashes = list(hashes)
        with self._lock:
            reply = self._call(Lookup(hashes)) if hashes else None
            if reply is None:
                return []
            self._pins.update(reply.slots)
            return list(reply.slots)

    def release(self, slots: Iterable[int]) -> None:
        """Unpin `slots` (from `lookup`) once their copy is done."""
        with self._lock:
            mine = []
            for slot in slots:
                if self._pins[slot] > 0:
                    self._pins[slot] -= 1
                    mine.append(slot)
            self._pins += collections.Counter()  # drop zero counts
            if mine:
                self._call(Release(mine))

    def reserve(self, hashes: Iterable[bytes]) -> dict[bytes, int]:
        """hash -> slot to write, for those of `hashes` the tier does not hold (maybe
        fewer, when everything else is pinned); {} when the tier is down."""
        hashes = list(hashes)
        with self._lock:
            reply = self._call(Reserve(hashes)) if hashes else None
            if reply is None:
                return {}
            granted = dict(reply.reserved)
            self._writing.update(granted)
            return granted

    def commit(self, hashes: Iterable[bytes]) -> None:
        """Reserved `hashes` are written: other clients may read them now."""
        self._finish(hashes, Commit)

    def abort(self, hashes: Iterable[bytes]) -> None:
        """Reserved `hashes` were not written: their slots are free again."""
        self._finish(hashes, Abort)

    def _finish(self, hashes: Iterable[bytes], kind: type[Commit] | type[Abort]) -> None:
        with self._lock:
            mine = [h for h in hashes if h in self._writing]
            self._writing.difference_update(mine)
            if mine:
                self._call(kind(mine))

    def stats(self) -> dict[str, Any]:
        """The store's counts (`TierStats` fields) and "up"; zeros when down."""
        with self._lock:
            reply = self._call(GetStats())
        stats = reply.stats if reply is not None and reply.stats is not None else TierStats()
        return {"up": reply is not None, **msgspec.structs.asdict(stats)}

    def close(self) -> None:
        """Close the socket (idempotent); later calls are misses."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._drop_socket()
            self._ctx.term()

    # ---- the connection ------------------------------------------------------

    def _call(self, op: Op) -> Reply | None:
        """One round trip (the lock held); None when the tier is down or the call
        failed (then it is down)."""
        if self._closed or (self.arena_name is None and not self._hello()):
            return None
        reply = self._round_trip(op)
        if reply is None:
            return None
        if reply.need_hello:  # a store that does not know us: hello now, this call misses
            self._retry_at = 0.0
            self._forget()
            self._hello()
            return None
        if reply.error is not None:
            logger.warning("KV tier store refused %s: %s", type(op).__name__, reply.error)
            return None
        return reply

    def _hello(self) -> bool:
        """Say hello on a fresh socket, unless the back-off runs; True when up."""
        if self._closed or time.monotonic() < self._retry_at:
            return False
        self._drop_socket()
        self._forget()
        self._store = None  # a new store may answer (its pid comes in the reply)
        self._sock = secure(self._ctx.socket(zmq.DEALER), "client", self._secret)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.address)
        reply = self._round_trip(Hello(self.layout, self.name, os.getpid()))
        if reply is None:
            return False
        if reply.hello is None:
            self._down(reply.error or "no hello in the store's reply")
            return False
        h = reply.hello
        self.arena_name, self.arena_bytes = h.arena_name, h.arena_bytes
        self.num_slots, self.generation = h.num_slots, h.generation
        try:
            self._store = psutil.Process(h.store_pid)
        except psutil.NoSuchProcess:
            self._down("the store process exited")
            return False
        self._backoff = FIRST_BACKOFF_S
        if self._up is not True:
            logger.info("KV tier store at %s is up: generation %d, %d slots of %d bytes in "
                        "%s", self.address, h.generation, h.num_slots, self.layout.slot_bytes,
                        h.arena_name)
        self._up = True
        return True

    def _round_trip(self, op: Op) -> Reply | None:
        """Send `op`, wait up to `timeout_s` for its reply; None (down) on a timeout,
        a socket error or a store that exited meanwhile."""
        if self._store is not None and not _alive(self._store):
            self._down("the store process exited")
            return None
        assert self._sock is not None
        self._seq += 1
        try:
            self._sock.send(self._encoder.encode(Call(self._seq, op)), flags=zmq.NOBLOCK)
            deadline = time.monotonic() + self.timeout_s
            while (left := deadline - time.monotonic()) > 0:
                if self._sock.poll(min(left, _SLICE_S) * 1000):
                    reply = self._decoder.decode(self._sock.recv())
                    if reply.seq == self._seq:
                        return reply
                    continue  # a late reply to an abandoned call
                if self._store is not None and not _alive(self._store):
                    self._down("the store process exited")
                    return None
        except (zmq.ZMQError, msgspec.DecodeError) as e:
            self._down(f"{type(e).__name__}: {e}")
            return None
        self._down(f"no reply within {self.timeout_s:g} s")
        return None

    def _down(self, why: str) -> None:
        """The tier is down: misses until a hello after the back-off succeeds."""
        self._drop_socket()
        self._forget()
        self.arena_name = None
        self._store = None
        self._retry_at = time.monotonic() + self._backoff
        if self._up is not False:
            logger.warning("KV tier store at %s is down (%s): going on without it, "
                           "retrying in %.1f s", self.address, why, self._backoff)
        self._up = False
        self._backoff = min(MAX_BACKOFF_S, 2 * self._backoff)

    def _forget(self) -> None:
        """Our pins and reservations are void (a hello drops them at the store)."""
        self._pins.clear()
        self._writing.clear()

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


def _alive(proc: psutil.Process) -> bool:
    """Whether the store still runs (not exited, not a zombie, not a reused pid)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
