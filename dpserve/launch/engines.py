"""Engine processes: spawning `EngineCore_<rank>` and the launcher's side of the handshake.

Start-up, per engine (identity = DP rank as 2 bytes little-endian):

    NEW --HELLO--> CONNECTED (launcher answers with EngineInitMetadata)
        --READY--> READY (model loaded, KV cache sized, front-ends registered)

Every wait is bounded and watches the process sentinels, so an engine that
dies while starting fails the launch at once, naming it and its exit code.

Not here: what engines do (`dpserve.engine.process`), addresses
(`dpserve.launch.addresses`), teardown (`dpserve.launch.process`).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Collection, Container, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import msgspec
import zmq

from dpserve.config import EngineConfig
from dpserve.launch.process import (
    ProcessGroup,
    engine_context,
    shutdown,
    stop_socket_thread,
    wait_for_any_exit,
)
from dpserve.protocol import EngineInitMetadata, HandshakeHello, HandshakeReady
from dpserve.security import secure

logger = logging.getLogger(__name__)

_PROGRESS_LOG_S = 10.0


class EngineStartupError(RuntimeError):
    """An engine died, misbehaved or timed out during the start-up handshake."""



class EngineProcManager:
    """Spawns engine processes `EngineCore_<rank>` and tears them down.

    Cleanup is tied to a `ProcessGroup`: `close()`, garbage collection and
    interpreter exit all run `shutdown(processes)` once.
    """

    def __init__(self, config: EngineConfig, handshake_address: str, num_engines: int = 1,
                 start_rank: int = 0, local: bool = True,
                 handshake_timeout: float | None = None) -> None:
        from dpserve.engine.process import HANDSHAKE_TIMEOUT_S

        self.config = config
        self.handshake_address = handshake_address
        self.secret = config.parallel.data_parallel_secret
        self.local = local
        self.handshake_timeout = handshake_timeout or HANDSHAKE_TIMEOUT_S
        self.ranks = list(range(start_rank, start_rank + num_engines))
        self._lock = threading.Lock()  # ranks and processes change together (scaling)
        self._group = ProcessGroup(self, context=engine_context())
        for rank in self.ranks:
            self._group.spawn(self._target(), f"EngineCore_{rank}", **self._kwargs(rank))

    @property
    def processes(self) -> list[BaseProcess]:
        return self._group.processes

    def _target(self):
        from dpserve.engine.process import run_engine_core

        return run_engine_core

    def _kwargs(self, rank: int, incarnation: int = 0) -> dict:
        return dict(config=self.config, rank=rank, handshake_address=self.handshake_address,
                    local=self.local, handshake_timeout=self.handshake_timeout,
                    incarnation=incarnation)

    def wait_for_exits(self, ranks: Collection[int], timeout: float) -> dict[int, str]:
        """Block up to `timeout` s until the process of one of `ranks` exits; rank ->
        "EngineCore_1 (pid 42) exited with code -9" for each that did."""
        with self._lock:  # a rank removed meanwhile (scaling down) is not watched
            watched = {self.processes[self.ranks.index(r)]: r for r in ranks
                       if r in self.ranks}
        return {watched[p]: f"{p.name} (pid {p.pid}) exited with code {p.exitcode}"
                for p in wait_for_any_exit(list(watched), timeout=timeout)}

    def kill(self, rank: int) -> None:
        """SIGKILL `rank`'s process and reap it (an operator's restart: its requests
        move as on a crash)."""
        proc = self.processes[self.ranks.index(rank)]
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=5.0)

    def restart(self, rank: int, incarnation: int, init: EngineInitMetadata,
                timeout: float) -> HandshakeReady:
        """Start a new process for `rank` (whose process has exited) and walk it to
        READY; on failure it is stopped and EngineStartupError raised."""
        old = self.processes[self.ranks.index(rank)]
        old.join(timeout=1.0)
        new = self._group.replace(old, self._target(), **self._kwargs(rank, incarnation))
        try:
            return wait_for_engine_startup(self.handshake_address, init, [rank], [new],
                                           timeout=timeout, secret=self.secret)[rank]
        except BaseException:
            shutdown([new])
            raise

    def wait_for_startup(self, init: EngineInitMetadata, timeout: float = 600.0,
                         also_watch: Sequence[BaseProcess] = (), *,
                         remote_ranks: Sequence[int] = (),
                         remote_init: EngineInitMetadata | None = None,
                         remote_handshake: str | None = None) -> dict[int, HandshakeReady]:
        """Run the handshake with these engines, and with `remote_ranks` (engines of
        other hosts, at `remote_handshake`); see `wait_for_engine_startup`."""
        addresses = [self.handshake_address, *([remote_handshake] if remote_handshake else [])]
        return wait_for_engine_startup(addresses, init, [*self.ranks, *remote_ranks],
                                       [*self.processes, *also_watch], timeout=timeout,
                                       remote_ranks=remote_ranks, remote_init=remote_init,
                                       secret=self.secret)

    def respawn(self, rank: int, incarnation: int) -> None:
        """A new process for remote `rank` (whose process has exited); it handshakes
        with the head's `RejoinServer`, not with us."""
        old = self.processes[self.ranks.index(rank)]
        old.join(timeout=1.0)
        self._group.replace(old, self._target(), **self._kwargs(rank, incarnation))

    def add_ranks(self, ranks: Sequence[int], init: EngineInitMetadata, timeout: float,
                  also_watch: Sequence[BaseProcess] = ()) -> dict[int, HandshakeReady]:
        """Scaling up: new processes for `ranks`, walked to READY, then watched (in
        `ranks`); on failure they are stopped and EngineStartupError raised."""
        with self._lock:
            new = [self._group.spawn(self._target(), f"EngineCore_{rank}", **self._kwargs(rank))
                   for rank in ranks]
        try:
            ready = wait_for_engine_startup(self.handshake_address, init, list(ranks),
                                            [*new, *also_watch], timeout=timeout,
                                            secret=self.secret)
        except BaseException:
            shutdown(new)
            with self._lock:
                for proc in new:
                    self.processes.remove(proc)
            raise
        with self._lock:  # processes [i] belongs to ranks [i]: the new ones are last
            self.ranks += list(ranks)
        return ready

    def remove_rank(self, rank: int, timeout: float) -> None:
        """Scaling down: stop `rank`'s process (SIGTERM: an idle engine exits at once;
        terminate -> join -> kill after `timeout`) and forget it."""
        with self._lock:
            index = self.ranks.index(rank)
            del self.ranks[index]
            proc = self.processes.pop(index)
        shutdown([proc], timeout=timeout)

    def finished_procs(self) -> dict[str, int]:
        """Name -> exit code of every process that has exited."""
        return {p.name: p.exitcode for p in self.processes if p.exitcode is not None}

    def close(self) -> None:
        self._group.close()


class StartupState(enum.Enum):
    NEW = "NEW"  # spawned, not heard from
    CONNECTED = "CONNECTED"  # said HELLO, got its init metadata; loading the model
    READY = "READY"  # said READY


@dataclass
class _Pending:
    rank: int
    local: bool
    state: StartupState = StartupState.NEW
    ready: HandshakeReady | None = field(default=None, repr=False)


def wait_for_engine_startup(handshake_address: str | Sequence[str], init: EngineInitMetadata,
                            ranks: Sequence[int], procs: Sequence[BaseProcess] = (), *,
                            timeout: float = 600.0, remote_ranks: Container[int] = (),
                            remote_init: EngineInitMetadata | None = None,
                            secret: str | None = None) -> dict[int, HandshakeReady]:
    """Bind a ROUTER at `handshake_address` (one or several) and walk every
    engine to READY.

    `procs` are local processes whose death fails the start-up at once (the
    engines, and e.g. the coordinator). `remote_ranks` are engines on other
    hosts (they say local=False, and get `remote_init`); a rank whose HELLO
    says otherwise is rejected. Returns rank -> its READY message
    (num_kv_blocks, max_model_len). Raises EngineStartupError on a death, a
    rejected engine or when `timeout` seconds pass; a frame that is not a
    handshake message at all is dropped with a log line.
    """
    engines = {r: _Pending(r, local=r not in remote_ranks) for r in ranks}
    hello_decoder = msgspec.msgpack.Decoder(HandshakeHello)
    ready_decoder = msgspec.msgpack.Decoder(HandshakeReady)
    init_bytes = {True: msgspec.msgpack.encode(init),
                  False: msgspec.msgpack.encode(remote_init or init)}
    deadline = time.monotonic() + timeout
    next_progress_log = time.monotonic() + _PROGRESS_LOG_S
    addresses = [handshake_address] if isinstance(handshake_address, str) else handshake_address
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as sock:
        secure(sock, "server", secret)
        sock.setsockopt(zmq.LINGER, 1000)
        for address in addresses:
            sock.bind(address)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        for proc in procs:
            poller.register(proc.sentinel, zmq.POLLIN)
        while any(e.state is not StartupState.READY for e in engines.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineStartupError(f"engines not ready after {timeout:.0f} s: "
                                         f"{_describe(engines)}")
            if time.monotonic() >= next_progress_log:
                logger.info("waiting for engines: %s", _describe(engines))
                next_progress_log += _PROGRESS_LOG_S
            events = dict(poller.poll(int(min(left, 1.0) * 1000) + 1))
            fired = [fd for fd in events if fd is not sock]
            if fired:
                _raise_for_dead([p for p in procs if p.sentinel in fired], engines)
            if sock in events:
                frames = sock.recv_multipart()
                reply = _advance(engines, frames, hello_decoder, ready_decoder)
                if reply is not None:
                    sock.send_multipart([frames[0], init_bytes[reply]])
    logger.info("all %d engine(s) ready", len(engines))
    return {r: e.ready for r, e in sorted(engines.items())}  # type: ignore[misc]


def _advance(engines: dict[int, _Pending], frames: list[bytes],
             hello_decoder: msgspec.msgpack.Decoder,
             ready_decoder: msgspec.msgpack.Decoder) -> bool | None:
    """Move one engine a state on. Returns whether it is local when it must be
    sent its init metadata, else None. Junk is logged and dropped."""
    if len(frames) != 2 or len(frames[0]) != 2:
        logger.error("dropping a handshake message of %d frames (expected 2, from an "
                     "engine identity)", len(frames))
        return None
    identity, body = frames
    rank = int.from_bytes(identity, "little")
    engine = engines.get(rank)
    if engine is None:
        logger.error("dropping a handshake message from unexpected engine rank %d", rank)
        return None
    decoder = hello_decoder if engine.state is StartupState.NEW else ready_decoder
    try:
        msg = decoder.decode(body)
    except msgspec.DecodeError as e:
        logger.error("engine %d: dropping a bad handshake message in state %s: %s", rank,
                     engine.state.value, e)
        return None
    if msg.local != engine.local:
        raise EngineStartupError(
            f"engine {rank} says it is {'local' if msg.local else 'remote'}, expected "
            f"{'local' if engine.local else 'remote'}")
    if engine.state is StartupState.NEW:
        engine.state = StartupState.CONNECTED
        logger.info("engine %d (%s) connected; loading the model", rank,
                    "local" if engine.local else "remote")
        return engine.local
    if engine.state is StartupState.CONNECTED:
        engine.state, engine.ready = StartupState.READY, msg
        logger.info("engine %d ready: %d KV blocks, max_model_len %d", rank,
                    msg.num_kv_blocks, msg.max_model_len)
        return None
    logger.error("engine %d: dropping a handshake message after READY", rank)
    return None


def _raise_for_dead(dead_procs: list[BaseProcess], engines: dict[int, _Pending]) -> None:
    for proc in dead_procs:
        proc.join(timeout=1.0)  # reap it, so its exit code is known
    dead = [f"{p.name} (pid {p.pid}, exit code {p.exitcode})" for p in dead_procs]
    raise EngineStartupError(f"process died during start-up: {', '.join(dead)}; "
                             f"see its log above. Engines: {_describe(engines)}")


def _describe(engines: dict[int, _Pending]) -> str:
    return ", ".join(f"rank {e.rank} {e.state.value} ({_MEANING[e.state]})"
                     for e in engines.values())


_MEANING = {StartupState.NEW: "no HELLO yet", StartupState.CONNECTED: "loading the model",
            StartupState.READY: "ready"}


class RejoinServer:
    """The head's handshake for remote engines after start-up: a headless host that
    restarted an engine needs its init metadata again (`dpserve.launch.supervisor`
    does the same for local engines through `wait_for_engine_startup`).

    A daemon thread with a ROUTER bound at `address` (the head's tcp handshake
    address) walks each of `ranks` through HELLO -> init metadata -> READY, as
    often as they come back; anything else is logged and dropped. `close()` stops
    it (idempotent).
    """

    def __init__(self, address: str, init: EngineInitMetadata, ranks: Container[int],
                 secret: str | None = None) -> None:
        self._init = msgspec.msgpack.encode(init)
        self._ranks = ranks
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = secure(self._ctx.socket(zmq.ROUTER), "server", secret)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._thread = threading.Thread(target=self._serve, name="engine-rejoin", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        hello, ready = msgspec.msgpack.Decoder(HandshakeHello), msgspec.msgpack.Decoder(
            HandshakeReady)
        engines: dict[int, _Pending] = {}
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            frames = self._sock.recv_multipart()
            rank = int.from_bytes(frames[0], "little") if len(frames[0]) == 2 else -1
            if rank not in self._ranks:
                logger.error("rejoin: dropping a message from unexpected engine rank %d", rank)
                continue
            pending = engines.get(rank)
            if pending is None or pending.state is StartupState.READY:
                pending = engines[rank] = _Pending(rank, local=False)  # a new process
            try:
                if _advance({rank: pending}, frames, hello, ready) is not None:
                    self._sock.send_multipart([frames[0], self._init])
            except EngineStartupError as e:
                logger.error("rejoin: %s", e)
        self._sock.close()

    def close(self) -> None:
        stop_socket_thread(self._stop, self._thread, self._ctx)
