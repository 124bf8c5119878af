"""The coordinator's relay of API servers' prefix facts (`PrefixFacts`).

Scope: `PrefixRelay.on_frame`, called by the coordinator's loop for every
message a front-end sends: a `PrefixFacts` (told apart by its first bytes, no
decoding) is checked against the caps and relayed to every front-end at once as
a `CoordinatorUpdate` carrying it (`prefixes`, with the current wave news);
anything else is left to the loop. The sender skips its own facts.

Bounded work per message, never a wait: a body over `MAX_FACTS_BYTES` is dropped
before it is decoded; an undecodable one, one with more than
`protocol.MAX_PREFIX_FACTS` hashes, ranks out of range or hashes over
`MAX_HASH_BYTES` is dropped after; the relay is one non-blocking XPUB send (ZMQ
drops it for a subscriber whose queue is full). Each API server sends at most one
message per `dpserve.frontend.prefix_record.SHARE_INTERVAL_S`. Drops are counted and logged
sparsely (`dropped`). Nothing is kept: a restarted coordinator relays what comes
after it.

Not here: what the facts mean and who makes them (`dpserve.frontend.prefix_record`),
the loop (`dpserve.launch.coordinator.proc`).
"""

from __future__ import annotations

import logging

import msgspec
import zmq

from dpserve.protocol import MAX_PREFIX_FACTS, CoordinatorUpdate, PrefixFacts

logger = logging.getLogger("dpserve.launch.coordinator")

MAX_HASH_BYTES = 64  # a block hash is 32 bytes (sha256)
# The largest body relayed: MAX_PREFIX_FACTS hashes of 32 bytes, with room for the
# msgpack headers of each hash and run.
MAX_FACTS_BYTES = MAX_PREFIX_FACTS * 40 + 4096
# How a PrefixFacts body starts: a msgpack fixarray of its fields, then its tag.
_TAG = msgspec.msgpack.encode("prefixes")


def is_prefix_facts(body: bytes) -> bool:
    """Whether a front-end's message is a `PrefixFacts` (its first bytes only)."""
    return body[:1] >= b"\x90" and body[:1] <= b"\x9f" and body[1:1 + len(_TAG)] == _TAG


class PrefixRelay:
    """Relays `PrefixFacts` on the coordinator's front XPUB (module docstring)."""

    def __init__(self, front: zmq.Socket) -> None:
        self.front = front
        self._decoder = msgspec.msgpack.Decoder(PrefixFacts)
        self.relayed = 0  # messages relayed
        self.dropped = 0  # messages dropped (over a cap, malformed)

    def on_frame(self, body: bytes, num_ranks: int, wave: int, running: bool) -> bool:
        """True when `body` was a `PrefixFacts` (relayed or dropped); False: another
        message, for the loop. `num_ranks`: the ranks there are now; `wave`, `running`:
        the coordinator's wave news, which every update carries."""
        if not is_prefix_facts(body):
            return False
        facts = self._valid(body, num_ranks)
        if facts is None:
            self.dropped += 1
            if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                logger.warning("prefix facts: %d bad or oversized message(s) dropped so far "
                               "(the last %d bytes)", self.dropped, len(body))
            return True
        update = CoordinatorUpdate(None, wave, running, prefixes=facts)
        try:
            self.front.send(msgspec.msgpack.encode(update), zmq.NOBLOCK)
            self.relayed += 1
        except zmq.Again:  # (XPUB drops rather than blocks; kept for any other socket)
            self.dropped += 1
        return True

    def _valid(self, body: bytes, num_ranks: int) -> PrefixFacts | None:
        if len(body) > MAX_FACTS_BYTES:
            return None
        try:
            facts = self._decoder.decode(body)
        except msgspec.DecodeError:
            return None
        if (len(facts.ranks) != len(facts.blocks)
                or sum(len(run) for run in facts.blocks) > MAX_PREFIX_FACTS
                or not all(0 <= rank < num_ranks for rank in facts.ranks)
                or any(len(h) > MAX_HASH_BYTES for run in facts.blocks for h in run)):
            return None
        return facts
