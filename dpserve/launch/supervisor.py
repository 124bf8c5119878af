"""The failure policy for this host's processes: restart, isolate, or stop.

`Supervisor` watches this host's engines and the DP coordinator from a
thread. The engines are whatever the launcher started them with, seen through
`SupervisedEngines`: `EngineProcManager` (processes, their sentinels) or
`RayEngineManager` (Ray actors, their run refs). When an engine ends, per
`--engine-failure-policy`:

    stop      today's fail-stop: `on_fatal(reason)`, the server exits 1
    isolate   the rank is DEAD for good; the others serve on
    restart   the rank is RESTARTING; after a backoff (0.5 s, doubling, at most
              30 s) a new engine of it (incarnation + 1: a process walked
              through the start-up handshake, or an actor in the rank's
              placement group) is started and waited for, then it is SERVING
              again. More than `--max-engine-restarts` restarts in
              `RESTART_WINDOW_S`: the rank stays DEAD and the log says so.

An operator's restart (`POST /engines/{rank}/restart` -> the coordinator ->
`CoordinatorUpdate.restart`, read on the same socket the RankEvents go out
on) of a rank this host runs, in its current incarnation: RESTARTING (the
front-ends move its requests as on a crash), the engine is killed (a process:
SIGKILL; a Ray actor: by the restart), and a new one started at once, under
any policy and outside `--max-engine-restarts`.

A dead coordinator is restarted under any policy but stop (its sockets keep
their addresses, so engines and front-ends reconnect by themselves; front-ends
balance on their own counts meanwhile).

A dead KV store (`--kv-offload-memory`) is restarted under every policy, in a
thread (a new generation on the same address, the dead one's arena unlinked;
a start that fails is tried again after a backoff, as an engine's): the ranks
go on without the tier meanwhile (misses) and say hello to the new store.

Every state change goes to `on_status(rank, RankStatus)` (the in-process
front-end, the API servers' pipes) and, as a `RankEvent`, to the coordinator,
which publishes it to every front-end. Nothing here touches a request: the
front-ends move requests off ranks that stop serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import zmq

from dpserve.launch.policy import RESTART_WINDOW_S, FailureAction, RestartBudget, decide
from dpserve.launch.process import wait_for_any_exit
from dpserve.protocol import (
    CoordinatorUpdate,
    EngineInitMetadata,
    HandshakeReady,
    RankEvent,
    RankState,
    RankStatus,
)
from dpserve.security import secure

if TYPE_CHECKING:
    from dpserve.config import EngineConfig
    from dpserve.launch.coordinator import DPCoordinator
    from dpserve.launch.kv_store import KVStore

logger = logging.getLogger(__name__)

_FIRST_BACKOFF_S = 0.5
_MAX_BACKOFF_S = 30.0
_POLL_S = 0.5
_GROUP_SIGNAL_GRACE_S = 1.0  # a child's clean exit waits this long for our own drain

OnStatus = Callable[[int, RankStatus], None]


class SupervisedEngines(Protocol):
    """What the Supervisor needs of an engine manager (`EngineProcManager`,
    `RayEngineManager`): its ranks, a bounded wait for engines that ended, and a
    restart of one rank."""

    ranks: list[int]

    def wait_for_exits(self, ranks: Collection[int], timeout: float) -> dict[int, str]:
        """Block up to `timeout` s until the current engine of one of `ranks` ends;
        rank -> what happened (one line) for each that ended, {} if none did."""
        ...

    def restart(self, rank: int, incarnation: int, init: EngineInitMetadata,
                timeout: float) -> HandshakeReady:
        """A new engine for `rank` (whose engine ended), READY when this returns;
        raises (and leaves nothing running) when it does not start."""
        ...


class SupervisedHost(Protocol):
    """What the Supervisor needs of the host's launch (`dpserve.launch.host.EngineLaunch`):
    its engines, its coordinator (if it runs one), and a restart of one rank."""

    manager: Any  # SupervisedEngines, or None when this host runs no engines
    coordinator: DPCoordinator | None
    coordinator_address: str | None  # the coordinator's front XPUB
    kv_store: KVStore | None  # this host's KV store (--kv-offload-memory)

    def restart_engine(self, rank: int, incarnation: int) -> None:
        """A new engine for this host's `rank`, READY when this returns."""
        ...


class Supervisor:
    """See the module docstring. `close()` stops watching (idempotent)."""

    def __init__(self, launch: SupervisedHost, config: EngineConfig, on_status: OnStatus,
                 on_fatal: Callable[[str], None],
                 stopping: Callable[[], bool] = lambda: False) -> None:
        p = config.parallel
        self.launch = launch
        self.engines: SupervisedEngines = launch.manager
        self.policy = p.engine_failure_policy
        self.max_restarts = p.max_engine_restarts
        self.secret = p.data_parallel_secret
        self.on_status = on_status
        self.on_fatal = on_fatal
        self.stopping = stopping  # the server drains: clean exits are expected then
        self.incarnation: dict[int, int] = {}  # rank -> its current process's incarnation
        self.budget = RestartBudget(self.max_restarts)
        self._restarting: set[int] = set()  # ranks whose new engine is starting
        self._out: set[int] = set()  # ranks dead for good (isolate, or past the limit)
        self._handled: set[BaseProcess] = set()  # coordinator / store processes whose exit
        # was handled
        self._store_restarting = False  # its restart thread runs: not watched meanwhile
        self._send_lock = threading.Lock()  # restart threads announce too
        self._stop = threading.Event()
        self._restart_lock = threading.Lock()  # one handshake at a time
        self._thread = threading.Thread(target=self._watch, name="supervisor", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * _POLL_S + 1)

    def reset_rank(self, rank: int) -> None:
        """A new rank (scaling up), perhaps one that ran before: a fresh record."""
        self.incarnation.pop(rank, None)
        self.budget.forget(rank)
        self._out.discard(rank)

    # ---- watching --------------------------------------------------------------

    def _watched_ranks(self) -> list[int]:
        """This host's ranks whose engine runs and is watched: not restarting, not out."""
        return [r for r in getattr(self.engines, "ranks", [])
                if r not in self._restarting and r not in self._out]

    def _service_procs(self) -> list[BaseProcess]:
        """The coordinator's and the KV store's processes, while their exit is not
        handled yet."""
        store = None if self._store_restarting else getattr(self.launch, "kv_store", None)
        services = (self.launch.coordinator, store)
        return [s.proc for s in services
                if s is not None and s.proc is not None and s.proc not in self._handled]

    def _watch(self) -> None:
        with zmq.Context() as ctx:
            events = self._event_socket(ctx)
            while not self._stop.is_set():
                ranks, services = self._watched_ranks(), self._service_procs()
                try:  # the engines first (up to _POLL_S), then the coordinator, the store
                    ended = self.engines.wait_for_exits(ranks, _POLL_S) if ranks else {}
                except Exception as e:  # noqa: BLE001 - e.g. Ray shut down under us
                    if not self._stop.is_set():
                        self._fatal(f"lost track of the engines: {type(e).__name__}: {e}", "")
                    break
                wait = 0.0 if ranks else _POLL_S
                if not services:
                    self._stop.wait(wait)
                    exited = []
                else:
                    exited = wait_for_any_exit(services, timeout=wait)
                for rank, what in sorted(ended.items()):
                    if self._stop.is_set():
                        break
                    if rank not in self.engines.ranks:
                        continue  # removed by a scale-down: its exit is expected
                    if self._stopped_by_drain(self._exit_code(rank)):
                        self._out.add(rank)  # stays down: the server is stopping
                        continue
                    self._engine_died(rank, what, events)
                for proc in exited:
                    if self._stop.is_set():
                        break
                    self._handled.add(proc)
                    if self._stopped_by_drain(proc.exitcode):
                        continue
                    what = f"{proc.name} (pid {proc.pid}) exited with code {proc.exitcode}"
                    if self.launch.coordinator and proc is self.launch.coordinator.proc:
                        self._coordinator_died(what)
                    else:
                        self._store_restarting = True
                        threading.Thread(target=self._restart_kv_store, args=(what,),
                                         name="restart-kv-store", daemon=True).start()
                self._read_restart_requests(events)
            if events is not None:
                events.close(linger=500)

    def _exit_code(self, rank: int) -> int | None:
        """The exit code of `rank`'s process (local engines; None for Ray actors)."""
        procs = getattr(self.engines, "processes", None)
        if procs is None:
            return None
        return procs[self.engines.ranks.index(rank)].exitcode

    def _stopped_by_drain(self, exit_code: int | None) -> bool:
        """A clean exit (code 0) while the server drains: the signal that started the
        drain reached the whole process group. It may reach us a moment after the
        child: wait `_GROUP_SIGNAL_GRACE_S` for our own drain to begin."""
        if exit_code != 0:
            return False
        deadline = time.monotonic() + _GROUP_SIGNAL_GRACE_S
        while not self.stopping() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.stopping():
            logger.info("a process exited cleanly while the server drains")
            return True
        return False

    def _event_socket(self, ctx: zmq.Context) -> zmq.Socket | None:
        """An XSUB to the coordinator's front socket (it takes our RankEvents; we read
        its updates for operators' restarts)."""
        address = self.launch.coordinator_address
        if address is None:
            return None
        sock = secure(ctx.socket(zmq.XSUB), "client", self.secret)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send(b"\x01")  # subscribe to every update
        return sock

    def _read_restart_requests(self, events: zmq.Socket | None) -> None:
        """Act on the operators' restarts among the coordinator's updates so far."""
        if events is None:
            return
        decoder = msgspec.msgpack.Decoder(CoordinatorUpdate)
        while True:
            try:
                with self._send_lock:  # restart threads send on this socket
                    body = events.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                restart = decoder.decode(body).restart
            except msgspec.DecodeError:
                continue
            if restart is not None and not self._stop.is_set():
                self._restart_requested(restart.rank, restart.incarnation, events)

    def _restart_requested(self, rank: int, incarnation: int,
                           events: zmq.Socket | None) -> None:
        """Restart `rank` now if this host runs its process `incarnation`."""
        if rank not in getattr(self.engines, "ranks", []) or rank in self._restarting \
                or rank in self._out or incarnation != self.incarnation.get(rank, 0):
            return  # not ours, already restarting or out, or stale news
        what = "restart asked by an operator"
        logger.warning("rank %d: %s", rank, what)
        self._announce(rank, RankStatus(RankState.RESTARTING, incarnation, what), events)
        self._restarting.add(rank)
        kill = getattr(self.engines, "kill", None)  # processes; a Ray restart kills the actor
        if kill is not None:
            kill(rank)
        threading.Thread(target=self._restart, args=(rank, incarnation + 1, events, True),
                         name=f"restart-rank-{rank}", daemon=True).start()

    def _announce(self, rank: int, status: RankStatus, events: zmq.Socket | None) -> None:
        try:
            self.on_status(rank, status)
        except Exception:  # noqa: BLE001 - a listener's failure must not stop supervision
            logger.exception("rank status listener failed")
        if events is not None:
            try:
                with self._send_lock:
                    events.send(msgspec.msgpack.encode(RankEvent(rank, status)),
                                flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:
                logger.warning("could not tell the coordinator about rank %d: %s", rank, e)

    # ---- policies ------------------------------------------------------------------

    def _fatal(self, what: str, why: str = "--engine-failure-policy stop: ") -> None:
        logger.error("%s; %sstopping the server", what, why)
        self.on_fatal(what)
        self._stop.set()

    def _engine_died(self, rank: int, what: str, events: zmq.Socket | None) -> None:
        incarnation = self.incarnation.get(rank, 0)
        decision = decide(self.policy, self.budget, rank, can_isolate=True)
        if decision.action is FailureAction.STOP:
            self._fatal(what)
            return
        if decision.action is FailureAction.ISOLATE:
            why = (f"{what}; restarted {self.max_restarts} times within "
                   f"{RESTART_WINDOW_S / 60:.0f} minutes (--max-engine-restarts): it stays out"
                   if decision.budget_spent else what)
            logger.error("rank %d is out: %s", rank, why)
            self._out.add(rank)
            self._announce(rank, RankStatus(RankState.DEAD, incarnation, why), events)
            return
        logger.warning("rank %d: %s; restarting it", rank, what)
        self._announce(rank, RankStatus(RankState.RESTARTING, incarnation, what), events)
        self._restarting.add(rank)
        threading.Thread(target=self._restart, args=(rank, incarnation + 1, events),
                         name=f"restart-rank-{rank}", daemon=True).start()

    def _restart(self, rank: int, incarnation: int, events: zmq.Socket | None,
                 requested: bool = False) -> None:
        """Start `rank`'s new engine (after a backoff that doubles with each restart in
        the budget's window, unless an operator asked) and announce it serving; a
        failed start is one more death."""
        if not requested:  # `decide` took this restart from the budget already
            backoff = min(_MAX_BACKOFF_S,
                          _FIRST_BACKOFF_S * 2 ** max(0, self.budget.used(rank) - 1))
            if self._stop.wait(backoff):
                return
        self.incarnation[rank] = incarnation
        try:
            with self._restart_lock:
                self.launch.restart_engine(rank, incarnation)
        except Exception as e:  # noqa: BLE001 - a failed start is one more death
            self._restarting.discard(rank)
            if not self._stop.is_set():
                self._engine_died(rank, f"restart failed: {e}", events)
            return
        self._restarting.discard(rank)
        if self._stop.is_set():
            return
        logger.info("rank %d serving again (incarnation %d)", rank, incarnation)
        self._announce(rank, RankStatus(RankState.SERVING, incarnation), events)

    def _coordinator_died(self, what: str) -> None:
        # No budget: its sockets keep their addresses, a new one takes over at once.
        if decide(self.policy, None, -1, can_isolate=False).action is FailureAction.STOP:
            self._fatal(what)
            return
        logger.warning("%s; restarting the DP coordinator (front-ends balance on their own "
                       "counts meanwhile)", what)
        try:
            self.launch.coordinator.restart()  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001
            logger.error("could not restart the DP coordinator: %s; stopping", e)
            self.on_fatal(f"{what}; restart failed: {e}")
            self._stop.set()

    def _restart_kv_store(self, what: str) -> None:
        """A new KV store in place of the dead one; a failed start is tried again after
        a backoff (doubling up to _MAX_BACKOFF_S) until one starts or we stop."""
        store = self.launch.kv_store
        assert store is not None
        backoff = _FIRST_BACKOFF_S
        logger.warning("%s; restarting the KV store (the ranks miss the tier meanwhile)", what)
        try:
            while not self._stop.is_set():
                try:
                    store.restart()
                except Exception as e:  # noqa: BLE001 - the ranks go on without it
                    logger.error("KVStore restart failed: %s; trying again in %.1f s", e,
                                 backoff)
                    if self._stop.wait(backoff):
                        return
                    backoff = min(_MAX_BACKOFF_S, 2 * backoff)
                    continue
                logger.info("KVStore serving again (generation %d)", store.generation)
                return
        finally:
            self._store_restarting = False
