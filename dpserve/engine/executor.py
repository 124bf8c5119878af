"""Executors: how an engine core runs its model, on one worker or on the N
workers of tensor parallelism (`--tensor-parallel-size`, vLLM's executors).

Scope: `make_executor` picks `UniprocExecutor` (TP=1: the `ModelRunner` in
this process, nothing added) or `MultiprocExecutor` (TP=N>1: this process is
worker 0, workers 1..N-1 are spawned processes it starts, feeds, watches and
stops). The engine core uses one interface:

    driver                       worker 0's ModelRunner (read-only use: generators,
                                 model, expert_parallel, kv_heads)
    execute(scheduler_output)    one step on every worker; worker 0's output
    collective_rpc(method, ...)  ModelRunner.<method> on every worker; results in
                                 worker order
    worker_info()                [TPWorkerInfo] of every worker
    shutdown()                   stop the workers (idempotent; also at GC / exit)
    on_failure                   set by the engine process: called (from the monitor
                                 thread) with the reason when a worker dies

A step goes to the peers as one broadcast message (`shm_broadcast`), trimmed
to what they read (`tp_worker.peer_step`); worker 0 keeps the full records
(it samples) and does not wait for the peers' replies: the step's
collectives keep the workers together. A dead worker (its sentinel, watched
by a monitor thread) or a failed or timed-out collective raises
`TensorParallelError` naming the worker, and every later call raises it
again: the DP rank fails as a whole (the engine process sends
ENGINE_CORE_DEAD and exits 1; its restart forms a new group).

Lifecycle: workers are spawned (forking after torch / OpenMP / CUDA start-up
is unsafe), form the group over a FileStore in a private 0700 directory
(removed once the group is formed, as the broadcast's name is unlinked once
every worker attached), load their shard, then serve the broadcast until a
shutdown message, the engine core's death (parent watch) or the broadcast
writer's death. `shutdown()` asks them to exit, joins with a deadline, then
kills; daemonic, so multiprocessing's exit hook terminates any left too.

Not here: the worker process itself and the messages (`dpserve.engine.tp_worker`),
the sharding (`dpserve.model.tensor_parallel`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_ready
from typing import Any

from dpserve.config import EngineConfig
from dpserve.engine.shm_broadcast import BroadcastError, BroadcastWriter
from dpserve.engine.tp_worker import (
    device_name,
    form_group,
    peer_step,
    run_tp_worker,
    worker_config,
    worker_cpus,
    worker_device,
)
from dpserve.errors import TensorParallelError
from dpserve.protocol import TPWorkerInfo

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 600.0  # spawn + group + model load of every worker
RPC_TIMEOUT_S = 600.0  # default bound of a collective_rpc (a sleep level 2 wake reloads)
STOP_TIMEOUT_S = 5.0  # shutdown: wait this long for workers to exit, then kill
_POLL_S = 0.1  # replies are polled this often, with a liveness check in between


def make_executor(config: EngineConfig, dp_rank: int) -> UniprocExecutor | MultiprocExecutor:
    if config.parallel.tensor_parallel_size == 1:
        return UniprocExecutor(config, dp_rank)
    return MultiprocExecutor(config, dp_rank)


class UniprocExecutor:
    """TP=1: the model runner in this process (see the module docstring)."""

    def __init__(self, config: EngineConfig, dp_rank: int) -> None:
        from dpserve.model.runner import ModelRunner

        self.driver = ModelRunner(config, dp_rank)
        self.execute = self.driver.execute  # no indirection on the step path
        self.execute_dummy = self.driver.execute_dummy
        self.on_failure: Callable[[str], None] | None = None  # nothing can fail apart

    def collective_rpc(self, method: str, *args: Any, timeout: float | None = None,
                       **kwargs: Any) -> list[Any]:
        return [getattr(self.driver, method)(*args, **kwargs)]

    def worker_info(self) -> list[TPWorkerInfo]:
        return [TPWorkerInfo(0, os.getpid(), device_name(self.driver.device),
                             _rss(os.getpid()))]

    def shutdown(self) -> None:
        """Nothing to stop: the one worker is this process."""


@dataclass
class _Worker:
    tp_rank: int
    process: Any  # multiprocessing.Process
    conn: Any  # its reply pipe (read end)
    device: str = ""

    def describe(self) -> str:
        return f"tensor-parallel worker {self.tp_rank} (pid {self.process.pid})"


class _Health:
    """The executor's failure, shared with its monitor thread (which must not hold the
    executor itself: garbage collection stops the workers)."""

    def __init__(self) -> None:
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self.stopping = False

    def fail(self, reason: str) -> None:
        if self.failure is None and not self.stopping:
            self.failure = reason
            logger.error("%s", reason)
            if self.on_failure is not None:
                self.on_failure(reason)


class MultiprocExecutor:
    """TP=N>1: worker 0 here, workers 1..N-1 spawned (see the module docstring)."""

    def __init__(self, config: EngineConfig, dp_rank: int) -> None:
        self.size = config.parallel.tensor_parallel_size
        self.dp_rank = dp_rank
        self.collective_timeout = config.parallel.data_parallel_collective_timeout
        self.block_size = config.cache.block_size
        self._health = _Health()
        self._dir = tempfile.mkdtemp(prefix=f"dpserve-tp{dp_rank}-")  # mode 0700
        self._workers: list[_Worker] = []
        # (neither the liveness check nor the monitor may hold `self`: see _Health)
        self._broadcast = BroadcastWriter(
            self.size - 1, check_readers=functools.partial(_check_workers, self._workers,
                                                           dp_rank))
        self._wake_r, self._wake_w = os.pipe()  # wakes the monitor at shutdown
        self._finalizer = weakref.finalize(self, _stop, self._workers, self._broadcast,
                                           self._dir, self._health, self._wake_w)
        try:
            self.driver = self._start(worker_config(config), dp_rank)
        except BaseException:
            os.close(self._wake_r)  # no monitor to close it
            self.shutdown()
            raise
        # Every worker attached and formed the group: nothing is left behind on disk or
        # in /dev/shm from here on, even if this process dies hard.
        self._broadcast.unlink()
        shutil.rmtree(self._dir, ignore_errors=True)
        threading.Thread(target=_monitor, args=(self._workers, self._health, self._wake_r,
                                                dp_rank),
                         name=f"TPMonitor_{dp_rank}", daemon=True).start()
        logger.info("tensor parallel: %d workers (worker pids %s)", self.size,
                    ", ".join(str(w.process.pid) for w in self._workers))

    @property
    def on_failure(self) -> Callable[[str], None] | None:
        return self._health.on_failure

    @on_failure.setter
    def on_failure(self, callback: Callable[[str], None] | None) -> None:
        self._health.on_failure = callback
        if callback is not None and self._health.failure is not None:
            callback(self._health.failure)  # it died before anyone listened

    def _start(self, config: EngineConfig, dp_rank: int) -> Any:
        """Spawn workers 1..N-1, form the group with them, load shard 0 here, wait
        until each has loaded its own."""
        from dpserve.model.runner import ModelRunner
        from dpserve.model.tensor_parallel import TensorParallel

        ctx = multiprocessing.get_context("spawn")
        store = os.path.join(self._dir, "store")
        for t in range(1, self.size):
            recv, send = ctx.Pipe(duplex=False)
            device = worker_device(config, dp_rank, t) if config.device == "cuda" else None
            process = ctx.Process(
                target=run_tp_worker, name=f"TPWorker_{dp_rank}_{t}", daemon=True,
                args=(config, dp_rank, t, store, self._broadcast.handle, send, device,
                      worker_cpus(config, dp_rank, t)))
            process.start()
            send.close()
            self._workers.append(_Worker(t, process, recv))
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        for w in self._workers:  # every peer attached: the group can form
            self._reply(w, "hello", deadline)
        group = form_group(store, 0, self.size, config.device, self.collective_timeout)
        driver = ModelRunner(config, dp_rank, TensorParallel(0, self.size, group))
        for w in self._workers:
            w.device = self._reply(w, "ready", deadline)
        return driver

    # ---- the interface -----------------------------------------------------

    def execute(self, scheduler_output: Any) -> Any:
        """Broadcast the (trimmed) step, run it here, return worker 0's output."""
        self._send(("execute", peer_step(scheduler_output, self.block_size)))
        try:
            return self.driver.execute(scheduler_output)
        except TensorParallelError as e:
            raise self._failed(f"step failed: {e}") from e

    def execute_dummy(self) -> None:
        self.collective_rpc("execute_dummy")

    def collective_rpc(self, method: str, *args: Any, timeout: float | None = None,
                       **kwargs: Any) -> list[Any]:
        """ModelRunner.<method>(*args, **kwargs) on every worker; their results in
        worker order. A failure anywhere raises TensorParallelError naming the worker."""
        self._send(("rpc", method, args, kwargs))
        deadline = time.monotonic() + (RPC_TIMEOUT_S if timeout is None else timeout)
        try:
            results = [getattr(self.driver, method)(*args, **kwargs)]
        except Exception as e:  # worker 0's own error keeps its type (a budget ValueError)
            e.add_note(f"(in tensor-parallel worker 0 of DP rank {self.dp_rank})")
            for w in self._workers:  # their replies too, so the pipes stay in step
                with contextlib.suppress(TensorParallelError):
                    self._reply(w, "ok", deadline, method)
            raise
        return results + [self._reply(w, "ok", deadline, method) for w in self._workers]

    def worker_info(self) -> list[TPWorkerInfo]:
        return [TPWorkerInfo(0, os.getpid(), device_name(self.driver.device),
                             _rss(os.getpid())),
                *(TPWorkerInfo(w.tp_rank, w.process.pid, w.device, _rss(w.process.pid))
                  for w in self._workers)]

    def shutdown(self) -> None:
        """Stop every worker (shutdown message, join with a deadline, kill); idempotent."""
        self._finalizer()

    # ---- internals ---------------------------------------------------------

    def _send(self, message: tuple) -> None:
        if self._health.failure is not None:
            raise TensorParallelError(self._health.failure)
        try:
            self._broadcast.enqueue(message, timeout=self.collective_timeout)
        except BroadcastError as e:
            raise self._failed(str(e)) from e

    def _failed(self, reason: str) -> TensorParallelError:
        """Record the rank's failure; name a worker that died (given a moment to exit:
        a peer's death is what usually fails worker 0's collective)."""
        deadline = time.monotonic() + 1.0
        dead: list[_Worker] = []
        while not dead and time.monotonic() < deadline:
            dead = [w for w in self._workers if not w.process.is_alive()]
            if not dead:
                wait_ready([w.process.sentinel for w in self._workers], timeout=_POLL_S)
        if dead and dead[0].describe() not in reason:
            reason = f"{_death(dead[0], self.dp_rank)}; {reason}"
        self._health.fail(reason)
        return TensorParallelError(self._health.failure or reason)

    def _reply(self, w: _Worker, expected: str, deadline: float, method: str = "") -> Any:
        """The next reply of worker `w`: its value if tagged `expected`; raise when it
        reports an error, dies, or the deadline passes."""
        while not w.conn.poll(_POLL_S):
            if not w.process.is_alive() and not w.conn.poll(0):
                raise self._failed(_death(w, self.dp_rank))
            if time.monotonic() >= deadline:
                raise self._failed(f"{w.describe()}: no answer to {method or expected} in time")
        try:
            tag, value = w.conn.recv()
        except (EOFError, OSError):
            w.process.join(1.0)
            raise self._failed(_death(w, self.dp_rank)) from None
        if tag != expected:
            what = f"{method}() failed" if method else "failed to start"
            raise self._failed(f"{w.describe()}: {what}: {value}")
        return value


def _death(w: _Worker, dp_rank: int) -> str:
    return (f"tensor-parallel worker {w.tp_rank} (pid {w.process.pid}) of DP rank "
            f"{dp_rank} exited (exit code {w.process.exitcode})")


def _check_workers(workers: list[_Worker], dp_rank: int) -> None:
    """The broadcast's liveness check: raise when a worker has exited."""
    for w in workers:
        if not w.process.is_alive():
            raise BroadcastError(_death(w, dp_rank))


def _monitor(workers: list[_Worker], health: _Health, wake_fd: int, dp_rank: int) -> None:
    """Monitor thread: the first worker death fails the rank (`_Health.fail`), even
    while the engine is idle."""
    sentinels = {w.process.sentinel: w for w in workers}
    try:
        ready = wait_ready([*sentinels, wake_fd])
        if health.stopping or wake_fd in ready:
            return
        w = sentinels[next(s for s in ready if s in sentinels)]
        w.process.join(1.0)  # its exit code
        health.fail(_death(w, dp_rank))
    finally:
        os.close(wake_fd)


def _stop(workers: list[_Worker], broadcast: BroadcastWriter, store_dir: str,
          health: _Health, wake_fd: int) -> None:
    """Shutdown (also weakref.finalize): ask, join with a deadline, kill; clean up."""
    health.stopping = True
    with contextlib.suppress(OSError):  # the monitor may have ended (and closed its end)
        os.write(wake_fd, b"x")
    alive = [w for w in workers if w.process.is_alive()]
    if alive:
        try:
            broadcast.enqueue(("shutdown",), timeout=1.0)
        except BroadcastError:
            pass  # a dead or stuck reader: the deadline below and kill handle them
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for w in alive:
        w.process.join(max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.process.is_alive():
            logger.warning("%s did not exit in %.0f s; killing it", w.describe(),
                           STOP_TIMEOUT_S)
            w.process.kill()
            w.process.join(STOP_TIMEOUT_S)
        w.conn.close()
    broadcast.close()
    shutil.rmtree(store_dir, ignore_errors=True)
    os.close(wake_fd)


def _rss(pid: int) -> int:
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except Exception:  # noqa: BLE001 - gone meanwhile: nothing resident
        return 0
