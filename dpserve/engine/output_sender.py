"""An engine's outputs to its front-ends, never held up by one of them.

Scope: `OutputRouter`, the busy loop's side: which front-end each request in
flight answers to, the front-ends dropped for not reading, and each step's
outputs grouped by front-end onto the output queue (a scheduler snapshot rides
every message). `OutputSender`, the output thread's side: the engine's output
sockets (one PUSH per front-end, i.e. per API server) and the loop of its
"output" thread (`run`): encode each `EngineCoreOutputs` and
send it without blocking. What a socket does not take (ZMQ's send high-water
mark and the kernel buffer are full: the front-end stopped reading) waits in that
client's backlog, first in first out, capped in bytes. A client is **dropped**
when its backlog would pass the cap, or when its oldest queued message has waited
`stall_timeout` s:

1. its backlog is discarded, and `on_change(client, reason)` tells the busy loop,
   which aborts every request of that client (KV freed), rejects (ABORT) the new
   ones it sends, and queues `(client, None)` after the aborts' outputs;
2. until then and until its socket takes a message again, each output for it is
   discarded; only the ids of the requests that finish are kept (and those of
   the requests whose final output was in the discarded backlog);
3. then, once its socket has room (a SIGSTOPped API server got SIGCONT, a
   blocked event loop moved on), it is served as before (`on_change(client,
   None)` first, so a request it sends on reading the notice is run) and sent
   one notice, finish reason ABORT for each of those requests, so its streams
   end instead of waiting forever. No output of a request it lost can follow.

Every other front-end keeps its stream at full speed meanwhile. A dropped client
also loses the utility answers and control states meant for it (its calls time
out). ZMQ keeps the order of one socket's messages, so the notice comes after
the outputs that socket took before the drop: the client sees a prefix of each
stream, then its end.

Not here: aborting a dropped front-end's requests (the busy loop,
`dpserve.engine.process`), the input side.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import zmq

from dpserve.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    SchedulerStats,
)
from dpserve.security import secure

logger = logging.getLogger(__name__)

DEAD_LINGER_MS = 4000  # how long closing output sockets may take to flush ENGINE_CORE_DEAD
STOP_LINGER_MS = 500  # ... and the last outputs on a plain stop
SEND_HWM = 64  # messages ZMQ queues per socket before our backlog (whose age we see) takes over
_RETRY_S = 0.01  # with a backlog: try its socket again this often
_DROPPED_RETRY_S = 0.1  # a dropped client only: look for it coming back this often
_NOTHING = object()  # the output queue had nothing


# What the busy loop queues for the output thread: (client index, outputs | None = its
# requests all aborted), ENGINE_CORE_DEAD, or None = stop.
OutputItem = tuple[int, EngineCoreOutputs | None] | bytes | None


class OutputRouter:
    """The busy loop's side of its outputs (module docstring); `stats` is a fresh
    scheduler snapshot, sent with every outputs message."""

    def __init__(self, rank: int, num_clients: int, stats: Callable[[], SchedulerStats],
                 output_queue: queue.Queue[OutputItem]) -> None:
        self.rank = rank
        self.num_clients = num_clients
        self.stats = stats
        self.queue = output_queue  # emptied by the output thread
        self.owner: dict[str, int] = {}  # request_id -> client index, until finished
        self.dropped: set[int] = set()  # front-ends dropped for not reading (no new work)
        self.num_dropped = 0  # drops so far (request_state_sizes)

    def publish(self, outputs: list[EngineCoreOutput], idle: bool) -> None:
        """Outputs to their front-ends (a finished request forgets its own); `idle`:
        stats to every other front-end served too (its gauges: else stale until its
        next request here; with several, the last write wins)."""
        if not outputs:
            return
        by_client: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        for out in outputs:
            client = (self.owner.pop(out.request_id, None) if out.finished
                      else self.owner.get(out.request_id))
            if client is None:
                logger.warning("output for unknown request %s dropped", out.request_id)
                continue
            by_client[client].append(out)
        for client in range(self.num_clients):
            if client in by_client or (idle and client not in self.dropped):
                self.send(client, by_client.get(client, []))

    def send(self, client: int, outputs: list[EngineCoreOutput]) -> None:
        self.put(client, EngineCoreOutputs(engine_index=self.rank, outputs=outputs,
                                           scheduler_stats=self.stats(),
                                           timestamp=time.monotonic()))

    def put(self, client: int, outputs: EngineCoreOutputs | None) -> None:
        """One message for `client` as it is (None: its requests are all aborted)."""
        self.queue.put_nowait((client, outputs))

    def drop(self, client: int) -> list[str]:
        """A front-end dropped for not reading: no new work from it; its requests."""
        self.dropped.add(client)
        self.num_dropped += 1
        return [rid for rid, owner in self.owner.items() if owner == client]

    def sizes(self) -> dict[str, int]:
        """The routing map (`client_of_<i>`: front-end i's requests) and the drops."""
        per_client = Counter(self.owner.values())
        return {"client_of": len(self.owner),
                **{f"client_of_{i}": per_client[i] for i in range(self.num_clients)},
                "dropped_clients": self.num_dropped}


@dataclass
class _Queued:
    at: float  # when it was queued (clock)
    payload: bytes
    finished: list[str]  # the requests this message finishes


@dataclass
class _Client:
    """One front-end's socket and what waits for it."""

    sock: zmq.Socket
    backlog: deque[_Queued] = field(default_factory=deque)
    nbytes: int = 0  # payload bytes in the backlog
    dropped: bool = False
    notice: list[str] = field(default_factory=list)  # dropped: requests to end with ABORT
    aborted: bool = False  # dropped: the busy loop has aborted its requests (step 1)


class OutputSender:
    """Non-blocking sends to each front-end over capped backlogs (module docstring).

    `sockets[i]` is front-end i's connected PUSH socket; the sender owns them
    from here on (same thread only). `on_change(client, reason)` is called from the
    sender's thread: dropped (why), or reads again (None). `clock`: for tests.
    """

    def __init__(self, sockets: Sequence[zmq.Socket], engine_index: int, *,
                 max_backlog_bytes: int, stall_timeout: float,
                 on_change: Callable[[int, str | None], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clients = [_Client(sock) for sock in sockets]
        self.engine_index = engine_index
        self.max_backlog_bytes = max_backlog_bytes
        self.stall_timeout = stall_timeout
        self.on_change, self.clock = on_change, clock
        self.num_dropped = 0  # drops so far (a client may be dropped more than once)
        self._encoder = msgspec.msgpack.Encoder()

    def put(self, client: int, outputs: EngineCoreOutputs | None) -> None:
        """Send (or queue) one message for `client`; drop the client if it overflows.
        None: the busy loop says every request of a dropped client is aborted."""
        state = self.clients[client]
        if outputs is None:
            state.aborted = True
            return
        if state.dropped:
            state.notice.extend(_finished(outputs))
            return
        payload = self._encoder.encode(outputs)
        if not state.backlog and _try_send(state.sock, payload):
            return
        state.backlog.append(_Queued(self.clock(), payload, _finished(outputs)))
        state.nbytes += len(payload)
        if state.nbytes > self.max_backlog_bytes:
            self._drop(client, f"its backlog of unread outputs passed "
                               f"{self.max_backlog_bytes} bytes (--engine-output-backlog)")

    def pump(self) -> None:
        """Move backlogs into their sockets, drop clients stalled for too long, and
        send each dropped client that reads again its notice."""
        now = self.clock()
        for i, state in enumerate(self.clients):
            if state.dropped:
                self._try_back(i, state)
                continue
            while state.backlog and _try_send(state.sock, state.backlog[0].payload):
                state.nbytes -= len(state.backlog.popleft().payload)
            if state.backlog and now - state.backlog[0].at >= self.stall_timeout:
                self._drop(i, f"it left outputs unread for {now - state.backlog[0].at:.1f} s "
                              f"(--engine-output-stall-timeout {self.stall_timeout:g})")

    def wait_s(self) -> float | None:
        """How long the thread may wait for new outputs before `pump` has work."""
        if any(state.backlog for state in self.clients):
            return _RETRY_S
        return _DROPPED_RETRY_S if any(state.dropped for state in self.clients) else None

    def backlog_sizes(self) -> list[int]:
        """Messages waiting per client (tests)."""
        return [len(state.backlog) for state in self.clients]

    def flush(self, timeout: float) -> None:
        """Before closing: give the backlogs up to `timeout` s to drain."""
        deadline = time.monotonic() + timeout
        while any(s.backlog for s in self.clients) and time.monotonic() < deadline:
            self.pump()
            time.sleep(_RETRY_S)

    def send_engine_dead(self, identity: bytes) -> None:
        """[ENGINE_CORE_DEAD, identity] to every client, never waiting."""
        for i, state in enumerate(self.clients):
            if not _try_send(state.sock, [ENGINE_CORE_DEAD, identity]):
                logger.error("could not queue ENGINE_CORE_DEAD for front-end %d (peer stuck)", i)

    def _drop(self, client: int, reason: str) -> None:
        state = self.clients[client]
        state.dropped, state.aborted = True, False
        state.notice.extend(rid for queued in state.backlog for rid in queued.finished)
        state.backlog.clear()
        state.nbytes = 0
        self.num_dropped += 1
        self.on_change(client, reason)

    def _try_back(self, client: int, state: _Client) -> None:
        """Back once the busy loop has aborted its requests and its socket has room:
        the busy loop hears first (so an ADD sent on the notice is run), then the
        notice goes out (none when no request of it was lost)."""
        if not state.aborted or not state.sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
            return
        logger.info("engine %d: front-end %d reads again: %d dropped request(s) ended "
                    "with ABORT", self.engine_index, client, len(state.notice))
        state.dropped, notice, state.notice = False, state.notice, []
        self.on_change(client, None)
        if notice:
            self.put(client, EngineCoreOutputs(engine_index=self.engine_index, outputs=[
                EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT)
                for rid in notice], timestamp=self.clock()))

    # ---- the output thread ----------------------------------------------------------

    def run(self, items: queue.Queue, identity: bytes) -> None:
        """The output thread's loop: queue -> sockets until None (a stop: the backlogs
        get `STOP_LINGER_MS` to drain) or a bytes item (ENGINE_CORE_DEAD, sent to all
        with `identity`); then close the sockets, with a linger to flush them."""
        linger_ms = self._serve(items, identity)
        for state in self.clients:
            state.sock.close(linger=linger_ms)

    def _serve(self, items: queue.Queue, identity: bytes) -> int:
        while True:
            # 1. Wait for outputs; with a backlog or a dropped client, not for long.
            try:
                item = items.get(timeout=self.wait_s())
            except queue.Empty:
                item = _NOTHING
            # 2. Send everything queued meanwhile, in order.
            while item is not _NOTHING:
                if item is None:
                    self.flush(STOP_LINGER_MS / 1000)
                    return STOP_LINGER_MS
                if isinstance(item, bytes):  # ENGINE_CORE_DEAD: the last message
                    self.send_engine_dead(identity)
                    return DEAD_LINGER_MS
                self.put(*item)
                try:
                    item = items.get_nowait()
                except queue.Empty:
                    item = _NOTHING
            # 3. Backlogs, stalls, dropped clients coming back.
            self.pump()


def connect_outputs(ctx: zmq.Context, addresses: Sequence[str],
                    secret: str | None) -> list[zmq.Socket]:
    """One PUSH socket per front-end output address."""
    sockets = []
    for address in addresses:
        sock = secure(ctx.socket(zmq.PUSH), "client", secret)
        sock.setsockopt(zmq.LINGER, DEAD_LINGER_MS)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.connect(address)
        sockets.append(sock)
    return sockets


def _finished(outputs: EngineCoreOutputs) -> list[str]:
    return [o.request_id for o in outputs.outputs if o.finished]


def _try_send(sock: zmq.Socket, payload: bytes | list[bytes]) -> bool:
    """Queue a message in ZMQ without waiting; False when the socket takes no more.

    A refused send asks the socket's EVENTS once and tries again: that makes ZMQ
    take in its pending news that the reader made room (a send alone looks at them
    at most every millisecond or so)."""
    for _ in range(2):
        try:
            if isinstance(payload, list):
                sock.send_multipart(payload, flags=zmq.NOBLOCK)
            else:
                sock.send(payload, flags=zmq.NOBLOCK, copy=True)
            return True
        except zmq.Again:
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
                return False
    return False
