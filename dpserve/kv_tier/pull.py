"""`pull`: have one host's KV store fetch blocks from another's (a front-end's call).

Scope: one bounded round trip to the destination store's tcp:// endpoint (CURVE
with the data-plane secret): a `Pull` naming the source store and the block
hashes, answered when the destination's pull ends (`dpserve.kv_tier.transfer`:
the destination reserves what it lacks, fetches it from the source in chunks with
a bounded window, commits it, and says how many leading hashes it holds). The
destination gets a deadline a little shorter than `timeout`, so its answer comes
back in time and nothing of the pull outlives it there. Never raises for a store
problem: a refused, failed or unanswered pull returns what the destination said
it holds (0 when it said nothing), and logs why.

Not here: which stores (a front-end knows each rank's store address from its
heartbeats: `EngineInfo.kv_store_address`, `RankTable.store_address_of`), the
transfer itself (`dpserve.kv_tier.transfer`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import msgspec
import zmq
import zmq.asyncio

from dpserve.kv_tier.messages import Call, Pull, Reply
from dpserve.security import MAX_FRAME_BYTES, derive_keys, secure

logger = logging.getLogger(__name__)

REPLY_MARGIN_S = 0.5  # of the caller's timeout, kept for the answer's way back (at most)
MAX_HASHES = (MAX_FRAME_BYTES - (64 << 10)) // 40  # a Pull fits in one message


async def pull(dst: str, src: str, hashes: Sequence[bytes], *, secret: str | None,
               timeout: float, context: zmq.asyncio.Context | None = None) -> int:
    """Have the store at `dst` (tcp://) fetch the leading `hashes` it lacks from the
    store at `src` (tcp://) within `timeout` seconds; how many leading `hashes` it
    holds then (0 when it cannot say). `context`: a zmq.asyncio context to use (else
    one of its own for this call)."""
    hashes = list(hashes)[:MAX_HASHES]
    if not hashes or timeout <= 0:
        return 0
    if secret is not None:  # the key derivation (scrypt, once per process) off the loop
        await asyncio.to_thread(derive_keys, secret)
    ctx = context or zmq.asyncio.Context(io_threads=1)
    sock = secure(ctx.socket(zmq.DEALER), "client", secret)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        return await _round_trip(sock, dst, Pull(src, hashes, _store_budget(timeout)),
                                 timeout)
    finally:
        sock.close(linger=0)
        if context is None:
            ctx.term()


def _store_budget(timeout: float) -> float:
    """The destination's deadline: `timeout` less the margin for its answer."""
    return max(0.0, timeout - min(REPLY_MARGIN_S, timeout / 5))


async def _round_trip(sock: zmq.asyncio.Socket, dst: str, op: Pull, timeout: float) -> int:
    try:
        sock.connect(dst)
        await sock.send(msgspec.msgpack.encode(Call(1, op)), flags=zmq.NOBLOCK)
        body = await asyncio.wait_for(sock.recv(), timeout)
        reply = msgspec.msgpack.decode(body, type=Reply)
    except (TimeoutError, asyncio.TimeoutError):
        logger.warning("KV pull %s <- %s: no answer from %s within %g s", dst, op.source,
                       dst, timeout)
        return 0
    except (zmq.ZMQError, msgspec.DecodeError) as e:
        logger.warning("KV pull %s <- %s failed: %s: %s", dst, op.source, type(e).__name__, e)
        return 0
    if reply.error is not None:
        logger.warning("KV pull %s <- %s: %s (%d of %d block(s) held)", dst, op.source,
                       reply.error, reply.held, len(op.hashes))
    return reply.held
