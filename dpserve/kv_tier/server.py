"""The `dpserve::KVStore` process: one per host, a ZMQ ROUTER over a `TierStore`.

Scope: `run_kv_store` (the process target) creates the arena its launcher named
(`dpserve.kv_tier.arena`) and maps it, binds the ROUTER (a CURVE server when the
data-plane secret is set), and answers each client's `Call` with a `Reply` in
order, one at a time (every op is a few dict operations: no op waits on another).
Clients are named in their hello; every `CLIENT_SWEEP_S` the store drops the
pins and reservations of clients whose process is gone (a rank that died).

A store of a server that spans hosts also binds a second ROUTER on a tcp://
address of its host (`remote_address`; same CURVE keys): other hosts reach it
there for `Pull`, `Fetch` and `GetStats` only (the other ops name slots of an
arena only this host can map). A `Pull` is answered when its `PullJob`
(`dpserve.kv_tier.transfer`) ends: the loop polls each job's socket beside its
own and ends a job at its deadline; at most `MAX_PULLS` run at once.

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

from dpserve.kv_tier.arena import create_arena, map_arena, unlink_arena
from dpserve.kv_tier.messages import (
    Abort,
    Call,
    Commit,
    Fetch,
    GetStats,
    Hello,
    HelloReply,
    Lookup,
    Pull,
    Release,
    Reply,
    Reserve,
)
from dpserve.kv_tier.store import LayoutError, TierStore, UnknownClient
from dpserve.kv_tier.transfer import MAX_PULLS, PullJob, answer_fetch
from dpserve.logging_utils import name_process
from dpserve.parent_watch import start_parent_watcher
from dpserve.security import secure

logger = logging.getLogger(__name__)

CLIENT_SWEEP_S = 1.0  # how often clients whose process is gone are dropped
_BATCH = 64  # messages handled per wake-up before the stop flag is looked at again
_REMOTE_OPS = (Pull, Fetch, GetStats)  # what the tcp:// endpoint answers


class KVStoreServer:
    """The store's sockets and loop; `request_stop` (a signal handler) ends `run`."""

    def __init__(self, address: str, arena_name: str, arena_bytes: int, generation: int,
                 secret: str | None = None, remote_address: str | None = None) -> None:
        self.store = TierStore(arena_bytes, generation)
        self.arena_name = arena_name
        self.arena = map_arena(arena_name, arena_bytes)
        self.stop_requested = False
        self._secret = secret
        self._names: dict[bytes, str] = {}  # connection identity -> client name
        self._pids: dict[str, int] = {}  # client name -> its process
        self._refused: set[tuple[str, str]] = set()  # (client, layout key) refused: logged
        self._decoder = msgspec.msgpack.Decoder(Call)
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._sock = self._router(address)
        self._remote = self._router(remote_address) if remote_address else None
        self._jobs: list[PullJob] = []  # pulls in progress (destination side)
        self._job_count = 0
        self._moved = {"pulled": 0, "sent": 0}  # blocks, for the stats
        self._poller = zmq.Poller()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def _router(self, address: str) -> zmq.Socket:
        sock = secure(self._ctx.socket(zmq.ROUTER), "server", self._secret)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        return sock

    def request_stop(self, signum: int = signal.SIGTERM, frame: object = None) -> None:
        self.stop_requested = True
        try:
            os.write(self._wake_w, b"!")
        except OSError:
            pass

    def run(self) -> None:
        """Serve until `request_stop`."""
        sockets = [s for s in (self._sock, self._remote) if s is not None]
        for sock in (*sockets, self._wake_r):
            self._poller.register(sock, zmq.POLLIN)
        next_sweep = time.monotonic() + CLIENT_SWEEP_S
        while not self.stop_requested:
            wait = min([next_sweep, *(j.deadline for j in self._jobs)]) - time.monotonic()
            ready = dict(self._poller.poll(timeout=max(0.0, wait) * 1000))
            if self._wake_r in ready:
                _drain(self._wake_r)
            for sock in sockets:
                if sock in ready:
                    self._serve_batch(sock)
            self._step_jobs(ready)
            if time.monotonic() >= next_sweep:
                self._sweep_clients()
                next_sweep = time.monotonic() + CLIENT_SWEEP_S

    def _serve_batch(self, sock: zmq.Socket) -> None:
        for _ in range(_BATCH):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
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
            if sock is self._remote and not isinstance(call.op, _REMOTE_OPS):
                reply: Reply | None = Reply(call.seq, error=f"{type(call.op).__name__} is "
                                            f"not answered on the tcp:// endpoint")
            elif isinstance(call.op, Pull):
                reply = self._start_pull(sock, identity, call.seq, call.op)
            else:
                reply = self.handle(identity, call)
            if reply is not None:
                _send(sock, identity, self._encoder.encode(reply))

    def handle(self, identity: bytes, call: Call) -> Reply:
        """One call of connection `identity` -> its reply (a Pull's: `_start_pull`)."""
        op, seq = call.op, call.seq
        if isinstance(op, Hello):
            return self._hello(identity, op, seq)
        if isinstance(op, GetStats):  # anyone's: the launcher's readiness probe, metrics
            return Reply(seq, stats=msgspec.structs.replace(
                self.store.stats(), pulls=len(self._jobs), **self._moved))
        if isinstance(op, Fetch):  # another host's store pulling from this one
            reply, sent = answer_fetch(self.store, self.arena, seq, op)
            self._moved["sent"] += sent
            return reply
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

    # ---- pulls (destination side) ----------------------------------------------

    def _start_pull(self, sock: zmq.Socket, identity: bytes, seq: int, op: Pull
                    ) -> Reply | None:
        """Start a `PullJob`; its reply comes when it ends (None now), or at once when
        it is refused or has nothing to fetch."""
        if self.store.layout is None:
            return Reply(seq, error="this store holds no blocks yet (no engine has "
                                    "connected: its layout is unknown)")
        if not op.source.startswith("tcp://"):
            return Reply(seq, error=f"a pull's source must be a tcp:// address, got "
                                    f"{op.source!r}", held=self.store.held(op.hashes))
        if len(self._jobs) >= MAX_PULLS:
            return Reply(seq, error=f"busy: {MAX_PULLS} pulls in progress",
                         held=self.store.held(op.hashes))
        self._job_count += 1
        job = PullJob(self.store, self.arena, op, name=f"\x00pull{self._job_count}",
                      caller=(sock, identity, seq), now=time.monotonic())
        if not job.start(self._ctx, self._secret):
            return job.finish()
        assert job.sock is not None
        self._jobs.append(job)
        self._poller.register(job.sock, zmq.POLLIN)
        return None

    def _step_jobs(self, ready: dict) -> None:
        """Feed each job the answers that came; end those done or past their deadline."""
        now = time.monotonic()
        for job in list(self._jobs):
            if job.sock in ready and job.on_readable():
                self._end_job(job)
            elif now >= job.deadline:
                job.expire()
                self._end_job(job)

    def _end_job(self, job: PullJob) -> None:
        self._jobs.remove(job)
        self._poller.unregister(job.sock)
        reply = job.finish()
        self._moved["pulled"] += job.pulled
        sock, identity, _ = job.caller
        _send(sock, identity, self._encoder.encode(reply))

    def _hello(self, identity: bytes, op: Hello, seq: int) -> Reply:
        try:
            num_slots = self.store.hello(op.name, op.layout)
        except LayoutError as e:
            if (op.name, op.layout.key) not in self._refused:  # it says hello again later
                self._refused.add((op.name, op.layout.key))
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
        for job in self._jobs:  # their callers time out; their state goes with the store
            if job.sock is not None:
                job.sock.close(linger=0)
        self._sock.close(linger=0)
        if self._remote is not None:
            self._remote.close(linger=0)
        self._ctx.term()
        self.arena.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


def _send(sock: zmq.Socket, identity: bytes, body: bytes) -> None:
    try:
        sock.send_multipart([identity, body], flags=zmq.NOBLOCK)
    except zmq.ZMQError:
        pass  # the client is gone or not reading: it times out (and says hello again)


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
                 parent_pid: int, secret: str | None = None,
                 remote_address: str | None = None) -> None:
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
        server = KVStoreServer(address, arena_name, arena_bytes, generation, secret,
                               remote_address)
        signal.signal(signal.SIGTERM, server.request_stop)  # sets the flag, wakes the loop
        if stop["asked"]:
            server.request_stop()
        logger.info("KV store generation %d: %d bytes in %s, serving at %s%s", generation,
                    arena_bytes, arena_name, address,
                    f" and {remote_address}" if remote_address else "")
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
