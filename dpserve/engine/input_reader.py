"""InputReader: the engine process's input thread (sockets -> input queue).

Scope: one DEALER per front-end (registered with an empty first frame, again on
every reconnection), the DP coordinator's SUB socket when `DPLink` hands it
over, decoding by the one-byte request type, and the watch on the front-end
links (`_FrontEndLinks`: a remote engine stops when a front-end is unreachable
for `_PEER_LOST_S`). What it reads goes to the busy loop's input queue as
(type, decoded body, front-end index; -1 for the coordinator); its own news
uses the tags below.

Not here: what the busy loop does with it (`dpserve.engine.process`), the
output side (`dpserve.engine.output_sender`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import msgspec
import zmq

from dpserve.protocol import (
    COORDINATOR_READY,
    ControlState,
    EngineCoreRequest,
    RegroupDP,
    RequestType,
    StartDPWave,
    UtilityCall,
)
from dpserve.security import secure

logger = logging.getLogger(__name__)

IO_FAILED = "io-thread-failed"  # internal input-queue tag: an IO thread died
PEER_LOST = "front-end-lost"  # internal input-queue tag: a remote engine lost its front-end
CLIENT_NEWS = "client-news"  # internal input-queue tag: a front-end dropped (why) / back (None)
POLL_MS = 100  # IO threads look at the stop flag this often
_PEER_LOST_S = 3.0  # a remote engine stops when a front-end is unreachable this long
_HEARTBEAT_MS = 1000  # ZMQ heartbeats on a remote engine's input sockets (dead hosts)



class InputReader:
    """Reads every input socket of one engine until `stop` is set (or a remote
    engine's front-end is lost for good: then PEER_LOST is queued and it returns)."""

    def __init__(self, addresses: list[str], coordinator: zmq.Socket | None,
                 identity: bytes, secret: str | None, remote: bool,
                 input_queue: queue.Queue, stop: threading.Event) -> None:
        self.addresses = addresses
        self.coordinator = coordinator  # the DP coordinator's SUB, handed over by DPLink
        self.identity = identity
        self.secret = secret
        self.remote = remote  # not on the launcher's host: watch the front-ends' links
        self.input_queue = input_queue
        self.stop = stop
        self.decoders = {RequestType.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
                         RequestType.ABORT: msgspec.msgpack.Decoder(list[str]),
                         RequestType.UTILITY: msgspec.msgpack.Decoder(UtilityCall)}
        self.coordinator_decoders = {
            RequestType.START_DP_WAVE: msgspec.msgpack.Decoder(StartDPWave),
            RequestType.REGROUP_DP: msgspec.msgpack.Decoder(RegroupDP),
            RequestType.CONTROL: msgspec.msgpack.Decoder(ControlState)}

    def run(self) -> None:
        with zmq.Context() as ctx:
            poller = zmq.Poller()
            links = _FrontEndLinks(self.addresses, self.remote)
            if self.coordinator is not None:
                poller.register(self.coordinator, zmq.POLLIN)
            index_of = {self._connect(ctx, i, address, links, poller): i
                        for i, address in enumerate(self.addresses)}
            while not self.stop.is_set():
                lost = links.lost_for_good()
                if lost is not None:
                    self.input_queue.put_nowait((PEER_LOST, lost, -1))
                    break
                for sock, _ in poller.poll(POLL_MS):
                    if not links.handles(sock):
                        self._read(sock, index_of)
            links.close()
            for sock in index_of:
                sock.close()

    def _connect(self, ctx: zmq.Context, index: int, address: str, links: _FrontEndLinks,
                 poller: zmq.Poller) -> zmq.Socket:
        """A DEALER to front-end `index`, registered: its ROUTER can route to us."""
        sock = secure(ctx.socket(zmq.DEALER), "client", self.secret)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.LINGER, 0)
        links.watch(sock, index, poller)
        sock.connect(address)
        sock.send(b"")  # register: now the front-end's ROUTER can route to us
        poller.register(sock, zmq.POLLIN)
        return sock

    def _read(self, sock: zmq.Socket, index_of: dict[zmq.Socket, int]) -> None:
        """One message -> the input queue (a bad one is logged and dropped)."""
        frames = sock.recv_multipart()
        if sock is self.coordinator:
            if frames[0] == COORDINATOR_READY:  # for an engine that joined later
                return
            item = decode_request(frames, self.coordinator_decoders, "the DP coordinator")
            if item is not None:
                self.input_queue.put_nowait((*item, -1))
            return
        item = decode_request(frames, self.decoders)
        if item is not None:
            self.input_queue.put_nowait((*item, index_of[sock]))


class _FrontEndLinks:
    """An engine's watch on its front-end connections (ZMQ socket monitors).

    Every (re)connection re-sends the empty registration frame, so a restarted
    API server learns of this engine at once. Remote engines also stop when a
    front-end stays disconnected (its host stopped, crashed or is unreachable:
    heartbeats time out) for `_PEER_LOST_S`: the head is gone, and a remote
    engine has no parent there to watch.
    """

    def __init__(self, addresses: list[str], remote: bool) -> None:
        self.addresses = addresses
        self.remote = remote
        self._monitors: dict[zmq.Socket, tuple[zmq.Socket, int]] = {}  # monitor -> (sock, i)
        self._down_since: dict[int, float] = {}

    def watch(self, sock: zmq.Socket, index: int, poller: zmq.Poller) -> None:
        """Call before `sock.connect`."""
        if self.remote:
            sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * _HEARTBEAT_MS)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller.register(monitor, zmq.POLLIN)
        self._monitors[monitor] = (sock, index)

    def handles(self, sock: zmq.Socket) -> bool:
        """Take a monitor event if `sock` is a monitor; False for other sockets."""
        if sock not in self._monitors:
            return False
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(sock)["event"]
        front_end, index = self._monitors[sock]
        if event == zmq.EVENT_DISCONNECTED and self.remote:
            self._down_since.setdefault(index, time.monotonic())
        elif event == zmq.EVENT_CONNECTED:
            self._down_since.pop(index, None)
            front_end.send(b"")  # (re-)register: a new front-end process learns of us
        return True

    def lost_for_good(self) -> str | None:
        """A message naming a front-end down for `_PEER_LOST_S`, else None."""
        now = time.monotonic()
        for index, since in self._down_since.items():
            if now - since >= _PEER_LOST_S:
                return (f"front-end {index} at {self.addresses[index]} unreachable for "
                        f"{now - since:.0f} s")
        return None

    def close(self) -> None:
        for monitor, (sock, _) in self._monitors.items():
            sock.disable_monitor()
            monitor.close()


def decode_request(frames: list[bytes], decoders: dict,
                   source: str = "a front-end") -> tuple[RequestType, Any] | None:
    """[type byte, body] -> (type, decoded body); None (logged) for a bad message."""
    try:
        request_type = RequestType(frames[0])
        decoder = decoders.get(request_type)
        if len(frames) != 2 or decoder is None:
            raise ValueError(f"{request_type.name} with {len(frames)} frames is not served")
        return request_type, decoder.decode(frames[1])
    except (ValueError, IndexError, msgspec.DecodeError) as e:  # ValidationError is a DecodeError
        logger.error("dropping a bad message from %s: %s", source, e)
        return None
