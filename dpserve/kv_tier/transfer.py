"""KV blocks between two hosts' stores: the destination's `PullJob`, the source's
`answer_fetch`. Both run inside a store's loop (`dpserve.kv_tier.server`), which
polls a job's socket beside its own; nothing here blocks.

Scope, one pull (a `Pull` from `dpserve.kv_tier.pull.pull` to the destination):
1. The job registers as a client of the destination's `TierStore` (its own name:
   everything it holds is dropped with it), pins the leading blocks the store
   holds (so its own reservations cannot evict them) and reserves the leading run
   of blocks it lacks (`reserve(leading=True)`: a block the store is writing, or
   no free slot, ends the run).
2. It asks the source for their bytes in `Fetch` chunks (`chunk_blocks`: at most
   `FETCH_BLOCKS` blocks, fewer when they would not fit in one message of
   `MAX_FRAME_BYTES`), at most `WINDOW` chunks in flight (back-pressure: the next
   goes out when one is answered), on one DEALER (CURVE with the data-plane
   secret) to the source's tcp:// endpoint; replies come back in order.
3. Each answered chunk is written into the reserved slots and committed. A chunk
   answered short (the source lacks a block, or evicted it meanwhile) ends the
   pull there; so do a refusal (another layout), a malformed answer and the
   deadline (`Pull.timeout_s`, capped at `MAX_PULL_S`: a dead or stopped source
   is a pull that ends at its deadline).
4. `finish`: the job's client is dropped (its pins released, its unwritten
   reservations freed) and the caller is told how many leading hashes the store
   holds now.

The source (`answer_fetch`): a Fetch with another layout is refused; else the
leading blocks it holds of the chunk are read-pinned, copied into the reply and
released before the reply leaves (the loop is single-threaded: no pin outlives
the call).

Not here: the loop and sockets of the store (`dpserve.kv_tier.server`), the
caller's side (`dpserve.kv_tier.pull`).
"""

from __future__ import annotations

import logging
import mmap
import time

import msgspec
import zmq

from dpserve.kv_tier.messages import Call, Fetch, Pull, Reply
from dpserve.kv_tier.store import TierStore
from dpserve.security import MAX_FRAME_BYTES, secure

logger = logging.getLogger(__name__)

FETCH_BLOCKS = 8  # blocks one Fetch asks for at most
WINDOW = 4  # Fetch chunks in flight per pull
MAX_PULLS = 8  # pulls in progress at one store; more are refused (the caller recomputes)
MAX_PULL_S = 60.0  # a pull's deadline, at most, whatever its caller asks
HEADROOM_BYTES = 64 << 10  # what a message holds besides its blocks (msgpack, hashes)
FETCH_CLIENT = "\x00fetch"  # the source's read pins, while it copies a chunk


def chunk_blocks(slot_bytes: int) -> int:
    """Blocks one Fetch may carry: `FETCH_BLOCKS`, fewer when they would pass
    `MAX_FRAME_BYTES`; 0 when not even one block fits in a message."""
    return min(FETCH_BLOCKS, max(0, (MAX_FRAME_BYTES - HEADROOM_BYTES) // slot_bytes))


def answer_fetch(store: TierStore, arena: mmap.mmap, seq: int, op: Fetch) -> tuple[Reply, int]:
    """The source's reply to a Fetch, and how many blocks it carries."""
    layout = store.layout
    if layout is None:  # no engine has connected: the store holds nothing
        return Reply(seq), 0
    if op.layout != layout:
        return Reply(seq, error=f"layout mismatch: this store holds blocks of "
                                f"'{layout.key}' ({layout.slot_bytes} bytes), the pull's "
                                f"are '{op.layout.key}' ({op.layout.slot_bytes} bytes)"), 0
    if len(op.hashes) > chunk_blocks(layout.slot_bytes):
        return Reply(seq, error=f"a fetch of {len(op.hashes)} blocks passes the message "
                                f"cap ({MAX_FRAME_BYTES} bytes)"), 0
    store.register(FETCH_CLIENT)
    try:
        slots = store.lookup(FETCH_CLIENT, op.hashes, count=False)
        size = layout.slot_bytes
        blocks = [arena[slot * size:(slot + 1) * size] for slot in slots]
    finally:
        store.drop_client(FETCH_CLIENT)  # its pins: none outlives the copy
    return Reply(seq, blocks=blocks), len(blocks)


class PullJob:
    """One pull at the destination store (module docstring). The store's loop calls
    `start`, then `on_readable` when `sock` has input, `expire` at `deadline`, and
    sends `finish()`'s reply to the caller."""

    def __init__(self, store: TierStore, arena: mmap.mmap, op: Pull, *, name: str,
                 caller: tuple[zmq.Socket, bytes, int], now: float) -> None:
        self.store = store
        self.arena = arena
        self.name = name  # its client name in `store`
        self.caller = caller  # (the socket it came on, the caller's identity, its seq)
        self.source = op.source
        self.hashes = op.hashes
        self.timeout_s = min(max(op.timeout_s, 0.0), MAX_PULL_S)
        self.started = now
        self.deadline = now + self.timeout_s
        self.sock: zmq.Socket | None = None
        self.error: str | None = None
        self.pulled = 0  # blocks written and committed
        self._chunks: list[list[tuple[bytes, int]]] = []  # [chunk] of (hash, slot)
        self._sent = 0  # chunks asked for
        self._answered = 0  # chunks answered (in order)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Reply)

    def start(self, ctx: zmq.Context, secret: str | None) -> bool:
        """Pin, reserve, send the first chunks; False when there is nothing to fetch
        (or it cannot start: `error` says why): `finish` at once."""
        assert self.store.layout is not None
        per_chunk = chunk_blocks(self.store.layout.slot_bytes)
        if per_chunk == 0:
            self.error = (f"a KV block of {self.store.layout.slot_bytes} bytes does not fit "
                          f"in one message ({MAX_FRAME_BYTES} bytes)")
            return False
        self.store.register(self.name)
        have = self.store.lookup(self.name, self.hashes, count=False)  # kept while it runs
        granted = list(self.store.reserve(self.name, self.hashes[len(have):],
                                          leading=True).items())
        if not granted:
            return False
        self._chunks = [granted[i:i + per_chunk] for i in range(0, len(granted), per_chunk)]
        try:
            self.sock = secure(ctx.socket(zmq.DEALER), "client", secret)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(self.source)
            self._fill()
        except zmq.ZMQError as e:
            self.error = f"cannot reach the source {self.source}: {e}"
            return False
        return True

    def _fill(self) -> None:
        """Ask for chunks until `WINDOW` are in flight or none is left."""
        assert self.sock is not None and self.store.layout is not None
        while self._sent < len(self._chunks) and self._sent - self._answered < WINDOW:
            hashes = [h for h, _ in self._chunks[self._sent]]
            self.sock.send(self._encoder.encode(Call(self._sent, Fetch(self.store.layout,
                                                                         hashes))),
                           flags=zmq.NOBLOCK)
            self._sent += 1

    def on_readable(self) -> bool:
        """Take the source's answers that came; True when the pull is over."""
        assert self.sock is not None
        while True:
            try:
                body = self.sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return False
            except zmq.ZMQError as e:
                self.error = f"the source's socket failed: {e}"
                return True
            try:
                reply = self._decoder.decode(body)
            except msgspec.DecodeError:
                self.error = "a malformed answer from the source"
                return True
            if reply.seq != self._answered:
                continue  # not an answer we wait for
            if self._take(reply):
                return True

    def _take(self, reply: Reply) -> bool:
        """Write and commit one answered chunk; True when the pull is over."""
        assert self.store.layout is not None
        if reply.error is not None:
            self.error = f"the source {self.source} refused: {reply.error}"
            return True
        chunk = self._chunks[self._answered]
        size = self.store.layout.slot_bytes
        blocks = reply.blocks
        if len(blocks) > len(chunk) or any(len(b) != size for b in blocks):
            self.error = "the source answered blocks of another size or count"
            return True
        for (_, slot), data in zip(chunk, blocks):
            self.arena[slot * size:(slot + 1) * size] = data
        self.store.commit(self.name, [h for h, _ in chunk[:len(blocks)]])
        self.pulled += len(blocks)
        self._answered += 1
        if len(blocks) < len(chunk) or self._answered == len(self._chunks):
            return True  # the source lacks the next block, or every chunk came
        self._fill()
        return False

    def expire(self) -> None:
        """The deadline passed: the pull ends with what came."""
        self.error = (f"no answer from the source {self.source} within {self.timeout_s:g} s "
                      f"({self.pulled} block(s) came)")

    def finish(self) -> Reply:
        """Drop the job's pins and unwritten reservations, close its socket; the reply
        to the caller (leading hashes held now, and why it ended early if it did)."""
        self.store.drop_client(self.name)
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        held = self.store.held(self.hashes)
        took = time.monotonic() - self.started
        if self.error is not None:
            logger.warning("pull from %s: %s; %d of %d block(s) held", self.source,
                           self.error, held, len(self.hashes))
        else:
            logger.debug("pulled %d block(s) from %s in %.3f s; %d of %d held", self.pulled,
                         self.source, took, held, len(self.hashes))
        return Reply(self.caller[2], error=self.error, held=held)
