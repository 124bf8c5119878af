"""The launcher's side of `--api-server-count M > 1`: spawning and stopping API servers.

`APIServerProcManager` spawns `APIServer_<i>` (the process target it is given:
`dpserve.entrypoints.api_server.run_api_server`), all serving on one
listening socket the launcher bound, runs the start-up handshake over a pipe
per process (`ControlMessage`s, `dpserve.launch.api_server_pipe`; drawn in
`dpserve.entrypoints.api_server`) and tears them down.

Not here: watching them while they serve (`dpserve.launch.api_server_watch`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from dpserve.launch.api_server_pipe import (
    API_SERVER_READY_TIMEOUT_S,
    APIServerSpec,
    ControlMessage,
)
from dpserve.launch.process import ProcessGroup
from dpserve.protocol import RankStatus

if TYPE_CHECKING:
    import socket

logger = logging.getLogger(__name__)

# The process target: target(spec=, conn=, sock=, parent_pid=, metrics_dir=, **shared).
APIServerTarget = Callable[..., None]


class APIServerStartupError(RuntimeError):
    """An API server process failed, died or timed out while starting."""


class APIServerProcManager:
    """Spawns `APIServer_<i>` for each spec, all serving on `sock`, and tears them down.

    Each runs `target(spec=, conn=, sock=, parent_pid=, metrics_dir=, **shared)`:
    `shared` are the arguments every API server gets alike (options, config).
    Cleanup is tied to a `ProcessGroup`: `close()`, garbage collection and
    interpreter exit all run `shutdown(processes)` once, then close the pipes.
    """

    def __init__(self, target: APIServerTarget, specs: Sequence[APIServerSpec],
                 sock: socket.socket, metrics_dir: str, shared: Mapping[str, Any]) -> None:
        self._specs = list(specs)
        self._target = target
        self._common = dict(shared, sock=sock, parent_pid=os.getpid(),
                            metrics_dir=metrics_dir)
        self._conns: list[connection.Connection] = []  # [M] the launcher's pipe ends
        self._drained = [False] * len(specs)  # [M] said DRAINED (or exited)
        self._draining = False  # request_drain was called
        self._closed = False  # the drain's CLOSE went to all
        self._group = ProcessGroup(self, on_close=functools.partial(_close_all, self._conns))
        for spec in specs:
            parent_end, child_end = self._group.context.Pipe()
            self._conns.append(parent_end)
            try:
                self._group.spawn(self._target, f"APIServer_{spec.index}", spec=spec,
                                  conn=child_end, **self._common)
            finally:
                child_end.close()  # theirs now: a child's death closes its pipe

    @property
    def processes(self) -> list[BaseProcess]:
        return self._group.processes

    def wait_for_startup(self, timeout: float = API_SERVER_READY_TIMEOUT_S,
                         also_watch: Sequence[BaseProcess] = ()) -> None:
        """Wait until every API server says READY.

        Raises APIServerStartupError on the first FAILED, the death of an API
        server or of a process in `also_watch` (engines, coordinator), or
        when `timeout` seconds pass.
        """
        self._wait_ready(dict(zip(self._conns, self.processes)), timeout, also_watch)
        logger.info("all %d API servers ready", len(self.processes))

    def restart(self, proc: BaseProcess, timeout: float = API_SERVER_READY_TIMEOUT_S) -> None:
        """A new process in the place of API server `proc` (which has exited): same
        client index and sockets, so the engines reconnect to it; it serves once READY.
        Raises APIServerStartupError when it does not start."""
        i = self.processes.index(proc)
        proc.join(timeout=1.0)
        parent_end, child_end = self._group.context.Pipe()
        self._conns[i].close()
        self._conns[i] = parent_end
        self._drained[i] = False
        try:
            new = self._group.replace(proc, self._target, spec=self._specs[i], conn=child_end,
                                      **self._common)
        finally:
            child_end.close()
        self._wait_ready({parent_end: new}, timeout, ())
        parent_end.send(ControlMessage("serve"))
        logger.info("%s restarted (pid %d) and serving", new.name, new.pid)

    def _wait_ready(self, waiting: dict[connection.Connection, BaseProcess], timeout: float,
                    also_watch: Sequence[BaseProcess]) -> None:
        sentinels = {p.sentinel: p for p in [*waiting.values(), *also_watch]}
        deadline = time.monotonic() + timeout
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                names = ", ".join(p.name for p in waiting.values())
                raise APIServerStartupError(f"not ready after {timeout:.0f} s: {names}")
            ready = connection.wait([*waiting, *sentinels], timeout=min(left, 1.0))
            for conn in [c for c in ready if c in waiting]:  # a FAILED beats its exit
                proc = waiting.pop(conn)  # type: ignore[call-overload]
                try:
                    message = conn.recv()  # type: ignore[union-attr]
                except EOFError:
                    raise APIServerStartupError(_died(proc)) from None
                if message.kind == "failed":
                    raise APIServerStartupError(f"{proc.name}: {message.detail}")
            dead = [sentinels[s] for s in ready if s in sentinels]
            if dead:
                raise APIServerStartupError(", ".join(_died(p) for p in dead))

    def broadcast_rank_status(self, rank: int, status: RankStatus) -> None:
        """Tell every API server what this launcher knows of one of its engines."""
        self._tell_all(ControlMessage("rank", rank=rank, status=status))

    def request_drain(self) -> None:
        """Tell every live API server to drain and exit (`dpserve serve` waits for them):
        each says DRAINED when its own requests are done, and exits on CLOSE, which
        `release_drained` sends once all have (see `dpserve.entrypoints.api_server`)."""
        self._draining = True
        self._tell_all(ControlMessage("drain"))

    @property
    def drain_fds(self) -> list[connection.Connection]:
        """The pipes of API servers that may still report DRAINED: wait on these, and
        call `release_drained` when one is readable."""
        return [conn for conn, done in zip(self._conns, self._drained) if not done]

    def release_drained(self) -> None:
        """Read DRAINED reports. While the server drains: once every API server has
        drained or exited, CLOSE to all (once), so none stops answering (503) while
        another still streams. Otherwise (one drained on a signal of its own): CLOSE
        to it at once; its exit is then handled as any API server's."""
        for i, (conn, proc) in enumerate(zip(self._conns, self.processes)):
            if self._drained[i]:
                continue
            try:
                while not self._drained[i] and conn.poll():
                    self._drained[i] = conn.recv().kind == "drained"
            except (EOFError, OSError):
                self._drained[i] = True  # it exited: nothing of it to wait for
            self._drained[i] = self._drained[i] or proc.exitcode is not None
            if self._drained[i] and not self._draining:
                self._tell(conn, ControlMessage("close"))
        if self._draining and all(self._drained) and not self._closed:
            self._closed = True
            logger.info("every API server has drained; closing them")
            self._tell_all(ControlMessage("close"))

    def _tell_all(self, message: ControlMessage) -> None:
        for conn, proc in zip(self._conns, self.processes):
            if proc.is_alive():
                self._tell(conn, message)

    @staticmethod
    def _tell(conn: connection.Connection, message: ControlMessage) -> None:
        try:
            conn.send(message)
        except OSError:
            pass  # it is exiting anyway

    def start_serving(self) -> None:
        """Tell every API server to start serving (after `wait_for_startup`)."""
        for conn in self._conns:
            conn.send(ControlMessage("serve"))

    def stop_after_death(self, reason: str, timeout: float = 3.0) -> None:
        """A dpserve process died: let each API server fail its requests with `reason`
        and exit (up to `timeout` s), then shut down what is left."""
        self._tell_all(ControlMessage("stopping", reason))
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.close()

    def close(self) -> None:
        """terminate -> join -> kill the tree, for every API server (idempotent)."""
        self._group.close()


def _close_all(conns: list[connection.Connection]) -> None:
    for conn in conns:
        conn.close()


def _died(proc: BaseProcess) -> str:
    proc.join(timeout=1.0)  # reap it, so its exit code is known
    return f"{proc.name} (pid {proc.pid}) exited with code {proc.exitcode} during start-up"
