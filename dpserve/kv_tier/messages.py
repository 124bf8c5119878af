"""The KV store's wire messages: a client's `Call` (sequence number + one op), the
store's `Reply`. msgpack via msgspec, no pickle; one frame each way over a DEALER ->
ROUTER pair.

Ops are batched (a list of hashes or slots per call): an engine makes at most one
call of each kind per step. A hash is a block's 32-byte sha256 (the engine's
`request.block_hashes`); a slot is an index into the arena, in units of the
layout's `slot_bytes`.

Pull and Fetch move blocks between two hosts' stores (over their tcp://
endpoints): a caller asks the destination to `Pull`; the destination asks the
source for the bytes in `Fetch` chunks (`dpserve.kv_tier.transfer`).

Not here: what the ops do (`dpserve.kv_tier.store`).
"""

from __future__ import annotations

import msgspec

from dpserve.kv_tier.layout import TierLayout

_OP = dict(array_like=True, gc=False)


class Hello(msgspec.Struct, tag="hello", **_OP):
    """Register (or re-register) client `name` of process `pid`: its earlier pins and
    reservations, under any connection, are dropped."""

    layout: TierLayout
    name: str
    pid: int


class Lookup(msgspec.Struct, tag="lookup", **_OP):
    hashes: list[bytes]  # a request's next block hashes, in order


class Release(msgspec.Struct, tag="release", **_OP):
    slots: list[int]  # slots a Lookup pinned, once their copy is done


class Reserve(msgspec.Struct, tag="reserve", **_OP):
    hashes: list[bytes]  # full blocks the caller offers to write


class Commit(msgspec.Struct, tag="commit", **_OP):
    hashes: list[bytes]  # reserved blocks now written: READY


class Abort(msgspec.Struct, tag="abort", **_OP):
    hashes: list[bytes]  # reserved blocks that were not written: FREE


class GetStats(msgspec.Struct, tag="stats", **_OP):
    pass


class Pull(msgspec.Struct, tag="pull", **_OP):
    """To a destination store: fetch the leading `hashes` it lacks from the store at
    `source` (its tcp:// address), within `timeout_s`; the reply's `held` says how many
    leading `hashes` it holds then (`dpserve.kv_tier.transfer`)."""

    source: str
    hashes: list[bytes]
    timeout_s: float


class Fetch(msgspec.Struct, tag="fetch", **_OP):
    """Destination -> source store: the bytes of the leading `hashes` the source holds
    (at most the chunk that fits one message); refused unless `layout` is the
    source's."""

    layout: TierLayout
    hashes: list[bytes]


Op = Hello | Lookup | Release | Reserve | Commit | Abort | GetStats | Pull | Fetch


class Call(msgspec.Struct, array_like=True, gc=False):
    seq: int  # echoed in the reply: a late reply to an abandoned call is dropped
    op: Op


class HelloReply(msgspec.Struct, array_like=True, gc=False):
    arena_name: str  # the segment to map (`dpserve.kv_tier.arena.attach_arena`)
    arena_bytes: int
    num_slots: int
    generation: int  # one per store start: a new one means a new arena
    store_pid: int  # the store process (clients check it is alive while they wait)


class TierStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The store's counts; blocks unless named bytes."""

    generation: int = -1
    num_slots: int = 0
    slot_bytes: int = 0
    ready: int = 0  # slots holding a block
    writing: int = 0  # slots reserved, not committed
    pinned: int = 0  # slots read-pinned by a lookup
    clients: int = 0
    queries: int = 0  # hashes looked up
    hits: int = 0  # of them found (leading READY ones)
    saved: int = 0  # blocks committed
    evictions: int = 0  # READY blocks evicted for a reservation
    pulled: int = 0  # blocks written by pulls from other stores
    sent: int = 0  # blocks sent to other stores' pulls
    pulls: int = 0  # pulls in progress here (destination side)


class Reply(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    seq: int
    error: str | None = None  # the call was refused (the message says why)
    need_hello: bool = False  # the store does not know this connection: hello first
    slots: list[int] = []  # Lookup: pinned slots of the leading hits
    reserved: list[tuple[bytes, int]] = []  # Reserve: (hash, slot) granted
    hello: HelloReply | None = None
    stats: TierStats | None = None
    held: int = 0  # Pull: leading hashes the store holds now
    blocks: list[bytes] = []  # Fetch: the leading held hashes' slot bytes, in order
