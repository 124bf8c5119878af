"""Watching a launcher's processes: a stop signal that wakes the watch, and bounded waits.

Scope: `StopSignal` (the launcher's SIGTERM/SIGINT while serving, and an
engine death the supervisor reports, both as a flag plus a wakeup fd),
`watch` (block until a signal, a reported death or a process exit) and
`wait_drained` (after the first signal: until the draining processes exit,
bounded by the drain timeout + `DRAIN_MARGIN_S`; a second signal stops at once).

Not here: what to do about an exit (`dpserve.launch.policy`, and the
supervisors that carry it out: `dpserve.launch.supervisor`,
`dpserve.launch.headless`, `dpserve.launch.api_server_watch`).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Sequence
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dpserve.launch.api_servers import APIServerProcManager

logger = logging.getLogger("dpserve.serve")

DRAIN_MARGIN_S = 15.0  # beyond --shutdown-timeout: aborts, closing connections, exits


class StopSignal:
    """The launcher's SIGTERM/SIGINT while serving: remember it, wake `watch`."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the latest
        self.count = 0  # signals so far
        self.death: str | None = None  # set by engine_died
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)
        self._old_wakeup_fd = signal.set_wakeup_fd(self._write_fd)
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum: int, frame: object) -> None:
        self.signum = signum  # the wakeup fd wakes the loop
        self.count += 1

    def engine_died(self, reason: str) -> None:
        """The supervisor stops the server (policy stop, or engines lost): wake `watch`."""
        self.death = reason
        try:
            os.write(self._write_fd, b"!")
        except OSError:
            pass

    def drain(self) -> None:
        try:
            os.read(self.fd, 512)
        except BlockingIOError:
            pass

    def restore(self) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(self._old_wakeup_fd)
        os.close(self.fd)
        os.close(self._write_fd)


def watch(stop: StopSignal, procs: Sequence[BaseProcess],
           api: APIServerProcManager | None = None) -> list[BaseProcess]:
    """Block until a stop signal or an engine death reported to `stop` ([]), or until
    any of `procs` exits (those that did). `api`: an API server that drained on a
    signal of its own is let go (`release_drained`)."""
    by_sentinel = {p.sentinel: p for p in procs}
    while stop.signum is None and stop.death is None:
        reports = api.drain_fds if api is not None else []
        ready = connection.wait([*by_sentinel, stop.fd, *reports], timeout=5.0)
        if stop.fd in ready:
            stop.drain()
        if api is not None and stop.signum is None and stop.death is None:
            api.release_drained()
        exited = [by_sentinel[s] for s in ready if s in by_sentinel]
        if exited and stop.signum is None:
            for proc in exited:
                proc.join(timeout=1.0)  # reap: exitcode becomes known
            return exited
    return []


def wait_drained(stop: StopSignal, draining: Sequence[BaseProcess],
                  watched: Sequence[BaseProcess], timeout: float,
                  api: APIServerProcManager | None = None) -> tuple[int, str]:
    """After the first signal: wait until every `draining` process has exited
    (`api`: the API servers' manager, whose DRAINED reports it passes on).

    Returns (exit code, why): 0 when they did; 1 when they still run after
    `timeout` + DRAIN_MARGIN_S, or a process in `watched` (engines) fails or
    a Ray actor dies first; 128 + the signal on a second signal.
    """
    deadline = time.monotonic() + timeout + DRAIN_MARGIN_S
    watched_by = {p.sentinel: p for p in watched}
    while True:
        alive = [p for p in draining if p.exitcode is None]
        if not alive:
            logger.info("drained: %s", ", ".join(f"{p.name} exited with code {p.exitcode}"
                                                  for p in draining))
            return 0, "drained"
        if stop.count > 1:
            logger.warning("second signal (%d): stopping at once", stop.signum)
            return 128 + (stop.signum or signal.SIGTERM), "stopped by a second signal"
        # Exit code 0: an engine stopped by the same signal (sent to the process group).
        dead = [p for p in watched if p.exitcode]
        if dead or stop.death is not None:
            why = stop.death or ", ".join(f"process {p.name} (pid {p.pid}) exited with code "
                                          f"{p.exitcode}" for p in dead)
            logger.error("%s while draining", why)
            return 1, why
        left = deadline - time.monotonic()
        if left <= 0:
            why = (f"{', '.join(p.name for p in alive)} still running "
                   f"{timeout + DRAIN_MARGIN_S:.0f} s after the signal")
            logger.error("%s; stopping them", why)
            return 1, why
        reports = api.drain_fds if api is not None else []
        ready = connection.wait([*(p.sentinel for p in alive), *watched_by, stop.fd,
                                 *reports], timeout=min(left, 1.0))
        if stop.fd in ready:
            stop.drain()
        if api is not None:
            api.release_drained()
        for proc in alive:
            if proc.sentinel in ready:
                proc.join(timeout=1.0)  # reap: exitcode becomes known
        for s in ready:
            if s in watched_by:
                watched_by[s].join(timeout=1.0)
