"""`dpserve serve --headless`: this host's engines for a head elsewhere; no API server.

Scope: `run_headless_host(config, ready_timeout)` starts this host's engines
(they handshake with the head at --data-parallel-address:--data-parallel-rpc-port),
watches them under the failure policy (`dpserve.launch.policy`) until a signal
or until none runs, and drains them on SIGTERM/SIGINT. With --kv-offload-memory
the host's own KV store starts first (its engines get its address) and is
restarted when it dies (a start that fails leaves the tier off on this host:
its engines go on without it); it stops last.

Not here: parsing the options (`dpserve.entrypoints.serve`), the head's side
(`dpserve.launch.host`).
"""

from __future__ import annotations

import logging
import sys

from dpserve.config import ConfigError, EngineConfig, ParallelConfig
from dpserve.launch.addresses import AddressAllocator, url_host
from dpserve.launch.engines import EngineProcManager
from dpserve.launch.kv_store import KVStore, start_kv_store
from dpserve.launch.policy import FailureAction, RestartBudget, decide
from dpserve.launch.watch import StopSignal, wait_drained, watch
from dpserve.security import warn_plain_tcp

logger = logging.getLogger("dpserve.serve")


def run_headless_host(config: EngineConfig, ready_timeout: float) -> int:
    """Exits when its engines exit (they stop when the head goes away): 0 if
    they all stopped cleanly, 1 otherwise. SIGTERM/SIGINT drain the engines
    (each gets SIGTERM, finishes its requests for up to --shutdown-timeout s),
    then the same exit codes; a second signal stops at once (128 + the signal).
    """
    p = config.parallel
    if p.local_lb:
        raise ConfigError("--headless hosts run engines for a head's balancer; they take no "
                          "--data-parallel-rank or --data-parallel-hybrid-lb")
    if p.data_parallel_start_rank == 0:
        raise ConfigError("--headless needs --data-parallel-start-rank > 0 (rank 0 runs on "
                          "the head)")
    head = f"tcp://{url_host(p.data_parallel_address)}:{p.data_parallel_rpc_port}"
    warn_plain_tcp(p.data_parallel_address, p.data_parallel_secret)
    logger.info("headless: engines %s for the head at %s", p.local_ranks, head)
    stop = StopSignal()
    allocator = AddressAllocator()
    store: KVStore | None = None
    try:
        config, store = start_kv_store(config, allocator)
        manager = EngineProcManager(config, head, num_engines=p.data_parallel_size_local,
                                    start_rank=p.data_parallel_start_rank, local=False,
                                    handshake_timeout=ready_timeout)
    except BaseException:
        if store is not None:
            store.close()
        allocator.cleanup()
        stop.restore()
        raise
    try:
        failed = _supervise(stop, manager, p, store)
        if stop.signum is not None:
            return _drain(stop, manager, config.shutdown_timeout)
        if failed:
            print(f"dpserve: error: {'; '.join(failed)} (see its log above)", file=sys.stderr)
            return 1
        logger.info("headless: every engine stopped (the head went away)")
        return 0
    finally:
        manager.close()
        if store is not None:
            store.close()
        allocator.cleanup()
        stop.restore()


def _drain(stop: StopSignal, manager: EngineProcManager, timeout: float) -> int:
    """After a signal: SIGTERM to every engine (each drains), wait for them."""
    logger.info("signal %d: draining the engines (up to %g s)", stop.signum, timeout)
    for proc in manager.processes:
        if proc.is_alive():
            proc.terminate()  # an engine drains on its first SIGTERM
    code = wait_drained(stop, manager.processes, [], timeout)[0]
    return 1 if code == 0 and any(manager.finished_procs().values()) else code


def _supervise(stop: StopSignal, manager: EngineProcManager, p: ParallelConfig,
               store: KVStore | None = None) -> list[str]:
    """Watch this host's engines until a signal or until none runs: an engine that
    exits cleanly (its head went away) stays down; one that fails is restarted
    under policy restart (it handshakes with the head again, which then routes to
    it; --max-engine-restarts per rank in the policy's window); under isolate
    it stays down; under stop the host stops. A KV store that dies is restarted
    (`_restart_store`). Returns the failures that ended it."""
    budget = RestartBudget(p.max_engine_restarts)
    incarnations = dict.fromkeys(manager.ranks, 0)
    failed: list[str] = []
    while stop.signum is None:
        live = [proc for proc in manager.processes if proc.exitcode is None]
        if not live:
            return failed
        services = [store.proc] if store is not None and store.proc is not None \
            and store.proc.exitcode is None else []
        for proc in watch(stop, [*live, *services]):
            if proc in services:
                if proc.exitcode != 0:  # 0: stopped by the signal that stops us too
                    _restart_store(store)  # type: ignore[arg-type]
                continue
            rank = manager.ranks[manager.processes.index(proc)]
            what = f"{proc.name} exited with code {proc.exitcode}"
            if proc.exitcode == 0:
                continue
            action = decide(p.engine_failure_policy, budget, rank, can_isolate=True).action
            if action is FailureAction.RESTART:
                incarnations[rank] += 1
                logger.warning("%s; restarting it (incarnation %d)", what, incarnations[rank])
                manager.respawn(rank, incarnations[rank])
                continue
            failed.append(what)
            if action is FailureAction.STOP:
                return failed
            logger.error("rank %d is out: %s", rank, what)
    return failed


def _restart_store(store: KVStore) -> None:
    """The KV store died: a new generation now; if that fails, the tier stays off on
    this host (its engines go on without it)."""
    logger.warning("%s (pid %d) exited with code %s; restarting the KV store",
                   store.proc.name, store.proc.pid, store.proc.exitcode)  # type: ignore[union-attr]
    try:
        store.restart()
    except Exception as e:  # noqa: BLE001 - the engines go on without it
        logger.error("KVStore restart failed: %s; the KV tier stays off on this host", e)
