"""The lockstep DP group's rendezvous store, over ZMQ (CURVE with a secret).

Scope: gloo needs a key-value store to exchange its pairs' addresses when a
DP group generation forms. torch's `TCPStore` cannot carry that safely: its
server listens on every interface whatever host it is given, and anyone who
reaches it can read or overwrite keys (poison the rendezvous, join the group).
So the coordinator serves `DPStoreServer` (a ROUTER bound to the configured
address only; a CURVE server with `--data-parallel-secret`, like every other
data-plane socket) and each engine talks to it through `ZmqStore`, a
`torch.distributed.Store` subclass. Without the secret a peer cannot complete
the CURVE handshake, so it can neither read the group's addresses nor write
its own.

    client DEALER  --[StoreRequest]-->  server ROUTER (one thread, a dict)
                   <--[StoreReply]---   (GET and WAIT are answered when the keys
                                         exist, or an error at their deadline)

Invariants: a request carries a sequence number and a client takes only the
reply to its last request (a late reply to one it gave up on is dropped);
every client wait is bounded by the store timeout (the coordinator may be
gone: the group join then fails and is reported, as a torch timeout would).

`gloo_device(master_ip)` picks the address gloo's own listener binds to: the
local interface that routes to the store's host (127.0.0.1 on one host),
never every interface. Not here: gloo's pair traffic itself (plain TCP
between the members; keep multi-host lockstep on a private network).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from typing import Any

import msgspec
import torch.distributed as dist
import zmq

from dpserve.security import address_towards, secure

logger = logging.getLogger(__name__)

_OPS = ("set", "get", "add", "check", "wait", "compare_set", "delete_key", "num_keys")
MAX_KEYS = 1 << 16  # a store with this many keys refuses new ones (a runaway peer)
# Keys of group generation g start with f"{GROUP_PREFIX}{g}/" (`DPLink` prefixes them);
# the server drops those of generations older than the one before the newest written.
GROUP_PREFIX = "dpserve-dp/"


class StoreRequest(msgspec.Struct, array_like=True, gc=False):
    seq: int
    op: str  # one of _OPS
    keys: list[str]  # set/get/add/compare_set/delete_key: one; check/wait: several
    value: bytes = b""  # set: the value; compare_set: the desired value
    expected: bytes = b""  # compare_set
    amount: int = 0  # add
    timeout_ms: int = 0  # get/wait: how long the server holds the request


class StoreReply(msgspec.Struct, array_like=True, gc=False):
    seq: int
    error: str = ""  # "" on success; "timeout" or a reason
    value: bytes = b""  # get, compare_set
    number: int = 0  # add, num_keys, delete_key/check (0/1)


class DPStoreServer:
    """The store's server: a thread with a ROUTER bound at `address` (tcp://host:port)
    and a dict. `close()` stops it (idempotent)."""

    def __init__(self, address: str, secret: str | None) -> None:
        self._ctx = zmq.Context()
        self._sock = secure(self._ctx.socket(zmq.ROUTER), "server", secret)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(address)  # fails here, in the caller, if the port is taken
        except zmq.ZMQError:
            self._sock.close()
            self._ctx.term()
            raise
        self.address = address
        self._data: dict[str, bytes] = {}
        self._newest = 0  # the newest group generation a key was written for
        self._waiting: list[tuple[float, bytes, StoreRequest]] = []  # (deadline, peer, req)
        self._decoder = msgspec.msgpack.Decoder(StoreRequest)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dp-store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(5)
            self._ctx.destroy(linger=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            # 1. wait for a request, at most until the nearest held request's deadline
            now = time.monotonic()
            nearest = min((d for d, _, _ in self._waiting), default=now + 0.2)
            if self._sock.poll(max(1, min(200, int((nearest - now) * 1000) + 1))):
                frames = self._sock.recv_multipart()
                request = self._decode(frames)
                if request is not None:
                    self._handle(frames[0], request)
            # 2. answer the held GET/WAITs whose keys came, or whose deadline passed
            self._answer_waiting(time.monotonic())

    def _decode(self, frames: list[bytes]) -> StoreRequest | None:
        try:
            if len(frames) != 2:
                raise ValueError(f"{len(frames)} frames")
            request = self._decoder.decode(frames[1])
            if request.op not in _OPS or not request.keys and request.op != "num_keys":
                raise ValueError(f"op {request.op!r} with {len(request.keys)} keys")
            return request
        except (msgspec.DecodeError, ValueError) as e:
            logger.warning("DP store: dropped a malformed request (%s)", e)
            return None

    def _reply(self, peer: bytes, reply: StoreReply) -> None:
        self._sock.send_multipart([peer, msgspec.msgpack.encode(reply)])

    def _handle(self, peer: bytes, req: StoreRequest) -> None:
        data, key = self._data, req.keys[0] if req.keys else ""
        if req.op in ("get", "wait"):
            self._waiting.append((time.monotonic() + req.timeout_ms / 1000, peer, req))
            return
        new = req.op in ("set", "add", "compare_set") and key not in data
        if new:
            self._prune(key)
        if new and len(data) >= MAX_KEYS:
            self._reply(peer, StoreReply(req.seq, error=f"store full ({MAX_KEYS} keys)"))
            return
        reply = StoreReply(req.seq)
        if req.op == "set":
            data[key] = req.value
        elif req.op == "add":
            reply.number = int(data.get(key, b"0")) + req.amount
            data[key] = str(reply.number).encode()
        elif req.op == "compare_set":
            current = data.get(key)
            if (current is None and req.expected == b"") or current == req.expected:
                data[key] = current = req.value
            reply.value = req.expected if current is None else current
        elif req.op == "check":
            reply.number = int(all(k in data for k in req.keys))
        elif req.op == "delete_key":
            reply.number = int(data.pop(key, None) is not None)
        else:  # num_keys
            reply.number = len(data)
        self._reply(peer, reply)

    def _prune(self, key: str) -> None:
        """A key of a newer generation: forget those of generations before the last."""
        generation = _generation(key)
        if generation is not None and generation > self._newest:
            self._newest = generation
            stale = [k for k in self._data
                     if (g := _generation(k)) is not None and g < generation - 1]
            for old in stale:
                del self._data[old]

    def _answer_waiting(self, now: float) -> None:
        held = []
        for deadline, peer, req in self._waiting:
            if all(k in self._data for k in req.keys):
                value = self._data[req.keys[0]] if req.op == "get" else b""
                self._reply(peer, StoreReply(req.seq, value=value))
            elif now >= deadline:
                self._reply(peer, StoreReply(req.seq, error="timeout"))
            else:
                held.append((deadline, peer, req))
        self._waiting = held


class ZmqStore(dist.Store):
    """A `torch.distributed.Store` served by `DPStoreServer` at `address`. Every call
    waits at most `timeout` (then raises RuntimeError, as torch's stores do). Keep a
    Python reference for as long as torch uses it (its methods live on this object)."""

    def __init__(self, address: str, secret: str | None,
                 timeout: datetime.timedelta) -> None:
        super().__init__()
        self._timeout_s = timeout.total_seconds()
        self._ctx = zmq.Context()
        self._sock = secure(self._ctx.socket(zmq.DEALER), "client", secret)
        self._sock.setsockopt(zmq.LINGER, 0)
        # No peer (the coordinator gone, or refusing our keys): a send fails, not blocks.
        self._sock.setsockopt(zmq.SNDTIMEO, max(1, int(self._timeout_s * 1000)))
        self._sock.connect(address)
        self.address = address
        self._seq = 0
        self._lock = threading.Lock()  # one request at a time
        self._decoder = msgspec.msgpack.Decoder(StoreReply)

    def close(self) -> None:
        self._ctx.destroy(linger=0)

    def _call(self, op: str, keys: list[str], hold_s: float = 0.0, **fields: Any) -> StoreReply:
        with self._lock:
            self._seq += 1
            request = StoreRequest(self._seq, op, keys, timeout_ms=int(hold_s * 1000),
                                   **fields)
            deadline = time.monotonic() + hold_s + self._timeout_s
            try:
                self._sock.send(msgspec.msgpack.encode(request))
            except zmq.Again:
                deadline = 0.0  # never sent: no peer took it in time
            while (left := deadline - time.monotonic()) > 0:
                if not self._sock.poll(max(1, int(left * 1000))):
                    break
                try:
                    reply = self._decoder.decode(self._sock.recv())
                except msgspec.DecodeError:
                    continue
                if reply.seq != self._seq:
                    continue  # the late answer to a request we gave up on
                if reply.error:
                    raise RuntimeError(f"DP store {op} {keys[:2]}: {reply.error}")
                return reply
        raise RuntimeError(f"DP store at {self.address}: no answer to {op} in "
                           f"{hold_s + self._timeout_s:.0f} s (is the coordinator up, and "
                           f"is the data-parallel secret the same?)")

    def set(self, key: str, value: Any) -> None:
        self._call("set", [key], value=_as_bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", [key], hold_s=self._timeout_s).value

    def add(self, key: str, amount: int) -> int:
        return self._call("add", [key], amount=int(amount)).number

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", list(keys)).number)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        hold = self._timeout_s if timeout is None else timeout.total_seconds()
        self._call("wait", list(keys), hold_s=hold)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call("compare_set", [key], expected=_as_bytes(expected),
                          value=_as_bytes(desired)).value

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", [key]).number)

    def num_keys(self) -> int:
        return self._call("num_keys", []).number


def _generation(key: str) -> int | None:
    """The group generation of a store key (None for another key)."""
    head, _, rest = key.partition(GROUP_PREFIX)
    number = rest.split("/", 1)[0]
    return int(number) if not head and number.isdigit() else None


def store_address(host: str, port: int) -> str:
    """tcp://host:port (an IPv6 literal in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _as_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def gloo_device(master_ip: str) -> Any:
    """The gloo device of a DP group: its listener binds to the interface that reaches
    the store's host (or $GLOO_SOCKET_IFNAME's, when the operator names one)."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface)
    return dist.ProcessGroupGloo.create_device(hostname=address_towards(master_ip))
