"""Process lifecycle, written once: spawn/finalize/close, watching, teardown, orphans.

* `ProcessGroup`: spawned (spawn context) processes tied to a `weakref.finalize`,
  so `close()`, garbage collection and interpreter exit all tear them down once;
  a process can be replaced in place (a restart).
* `wait_for_any_exit`, `shutdown` (terminate -> join with a shared deadline ->
  kill the tree), `kill_process_tree`.
* `engine_context`: in `dpserve serve`, engines start from a forkserver that has
  imported torch and the engine's modules once (`FORKSERVER_PRELOAD`), instead of
  each spawned engine importing them again (seconds of CPU per engine); offline
  `LLM`s in other processes spawn. The forkserver never touches
  CUDA, so a forked engine initialises it as a spawned one would; each engine gets
  the launcher's environment and stdout/stderr as of its start, as spawn gives.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from typing import Any

import psutil

logger = logging.getLogger(__name__)

# Imported once by the engines' forkserver: the first module makes it ignore SIGTERM
# (a signal to the whole process group must not kill it under running engines).
FORKSERVER_PRELOAD = ["dpserve.launch.forkserver_init", "torch", "dpserve.engine.process",
                      "dpserve.engine.core", "dpserve.model.runner", "dpserve.model.llama"]


_forkserver_chosen = False  # set by start_engine_forkserver (the `dpserve serve` process)


def engine_context() -> Any:
    """The multiprocessing context for engine processes: the forkserver preloaded
    with FORKSERVER_PRELOAD once this process chose it (`start_engine_forkserver`),
    else spawn. Only `dpserve serve` chooses it: the forkserver lives as long as the
    process that started it, which there is the server itself; an offline `LLM` in
    a user's process spawns its engines, so nothing outlives the `LLM`."""
    if not _forkserver_chosen:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def start_engine_forkserver() -> None:
    """Choose the forkserver for this process's engines where children can watch
    their launcher by pidfd (Linux), and start it now: its imports take seconds,
    which then overlap the launcher's own start-up."""
    global _forkserver_chosen
    if sys.platform != "linux" or not hasattr(os, "pidfd_open"):
        return
    _forkserver_chosen = True
    from multiprocessing import forkserver

    engine_context()  # sets the preload list
    forkserver.ensure_running()


def stop_engine_forkserver() -> None:
    """Stop the engines' forkserver and multiprocessing's resource tracker now, and
    reap them: at the end of `dpserve serve` (its engines are gone), or after a
    start-up that failed before its first engine (the forkserver may still be
    importing torch, seconds more). Left alone, both exit only after the main
    process, seen as leftovers in its process group by a supervisor that checks it
    then. A no-op for what was never started."""
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver  # the module's one ForkServer (no public stop)
    pid = getattr(server, "_forkserver_pid", None)
    if _forkserver_chosen and pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        server._stop()  # closes its pipe, reaps it, forgets it (a later start makes anew)
    # Its resource tracker (shared with spawned children): closing its pipe makes it
    # exit, `_stop` reaps it. Nothing of ours registers with it after this point.
    resource_tracker._resource_tracker._stop()


class ProcessGroup:
    """Processes spawned for `owner`, stopped once by `close()`, GC or exit.

    `on_close` runs after the processes are stopped (e.g. closing pipes).
    """

    def __init__(self, owner: object, on_close: Callable[[], None] | None = None,
                 context: Any = None) -> None:
        self.processes: list[BaseProcess] = []
        self._ctx = context or multiprocessing.get_context("spawn")
        self._finalizer = weakref.finalize(owner, _close_group, self.processes, on_close)

    @property
    def context(self) -> Any:
        return self._ctx

    def _process(self, target: Callable[..., Any], name: str, kwargs: dict) -> BaseProcess:
        if self._ctx.get_start_method() == "forkserver":  # what spawn would pass on
            stdout, stderr = (_PassedFd(fd) if _is_open(fd) else None for fd in (1, 2))
            kwargs = dict(target=target, kwargs=kwargs, env=dict(os.environ),
                          stdout=stdout, stderr=stderr)
            target = _run_as_spawned
        return self._ctx.Process(target=target, name=name, kwargs=kwargs)

    def spawn(self, target: Callable[..., Any], name: str, **kwargs: Any) -> BaseProcess:
        """Create and start `name`; on failure everything of the group is stopped."""
        proc = self._process(target, name, kwargs)
        self.processes.append(proc)
        try:
            proc.start()
        except BaseException:
            self.close()
            raise
        return proc

    def replace(self, old: BaseProcess, target: Callable[..., Any], **kwargs: Any) -> BaseProcess:
        """Start a new process in `old`'s place (same name); `old` must have exited."""
        proc = self._process(target, old.name, kwargs)
        self.processes[self.processes.index(old)] = proc
        proc.start()
        return proc

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive


class _PassedFd:
    """A file descriptor of the starting process, sent to the child with the process
    object (pickled while the child is being started); an int in the child."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing.reduction import DupFd

        return (_received_fd, (DupFd(self.fd),))


def _received_fd(dup: Any) -> int:
    return dup.detach()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _run_as_spawned(target: Callable[..., Any], kwargs: dict, env: dict[str, str],
                    stdout: int | None, stderr: int | None) -> None:
    """In a forkserver's child: the launcher's environment, stdout/stderr and SIGTERM
    disposition (the forkserver ignores it), then `target(**kwargs)`."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # setproctitle finds its memory next to the original environment: set it up
    # before the environment changes, or `name_process` cannot retitle us.
    import setproctitle

    setproctitle.getproctitle()
    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update((k, v) for k, v in env.items() if os.environ.get(k) != v)
    for fd, received in ((1, stdout), (2, stderr)):
        if received is not None:
            os.dup2(received, fd)
            os.close(received)
    target(**kwargs)


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

