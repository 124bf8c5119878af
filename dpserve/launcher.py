"""Process management and addresses: the one place that allocates them.

Scope: ZMQ addresses for one serving instance (`AddressAllocator` ->
`ZmqAddresses`), spawning engine processes (`EngineProcManager`), the
launcher's side of the start-up handshake (`wait_for_engine_startup`),
watching processes (`wait_for_any_exit`) and tearing them down (`shutdown`).

Not here: what engines do (`dpserve.engine.process`), the front-end's
sockets (`dpserve.frontend.engine_client`), the DP coordinator, Ray.

Start-up, per engine (identity = DP rank as 2 bytes little-endian):

    NEW --HELLO--> CONNECTED (launcher answers with EngineInitMetadata)
        --READY--> READY (model loaded, KV cache sized, front-ends registered)

Every wait is bounded and watches the process sentinels, so an engine that
dies while starting fails the launch at once, naming it and its exit code.
"""

from __future__ import annotations

import atexit
import dataclasses
import enum
import functools
import logging
import multiprocessing
import os
import shutil
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import psutil
import zmq

from dpserve.config import EngineConfig
from dpserve.protocol import (
    EngineInitMetadata,
    HandshakeHello,
    HandshakeReady,
    RendezvousReply,
    RendezvousRequest,
)
from dpserve.security import secure

logger = logging.getLogger(__name__)

_MAX_IPC_PATH = 100  # sockaddr_un holds 107 bytes; keep a margin
_PROGRESS_LOG_S = 10.0



class EngineStartupError(RuntimeError):
    """An engine died, misbehaved or timed out during the start-up handshake."""


# ---- addresses ---------------------------------------------------------------


@dataclass(frozen=True)
class ZmqAddresses:
    """Where the sockets of one serving instance live (picklable, plain strings).

    The launcher binds `handshake`; front-end i binds `inputs[i]` (ROUTER)
    and `outputs[i]` (PULL); engines connect to all of them. Engines on this
    host use these ipc:// addresses; when some run on other hosts, each
    socket also binds the tcp:// address of the `remote_*` twin, and remote
    engines are told those (`init_metadata(local=False)`).
    """

    handshake: str
    inputs: tuple[str, ...]  # [num_clients] front-end ROUTER (requests in)
    outputs: tuple[str, ...]  # [num_clients] front-end PULL (outputs back)
    coordinator_input: str | None = None  # the coordinator's engine XPUB
    coordinator_output: str | None = None  # the coordinator's report PULL
    # Where DP rank 0 hosts the TCP store of the engines' all-reduce group (lockstep).
    dp_master_ip: str = "127.0.0.1"
    dp_master_port: int = 0
    remote_handshake: str | None = None
    remote_inputs: tuple[str, ...] | None = None
    remote_outputs: tuple[str, ...] | None = None
    remote_coordinator_input: str | None = None
    remote_coordinator_output: str | None = None

    def init_metadata(self, dp_size: int = 1, local: bool = True) -> EngineInitMetadata:
        """What the launcher tells each engine (on this host or not) after its HELLO."""
        if local:
            inputs, outputs = self.inputs, self.outputs
            coordinator = (self.coordinator_input, self.coordinator_output)
        else:
            if self.remote_inputs is None or self.remote_outputs is None:
                raise ValueError("these addresses have no tcp:// twins for remote engines")
            inputs, outputs = self.remote_inputs, self.remote_outputs
            coordinator = (self.remote_coordinator_input, self.remote_coordinator_output)
        return EngineInitMetadata(
            input_addresses=list(inputs), output_addresses=list(outputs),
            coordinator_input=coordinator[0], coordinator_output=coordinator[1],
            dp_master_ip=self.dp_master_ip, dp_master_port=self.dp_master_port,
            dp_size=dp_size)

    def input_binds(self, client: int) -> list[str]:
        """Every address front-end `client` binds its ROUTER to."""
        return [self.inputs[client], *([self.remote_inputs[client]] if self.remote_inputs
                                       else [])]

    def output_binds(self, client: int) -> list[str]:
        """Every address front-end `client` binds its PULL to."""
        return [self.outputs[client], *([self.remote_outputs[client]] if self.remote_outputs
                                        else [])]

    def with_coordinator(self, coordinator: Any) -> ZmqAddresses:
        """These addresses, naming a started `DPCoordinator`'s engine sockets."""
        return dataclasses.replace(
            self, coordinator_input=coordinator.engine_publish_address,
            coordinator_output=coordinator.engine_report_address,
            remote_coordinator_input=coordinator.remote_engine_publish_address,
            remote_coordinator_output=coordinator.remote_engine_report_address)


class AddressAllocator:
    """Unique addresses for one serving instance: never fixed names or ports.

    local_only: `ipc://` paths in a private temp dir, removed by `cleanup()`
    or at interpreter exit (not when the allocator is collected: the
    addresses it handed out may outlive it); else
    `tcp://host:port` on ports that were free when asked for (another
    process could still take one before it is bound: the usual race).
    """

    def __init__(self, local_only: bool = True, host: str = "127.0.0.1") -> None:
        self.local_only = local_only
        self.host = host
        self._count = 0
        self._ports: set[int] = set()
        self.ipc_dir: str | None = None
        if local_only:
            self.ipc_dir = tempfile.mkdtemp(prefix="dpserve-")
            if len(self.ipc_dir) > _MAX_IPC_PATH - 24:  # a long $TMPDIR
                os.rmdir(self.ipc_dir)
                self.ipc_dir = tempfile.mkdtemp(prefix="dpserve-", dir="/tmp")
        self._remove_dir = functools.partial(_remove_dir, self.ipc_dir, os.getpid())
        atexit.register(self._remove_dir)

    def new_address(self, name: str) -> str:
        self._count += 1
        if self.ipc_dir is not None:
            return f"ipc://{self.ipc_dir}/{name}-{self._count}"
        return f"tcp://{url_host(self.host)}:{self._free_port()}"

    def engine_addresses(self, num_clients: int = 1, remote_host: str | None = None,
                         rpc_port: int | None = None) -> ZmqAddresses:
        """Handshake and per-front-end input/output addresses, and a free TCP port
        on `host` (127.0.0.1 for ipc) for the DP group's store. The coordinator's
        come from the coordinator itself (`ZmqAddresses.with_coordinator`).

        remote_host: engines on other hosts will connect: add tcp:// twins on
        that address (the handshake on `rpc_port`); the DP store moves there too.
        """
        if remote_host is not None:
            tcp = AddressAllocator(local_only=False, host=remote_host)
            return dataclasses.replace(
                self.engine_addresses(num_clients),
                remote_handshake=f"tcp://{url_host(remote_host)}:{rpc_port}",
                remote_inputs=tuple(tcp.new_address("") for _ in range(num_clients)),
                remote_outputs=tuple(tcp.new_address("") for _ in range(num_clients)),
                dp_master_ip=remote_host, dp_master_port=tcp.free_port())
        return ZmqAddresses(
            handshake=self.new_address("handshake"),
            inputs=tuple(self.new_address(f"input{i}") for i in range(num_clients)),
            outputs=tuple(self.new_address(f"output{i}") for i in range(num_clients)),
            dp_master_ip=self.host, dp_master_port=self._free_port())

    def cleanup(self) -> None:
        """Remove the ipc dir (idempotent)."""
        atexit.unregister(self._remove_dir)
        self._remove_dir()

    def free_port(self) -> int:
        """A TCP port on `host` that was free when asked for (never one handed out before)."""
        return self._free_port()

    def _free_port(self) -> int:
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((self.host, 0))
                port = s.getsockname()[1]
            if port not in self._ports:
                self._ports.add(port)
                return port
        raise RuntimeError(f"could not find a free TCP port on {self.host}")


def url_host(host: str) -> str:
    """`host` as it goes in a tcp:// URL (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host else host


def _remove_dir(path: str | None, owner_pid: int) -> None:
    if path is not None and os.getpid() == owner_pid:  # never from a forked child
        shutil.rmtree(path, ignore_errors=True)


# ---- engine processes ----------------------------------------------------------


class EngineProcManager:
    """Spawns engine processes `EngineCore_<rank>` and tears them down.

    Cleanup is tied to a `weakref.finalize`: `close()`, garbage collection and
    interpreter exit all run `shutdown(processes)` once.
    """

    def __init__(self, config: EngineConfig, handshake_address: str, num_engines: int = 1,
                 start_rank: int = 0, local: bool = True,
                 handshake_timeout: float | None = None) -> None:
        from dpserve.engine.process import HANDSHAKE_TIMEOUT_S, run_engine_core

        ctx = multiprocessing.get_context("spawn")
        self.handshake_address = handshake_address
        self.secret = config.parallel.data_parallel_secret
        self.ranks = list(range(start_rank, start_rank + num_engines))
        self.processes: list[BaseProcess] = [
            ctx.Process(target=run_engine_core, name=f"EngineCore_{rank}",
                        kwargs=dict(config=config, rank=rank,
                                    handshake_address=handshake_address, local=local,
                                    handshake_timeout=handshake_timeout
                                    or HANDSHAKE_TIMEOUT_S))
            for rank in self.ranks]
        self._finalizer = weakref.finalize(self, shutdown, self.processes)
        try:
            for proc in self.processes:
                proc.start()
        except BaseException:
            self.close()
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

    def finished_procs(self) -> dict[str, int]:
        """Name -> exit code of every process that has exited."""
        return {p.name: p.exitcode for p in self.processes if p.exitcode is not None}

    def close(self) -> None:
        self._finalizer()


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


# ---- rendezvous (external / hybrid load balancing) ---------------------------------


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
        self._stop.set()
        self._thread.join(timeout=2.0)
        if self._thread.is_alive():  # stuck: close the socket under it
            self._ctx.destroy(linger=0)
        else:
            self._ctx.term()


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


# ---- watching and shutting down --------------------------------------------------


def wait_for_any_exit(procs: Sequence[BaseProcess],
                      timeout: float | None = None) -> list[BaseProcess]:
    """Block until any of `procs` exits (or `timeout` s pass); return those that exited."""
    by_sentinel = {p.sentinel: p for p in procs}
    ready = connection.wait(list(by_sentinel), timeout=timeout)
    exited = [by_sentinel[s] for s in ready]  # type: ignore[index]
    for proc in exited:
        proc.join(timeout=1.0)  # reap: exitcode becomes known
    return exited


def shutdown(procs: Sequence[BaseProcess], timeout: float = 5.0) -> None:
    """terminate -> join until a shared deadline -> kill each survivor's whole tree.

    Idempotent; processes never started are skipped.
    """
    started = [p for p in procs if p.pid is not None]
    for proc in started:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in started:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in started:
        if proc.is_alive():
            logger.warning("%s (pid %d) did not stop in %.0f s; killing its process tree",
                           proc.name, proc.pid, timeout)
            kill_process_tree(proc.pid)  # type: ignore[arg-type]
            proc.join(timeout=1.0)


def kill_process_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (children first)."""
    try:
        root = psutil.Process(pid)
        children = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in [*children, root]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
