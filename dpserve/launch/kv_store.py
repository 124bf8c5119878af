"""The launcher's handle on its host's KV store process (`dpserve::KVStore`).

Scope: `start_kv_store` starts one for a config with --kv-offload-memory and
returns the config the host's engines get (naming its addresses). `KVStore`
first unlinks the arenas that dpserve processes SIGKILLed whole left in /dev/shm
(`sweep_dead_arenas`) and checks that /dev/shm can hold the budget; it
allocates the store's ipc:// address (in the launcher's private directory) and,
for a server that spans hosts, a tcp:// one on this host's address for other
hosts' pulls (`store_host`; refused off loopback without a secret, as every
tcp:// data-plane socket), names each start's arena (`new_arena_name`: a new one
per start), spawns `run_kv_store` and waits until it answers (bounded; it
watches the process, so a store that fails at start, e.g. /dev/shm too small,
fails the launch at once). `restart()` replaces a dead store on the same
addresses with a new generation and a new arena, after unlinking the dead one's;
`close()` stops it (terminate -> join -> kill) and unlinks whatever arena is
left, also when the handle is collected or the interpreter exits.

Not here: what the store does (`dpserve.kv_tier.server`), when it is restarted
(`dpserve.launch.supervisor`, `dpserve.launch.headless`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from multiprocessing.process import BaseProcess

import msgspec
import zmq

from dpserve.config import ConfigError, EngineConfig, replace
from dpserve.kv_tier.arena import (
    new_arena_name,
    shm_free_bytes,
    sweep_dead_arenas,
    unlink_arena,
)
from dpserve.kv_tier.messages import Call, GetStats, Reply
from dpserve.kv_tier.server import run_kv_store
from dpserve.launch.addresses import AddressAllocator, pick_port, url_host
from dpserve.launch.engines import EngineStartupError
from dpserve.launch.process import ProcessGroup, shutdown
from dpserve.security import address_towards, check_exposure, secure

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 30.0  # a store allocates its arena, then binds: seconds at most
_PROBE_SLICE_S = 0.1


class KVStoreError(EngineStartupError):
    """The KV store did not start (it exited, or did not answer in time)."""


class KVStore:
    """See the module docstring. `start()` once, then `restart()` after each death."""

    def __init__(self, arena_bytes: int, allocator: AddressAllocator,
                 secret: str | None = None, remote_host: str | None = None) -> None:
        for name in sweep_dead_arenas():
            logger.warning("removed %s from /dev/shm: its dpserve is gone", name)
        free = shm_free_bytes()
        if free is None or free < arena_bytes:
            raise ConfigError(f"kv_offload_memory: {arena_bytes} bytes do not fit in /dev/shm "
                              f"({'missing' if free is None else f'{free} bytes free'})")
        self.arena_bytes = arena_bytes
        self.address = allocator.new_address("kv-store")
        # Other hosts' pulls (a server over several hosts): a port of this host's address.
        self.remote_address = (f"tcp://{url_host(remote_host)}:{pick_port(remote_host)}"
                               if remote_host is not None else None)
        self.secret = secret
        self.generation = -1
        self.arena_name: str | None = None
        self.proc: BaseProcess | None = None
        self._arenas: list[str] = []  # names to unlink at close (the finalizer's own list)
        self._lock = threading.Lock()  # a restart (supervisor thread) never spawns after close
        self._group = ProcessGroup(self, on_close=lambda arenas=self._arenas: _unlink(arenas))

    def start(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Spawn generation 0 and wait until it answers (KVStoreError if it does not)."""
        if self.proc is not None:
            raise RuntimeError("KVStore already started")
        self.proc = self._group.spawn(run_kv_store, "KVStore", **self._next_kwargs())
        self._wait_ready(timeout)

    def restart(self, timeout: float = READY_TIMEOUT_S) -> None:
        """A new store (next generation, new arena) in place of the dead one, whose arena
        is unlinked first; KVStoreError if it does not start."""
        assert self.proc is not None
        with self._lock:
            if self._group.closed:
                raise KVStoreError("KVStore closed")
            self.proc.join(timeout=1.0)
            _unlink(self._arenas)
            self.proc = self._group.replace(self.proc, run_kv_store, **self._next_kwargs())
        self._wait_ready(timeout)

    def close(self) -> None:
        """Stop the store; no arena of it is left (idempotent)."""
        with self._lock:
            self._group.close()

    def _next_kwargs(self) -> dict:
        self.generation += 1
        self.arena_name = new_arena_name(os.getpid(), self.generation)
        self._arenas.append(self.arena_name)
        return dict(address=self.address, arena_name=self.arena_name,
                    arena_bytes=self.arena_bytes, generation=self.generation,
                    parent_pid=os.getpid(), secret=self.secret,
                    remote_address=self.remote_address)

    def _wait_ready(self, timeout: float) -> None:
        """Until the store answers a stats call; KVStoreError when it exits first or
        `timeout` passes (then it is stopped)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        with zmq.Context() as ctx:
            sock = secure(ctx.socket(zmq.DEALER), "client", self.secret)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(self.address)
                sock.send(msgspec.msgpack.encode(Call(0, GetStats())))
                while not sock.poll(_PROBE_SLICE_S * 1000):
                    if self.proc.exitcode is not None:
                        raise KVStoreError(f"KVStore exited with code {self.proc.exitcode} "
                                           f"while starting (see its log above)")
                    if time.monotonic() > deadline:
                        shutdown([self.proc])
                        _unlink(self._arenas)
                        raise KVStoreError(f"KVStore did not answer within {timeout:g} s")
                stats = msgspec.msgpack.decode(sock.recv(), type=Reply).stats
            finally:
                sock.close()
        logger.info("KVStore (pid %d) generation %d serving %d bytes at %s", self.proc.pid,
                    stats.generation if stats else self.generation, self.arena_bytes,
                    self.address)


def start_kv_store(config: EngineConfig, allocator: AddressAllocator
                   ) -> tuple[EngineConfig, KVStore | None]:
    """With --kv-offload-memory: start this host's KV store (its address from
    `allocator`; with a tcp:// endpoint for other hosts' pulls when the server spans
    hosts: `store_host`) and return the config its engines get, naming both
    addresses, and the store; else (`config`, None). A store that fails to start is
    stopped."""
    if not config.cache.kv_offload_bytes:
        return config, None
    p = config.parallel
    host = store_host(config)
    if host is not None:  # the rule of every tcp:// data-plane socket
        check_exposure(host, p.data_parallel_secret, p.data_parallel_insecure)
    store = KVStore(config.cache.kv_offload_bytes, allocator,
                    secret=p.data_parallel_secret, remote_host=host)
    try:
        store.start()
    except BaseException:
        store.close()
        raise
    return replace(config, cache=replace(config.cache, kv_tier_address=store.address,
                                         kv_tier_remote_address=store.remote_address)), store


def store_host(config: EngineConfig) -> str | None:
    """Where this host's store takes other hosts' pulls: None on one host (no tcp://
    data plane); the head (or the local-LB leader, start rank 0) binds
    --data-parallel-address, its own; another host binds its address that routes
    to it."""
    p = config.parallel
    if not p.tcp_data_plane:
        return None
    if p.data_parallel_start_rank == 0:
        return p.data_parallel_address
    return address_towards(p.data_parallel_address)


def _unlink(arenas: list[str]) -> None:
    """Unlink every arena named in `arenas` (a dead store's, or all at close)."""
    while arenas:
        unlink_arena(arenas.pop())
