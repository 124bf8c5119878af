"""Process lifecycle, written once: spawn/finalize/close, watching, teardown, orphans.

* `ProcessGroup`: spawned (spawn context) processes tied to a `weakref.finalize`,
  so `close()`, garbage collection and interpreter exit all tear them down once;
  a process can be replaced in place (a restart).
* `wait_for_any_exit`, `shutdown` (terminate -> join with a shared deadline ->
  kill the tree), `kill_process_tree`.
* `start_parent_watcher`: in a child, exit when the parent dies (re-parenting).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from typing import Any

import psutil

logger = logging.getLogger(__name__)

PARENT_POLL_S = 1.0
PARENT_GRACE_S = 10.0  # after asking itself to stop, an orphan hard-exits after this


class ProcessGroup:
    """Processes spawned for `owner`, stopped once by `close()`, GC or exit.

    `on_close` runs after the processes are stopped (e.g. closing pipes).
    """

    def __init__(self, owner: object, on_close: Callable[[], None] | None = None) -> None:
        self.processes: list[BaseProcess] = []
        self._ctx = multiprocessing.get_context("spawn")
        self._finalizer = weakref.finalize(owner, _close_group, self.processes, on_close)

    @property
    def context(self) -> Any:
        return self._ctx

    def spawn(self, target: Callable[..., Any], name: str, **kwargs: Any) -> BaseProcess:
        """Create and start `name`; on failure everything of the group is stopped."""
        proc = self._ctx.Process(target=target, name=name, kwargs=kwargs)
        self.processes.append(proc)
        try:
            proc.start()
        except BaseException:
            self.close()
            raise
        return proc

    def replace(self, old: BaseProcess, target: Callable[..., Any], **kwargs: Any) -> BaseProcess:
        """Start a new process in `old`'s place (same name); `old` must have exited."""
        proc = self._ctx.Process(target=target, name=old.name, kwargs=kwargs)
        self.processes[self.processes.index(old)] = proc
        proc.start()
        return proc

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive


def _close_group(procs: list[BaseProcess], on_close: Callable[[], None] | None) -> None:
    try:
        shutdown(procs)
    finally:
        if on_close is not None:
            on_close()


def stop_socket_thread(stop: threading.Event, thread: threading.Thread,
                       ctx: Any) -> None:
    """Stop a daemon thread that serves a ZMQ socket of `ctx` (rendezvous, rejoin):
    set `stop`, join (bounded); if it is stuck, close its socket under it."""
    stop.set()
    thread.join(timeout=2.0)
    if thread.is_alive():
        ctx.destroy(linger=0)
    else:
        ctx.term()


def start_parent_watcher(parent_pid: int, what: str = "process") -> None:
    """Exit when the parent dies (we get re-parented): SIGTERM ourselves, then, if
    the main thread is stuck, hard-exit after a grace period."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        logger.warning("parent process %d is gone; %s shutting down", parent_pid, what)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(PARENT_GRACE_S)
        logger.error("still alive %.0f s after the parent died; exiting hard", PARENT_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watcher", daemon=True).start()


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

