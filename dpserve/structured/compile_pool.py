"""The engine's grammar compile threads, with compiles past their deadline written off.

An xgrammar compile cannot be interrupted, so a thread running one that is past
its deadline stays busy until it ends. `CompilePool` keeps `max_workers`
threads taking compiles from one queue; `write_off(future)` (the manager calls it
when a request's deadline passes) starts a replacement thread at once, so the
compiles queued behind do not wait for the slow one, and lets the written-off
thread end when its compile does. At most `max_stuck` compiles may be written off
and still running: past that, `submit` fails at once (every request with a new
grammar gets an error naming the cause) until one of them ends.

Not here: the deadline itself, the compiled-grammar cache (`manager.py`).
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
from collections.abc import Callable
from typing import Any


class CompilePool:
    """`max_workers` threads plus replacements for written-off ones (module docstring)."""

    def __init__(self, fn: Callable[[Any], Any], max_workers: int, max_stuck: int) -> None:
        self._fn = fn
        self.max_workers = max_workers
        self.max_stuck = max_stuck
        self._jobs: queue.SimpleQueue[tuple[Any, cf.Future] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live = 0  # threads not written off
        self._stuck: set[cf.Future] = set()  # written off, still running
        self._running: set[cf.Future] = set()
        self._closed = False

    @property
    def num_stuck(self) -> int:
        return len(self._stuck)

    def submit(self, job: Any) -> cf.Future:
        future: cf.Future = cf.Future()
        with self._lock:
            if len(self._stuck) >= self.max_stuck:
                future.set_exception(RuntimeError(
                    f"the engine's grammar compiler is busy with {len(self._stuck)} "
                    f"compiles past --structured-outputs-compile-timeout; retry later"))
                return future
            while self._live < self.max_workers:
                self._start_thread()
        self._jobs.put((job, future))
        return future

    def write_off(self, future: cf.Future) -> None:
        """`future`'s compile is past its deadline: replace its thread now."""
        with self._lock:
            if future in self._running and future not in self._stuck and not future.done():
                self._stuck.add(future)
                self._live -= 1
                if not self._closed:
                    self._start_thread()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for _ in range(self._live):
                self._jobs.put(None)

    def _start_thread(self) -> None:
        self._live += 1
        threading.Thread(target=self._work, name="dpserve-grammar", daemon=True).start()

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, future = item
            if not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running.add(future)
            try:
                future.set_result(self._fn(job))
            except Exception as e:  # noqa: BLE001 - the request's failure, reported by it
                future.set_exception(e)
            with self._lock:
                self._running.discard(future)
                if future in self._stuck:  # written off: a replacement took our place
                    self._stuck.discard(future)
                    return
