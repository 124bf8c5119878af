"""The rendezvous of external / hybrid load balancing: where the coordinator is.

The head (rank 0's host) answers on tcp://<data-parallel-address>:<rpc port>;
other hosts' launchers ask it before they start their engines.
"""

from __future__ import annotations

import logging
import threading

import msgspec
import zmq

from dpserve.launch.engines import EngineStartupError
from dpserve.launch.process import stop_socket_thread
from dpserve.protocol import RendezvousReply, RendezvousRequest
from dpserve.security import secure

logger = logging.getLogger(__name__)


class RendezvousServer:
    """The head's answer to other hosts' launchers: where the coordinator is.

    A daemon thread with a ROUTER bound at `address` (tcp://<data-parallel-
    address>:<rpc port>) answers every well-formed `RendezvousRequest` with
    `reply`; junk is logged and dropped. `close()` stops it (idempotent).
    """

    def __init__(self, address: str, reply: RendezvousReply, dp_size: int,
                 secret: str | None = None) -> None:
        self.address = address
        self._reply = msgspec.msgpack.encode(reply)
        self._dp_size = dp_size
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = secure(self._ctx.socket(zmq.ROUTER), "server", secret)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)  # fails here, in the caller, if the port is taken
        self._thread = threading.Thread(target=self._serve, name="dp-rendezvous", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        decoder = msgspec.msgpack.Decoder(RendezvousRequest)
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            frames = self._sock.recv_multipart()
            try:
                if len(frames) != 2:
                    raise ValueError(f"{len(frames)} frames, expected 2")
                request = decoder.decode(frames[1])
                end = request.start_rank + request.size_local
                if not (1 <= request.start_rank and request.size_local >= 1
                        and end <= self._dp_size):
                    raise ValueError(f"ranks [{request.start_rank}, {end}) are not in "
                                     f"[1, {self._dp_size})")
            except (ValueError, msgspec.DecodeError) as e:
                logger.error("rendezvous: dropping a bad request: %s", e)
                continue
            logger.info("rendezvous: host with ranks [%d, %d) asked for the coordinator",
                        request.start_rank, end)
            self._sock.send_multipart([frames[0], self._reply])
        self._sock.close()

    def close(self) -> None:
        stop_socket_thread(self._stop, self._thread, self._ctx)


def ask_rendezvous(address: str, request: RendezvousRequest, timeout: float,
                   secret: str | None = None) -> RendezvousReply:
    """Ask the head at `address` where the coordinator is; EngineStartupError
    (naming the address) when no answer comes within `timeout` seconds."""
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        secure(sock, "client", secret)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send(msgspec.msgpack.encode(request))
        if not sock.poll(int(timeout * 1000)):
            raise EngineStartupError(
                f"no answer from the head at {address} within {timeout:g} s (is rank 0's "
                f"server running there, with the same --data-parallel-rpc-port and secret?)")
        try:
            return msgspec.msgpack.decode(sock.recv(), type=RendezvousReply)
        except msgspec.DecodeError as e:
            raise EngineStartupError(f"bad rendezvous answer from {address}: {e}") from e

