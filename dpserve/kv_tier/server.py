"""The `dpserve::KVStore` process: one per host, a ZMQ ROUTER over a `TierStore`.

Scope: `run_kv_store` (the process target) creates the arena its launcher named
(`dpserve.kv_tier.arena`), binds the ROUTER (a CURVE server when the data-plane
secret is set), and answers each client's `Call` with a `Reply` in order, one
at a time (every op is a few dict operations: no op waits on another).
Clients are named in their hello; every `CLIENT_SWEEP_S` the store drops the
pins and reservations of clients whose process is gone (a rank that died).

Lifecycle: SIGTERM (or the launcher's death, through the parent watch) ->
the loop ends, the arena is unlinked, exit 0; SIGINT is ignored (Ctrl-C
reaches the process group: the launcher decides); a failure -> the arena is
unlinked, exit 1. A SIGKILL leaves the arena: the launcher unlinks it.

Not here: the index itself (`dpserve.kv_tier.store`), starting and restarting
the process (`dpserve.launch.kv_store`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import msgspec
import psutil
import zmq

from dpserve.kv_tier.arena import create_arena, unlink_arena
from dpserve.kv_tier.messages import (
    Abort,
    Call,
    Commit,
    GetStats,
    Hello,
    HelloReply,
    Lookup,
    Release,
    Reply,
    Reserve,
)
from dpserve.kv_tier.store import LayoutError, TierStore, UnknownClient
from dpserve.logging_utils import name_process
from dpserve.parent_watch import start_parent_watcher
from dpserve.security import secure

logger = logging.getLogger(__name__)

CLIENT_SWEEP_S = 1.0  # how often clients whose process is gone are dropped
_BATCH = 64  # messages handled per wake-up before the stop flag is looked at again


class KVStoreServer:
    """The store's socket and loop; `request_stop` (a signal handler) ends `run`."""

    def __init__(self, address: str, arena_name: str, arena_bytes: int, generation: int,
                 secret: str | None = None) -> None:
        self.store = TierStore(arena_bytes, generation)
        self.arena_name = arena_name
        self.stop_requested = False
        self._names: dict[bytes, str] = {}  # connection identity -> client name
        self._pids: dict[str, int] = {}  # client name -> its process
        self._decoder = msgspec.msgpack.Decoder(Call)
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._sock = secure(self._ctx.socket(zmq.ROUTER), "server", secret)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def request_stop(self, signum: int = signal.SIGTERM, frame: object = None) -> None:
        self.stop_requested = True
        try:
            os.write(self._wake_w, b"!")
        except OSError:
            pass

    def run(self) -> None:
        """Serve until `request_stop`."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_sweep = time.monotonic() + CLIENT_SWEEP_S
        while not self.stop_requested:
            ready = dict(poller.poll(timeout=CLIENT_SWEEP_S * 1000))
            if self._wake_r in ready:
                _drain(self._wake_r)
            if self._sock in ready:
                self._serve_batch()
            if time.monotonic() >= next_sweep:
                self._sweep_clients()
                next_sweep = time.monotonic() + CLIENT_SWEEP_S

    def _serve_batch(self) -> None:
        for _ in range(_BATCH):
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                continue  # not a client of ours
            identity, body = frames
            try:
                call = self._decoder.decode(body)
            except msgspec.DecodeError:
                logger.warning("dropped a malformed message (%d bytes)", len(body))
                continue
            reply = self.handle(identity, call)
            try:
                self._sock.send_multipart([identity, self._encoder.encode(reply)],
                                          flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the client is gone or not reading: it times out and says hello again

    def handle(self, identity: bytes, call: Call) -> Reply:
        """One call of connection `identity` -> its reply."""
        op, seq = call.op, call.seq
        if isinstance(op, Hello):
            return self._hello(identity, op, seq)
        if isinstance(op, GetStats):  # anyone's: the launcher's readiness probe, metrics
            return Reply(seq, stats=self.store.stats())
        name = self._names.get(identity)
        if name is None:
            return Reply(seq, error="hello first", need_hello=True)
        try:
            if isinstance(op, Lookup):
                return Reply(seq, slots=self.store.lookup(name, op.hashes))
            if isinstance(op, Release):
                self.store.release(name, op.slots)
            elif isinstance(op, Reserve):
                return Reply(seq, reserved=list(self.store.reserve(name, op.hashes).items()))
            elif isinstance(op, Commit):
                self.store.commit(name, op.hashes)
            elif isinstance(op, Abort):
                self.store.abort(name, op.hashes)
        except UnknownClient:  # dropped by the sweep meanwhile
            self._names.pop(identity, None)
            return Reply(seq, error="hello first", need_hello=True)
        return Reply(seq)

    def _hello(self, identity: bytes, op: Hello, seq: int) -> Reply:
        try:
            num_slots = self.store.hello(op.name, op.layout)
        except LayoutError as e:
            logger.error("refused client %s (pid %d): %s", op.name, op.pid, e)
            return Reply(seq, error=str(e))
        for old in [i for i, n in self._names.items() if n == op.name]:
            del self._names[old]  # its earlier connection: its pins went with the hello
        self._names[identity] = op.name
        self._pids[op.name] = op.pid
        logger.info("client %s (pid %d) connected: %d slots of %d bytes", op.name, op.pid,
                    num_slots, op.layout.slot_bytes)
        return Reply(seq, hello=HelloReply(self.arena_name, self.store.arena_bytes, num_slots,
                                           self.store.generation, os.getpid()))

    def _sweep_clients(self) -> None:
        """Drop the clients whose process has exited."""
        for name, pid in list(self._pids.items()):
            if _alive(pid):
                continue
            pins, writes = self.store.drop_client(name)
            del self._pids[name]
            for identity in [i for i, n in self._names.items() if n == name]:
                del self._names[identity]
            logger.info("client %s (pid %d) is gone: dropped its %d pin(s) and %d "
                        "reservation(s)", name, pid, pins, writes)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)


def _drain(fd: int) -> None:
    try:
        os.read(fd, 512)
    except BlockingIOError:
        pass


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_kv_store(address: str, arena_name: str, arena_bytes: int, generation: int,
                 parent_pid: int, secret: str | None = None) -> None:
    """Process target: exit 0 on SIGTERM or the parent's death, 1 on a failure; the
    arena is unlinked either way."""
    name_process("KVStore")
    server: KVStoreServer | None = None
    stop = {"asked": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(asked=True))  # until the loop's
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    start_parent_watcher(parent_pid, "the KV store")
    exit_code = 0
    try:
        create_arena(arena_name, arena_bytes)
        server = KVStoreServer(address, arena_name, arena_bytes, generation, secret)
        signal.signal(signal.SIGTERM, server.request_stop)  # sets the flag, wakes the loop
        if stop["asked"]:
            server.request_stop()
        logger.info("KV store generation %d: %d bytes in %s, serving at %s", generation,
                    arena_bytes, arena_name, address)
        server.run()
    except Exception:
        logger.exception("KV store failed")
        exit_code = 1
    finally:
        unlink_arena(arena_name)
        if server is not None:
            server.close()
    logger.info("KV store exiting (code %d)", exit_code)
    sys.exit(exit_code)
