"""Ray backend teardown: what `RayEngineManager.close()` (and its finalizer) does.

Scope: the state teardown needs (`RayState`, shared with the finalizer, which
must not hold the manager), killing the engine actors and removing the
placement groups, shutting down a Ray instance the manager connected, each
with a deadline (Ray's calls block for about a minute once its own processes
are gone or stopped), then SIGKILL for whatever still runs on this host (the
local instance's processes and their descendants, the engine actors here).
See `dpserve.launch.ray_backend` for the whole backend.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psutil

logger = logging.getLogger("dpserve.launch.ray_backend")

RAY_CALL_S = 3.0  # killing the actors and removing the placement groups
_RAY_SHUTDOWN_S = 5.0  # ray.shutdown() (a healthy one takes about a second)
_REAP_S = 3.0  # then this long for this host's processes to exit, else SIGKILL
_WATCHER_JOIN_S = 2.0


@dataclass
class RayState:
    """What teardown needs (shared with the finalizer, which must not hold the manager)."""

    owns_connection: bool = False  # this manager called ray.init
    actors: list[Any] = field(default_factory=list)  # each rank's current actor
    placement_groups: list[Any] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)  # restart vs. teardown
    watcher: threading.Thread | None = None
    # Processes on this host that must not outlive teardown: the local Ray
    # instance's (when this manager started it) and the engine actors here.
    host_procs: list[psutil.Process] = field(default_factory=list)
    local_instance: list[psutil.Process] = field(default_factory=list)  # started by ray.init here


def teardown(state: RayState) -> None:
    """Stop the watcher; kill the actors and remove the placement groups
    (bounded); shut the local instance down if this manager connected
    (bounded); then SIGKILL what still runs on this host (module docstring)."""
    state.stop.set()
    if state.watcher is not None and state.watcher is not threading.current_thread():
        state.watcher.join(timeout=_WATCHER_JOIN_S)
    ray = sys.modules.get("ray")
    # Not connected: never connected, or Ray already shut down (its atexit hook runs first).
    if ray is not None and ray.is_initialized():
        # A stop signal to the whole process group (or Ray frozen): every Ray call
        # would block for its full deadline, so none is made; _reap kills the rest.
        down = _local_instance_down(state.local_instance)
        if down:
            logger.info("the local Ray instance is going down or stopped; skipping "
                        "Ray's own teardown")
        else:
            with lock_within(state.lock, RAY_CALL_S):  # no restart swaps an actor meanwhile
                actors, groups = list(state.actors), list(state.placement_groups)
            if not within(RAY_CALL_S, release, ray, actors, groups):
                logger.warning("Ray did not remove the engine actors' placement groups "
                               "within %.0f s (are its processes gone?); going on",
                               RAY_CALL_S)
        state.actors.clear()
        state.placement_groups.clear()
        if state.owns_connection:
            state.owns_connection = False
            if down:
                _abandon_connection(ray)
            elif not within(_RAY_SHUTDOWN_S, ray.shutdown):
                logger.warning("ray.shutdown() did not return within %.0f s; killing the "
                               "Ray processes on this host", _RAY_SHUTDOWN_S)
                _abandon_connection(ray)
    _reap(state.host_procs)
    state.host_procs.clear()
    state.local_instance.clear()


def _local_instance_down(procs: list[psutil.Process]) -> bool:
    """Whether a process of the local Ray instance (gcs_server, raylet, its agents
    and monitors) has exited or is stopped (SIGSTOP): none does while it runs, and
    a stop signal to the process group ends the agents at once. False when this
    manager started no instance (it joined a cluster)."""
    for p in procs:
        try:
            if not p.is_running() or p.status() in (psutil.STATUS_ZOMBIE,
                                                    psutil.STATUS_STOPPED):
                return True
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:
            pass
    return False


@contextmanager
def lock_within(lock: threading.Lock, timeout: float):
    """Hold `lock` if it comes within `timeout` s (else go on without it)."""
    held = lock.acquire(timeout=timeout)
    try:
        yield
    finally:
        if held:
            lock.release()


def release(ray: Any, actors: list[Any], placement_groups: list[Any]) -> None:
    from ray.util.placement_group import remove_placement_group

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as e:  # already dead, or the cluster is gone
            logger.debug("could not kill an engine actor: %s", e)
    for pg in placement_groups:
        try:
            remove_placement_group(pg)
        except Exception as e:
            logger.warning("could not remove placement group %s: %s", pg.id.hex(), e)


def _abandon_connection(ray: Any) -> None:
    """Leave this process's connection to a Ray instance that is gone or frozen.

    Ray's atexit hook would call shutdown() again (and wait on Ray's lock, or
    block); it is dropped, since what it would stop is killed. Its core worker
    still holds the dead connection, and the interpreter's own teardown can crash
    in it (SIGSEGV): `connection_abandoned()` tells the command to end the
    process with os._exit once everything else is closed.
    """
    import atexit

    global _abandoned
    atexit.unregister(getattr(ray._private.worker, "shutdown", ray.shutdown))
    _abandoned = True


_abandoned = False


def connection_abandoned() -> bool:
    """Whether this process left a Ray connection behind (`_abandon_connection`)."""
    return _abandoned


def within(timeout: float, fn: Callable[..., object], *args: object) -> bool:
    """Run `fn(*args)` in a daemon thread; False if it has not returned after
    `timeout` s (it is left blocked: Ray calls cannot be cancelled)."""
    def call() -> None:
        try:
            fn(*args)
        except Exception as e:
            logger.warning("Ray teardown: %s: %s", type(e).__name__, e)

    thread = threading.Thread(target=call, name="ray-teardown", daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive()


def _reap(procs: list[psutil.Process]) -> None:
    """Give `procs` `_REAP_S` seconds to exit, then SIGKILL each survivor and
    its descendants (collected first: Ray's workers outlive a killed raylet)."""
    alive = _running(procs, _REAP_S)
    doomed: dict[int, psutil.Process] = {}
    for proc in alive:
        try:
            for p in [proc, *proc.children(recursive=True)]:
                doomed[p.pid] = p
        except psutil.Error:
            pass
    if doomed:
        logger.warning("killing %d process(es) the Ray backend left on this host: %s",
                       len(doomed), ", ".join(_describe_proc(p) for p in doomed.values()))
    for p in doomed.values():
        try:
            p.kill()  # psutil refuses if the pid was reused meanwhile
        except psutil.Error:
            pass
    _running(list(doomed.values()), 1.0)


def _running(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to `timeout` s for `procs` to exit; those still running (a zombie
    counts as gone: an orphan's may wait for a reaper that never comes)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.Error:
                pass
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def _describe_proc(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} ({proc.name()})"
    except psutil.Error:
        return str(proc.pid)


def child_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children()}


def new_children(before: set[int]) -> list[psutil.Process]:
    return [p for p in psutil.Process().children() if p.pid not in before]


def processes(pids: Sequence[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return out

