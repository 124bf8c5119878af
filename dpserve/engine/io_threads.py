"""The engine process's two IO threads, and the queues they share with the busy loop.

Scope: `EngineIO`. The input thread (`InputReader`) moves the front-ends' and
the coordinator's messages into `input_queue`; the output thread
(`OutputSender`) moves what the busy loop puts on `output_queue` (through its
`OutputRouter`) into the output sockets. The busy loop never touches a socket.

Invariants: a thread that dies, or a dead tensor-parallel worker (`fail`),
puts IO_FAILED on the input queue, so the busy loop dies loudly even while it
waits idle. ENGINE_CORE_DEAD and the stop are queued behind every output
before them, and each wait for the threads is bounded.

Not here: what the busy loop does with its inputs (`dpserve.engine.process`),
the sockets' protocols (`dpserve.engine.input_reader`, `output_sender`).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import zmq

from dpserve.engine.input_reader import CLIENT_NEWS, IO_FAILED, InputReader
from dpserve.engine.output_sender import (
    DEAD_LINGER_MS,
    OutputItem,
    OutputSender,
    connect_outputs,
)
from dpserve.engine_config import ParallelConfig
from dpserve.protocol import ENGINE_CORE_DEAD, EngineInitMetadata

logger = logging.getLogger(__name__)


class EngineIO:
    """One engine's input and output threads (module docstring)."""

    def __init__(self, rank: int, identity: bytes, secret: str | None, remote: bool,
                 parallel: ParallelConfig) -> None:
        self.rank = rank
        self.identity = identity
        self.secret = secret
        self.remote = remote  # not on the launcher's host: watch the front-ends' links
        self.parallel = parallel  # the output backlog's cap and stall timeout
        # (type, decoded body, index of the front-end it came from)
        self.input_queue: queue.Queue[tuple[Any, Any, int]] = queue.Queue()
        self.output_queue: queue.Queue[OutputItem] = queue.Queue()
        self._stop = threading.Event()
        self.input_thread: threading.Thread | None = None
        self.output_thread: threading.Thread | None = None

    def fail(self, reason: str) -> None:
        """Fatal to the busy loop (a dead TP worker: the executor's monitor calls this)."""
        self.input_queue.put_nowait((IO_FAILED, reason, -1))

    def start(self, init: EngineInitMetadata, coordinator: zmq.Socket | None) -> None:
        """Connect to every front-end `init` names (and read the coordinator's SUB)."""
        reader = InputReader(init.input_addresses, coordinator, self.identity, self.secret,
                             self.remote, self.input_queue, self._stop)
        self.input_thread = threading.Thread(target=self._guarded, args=(reader.run,),
                                             name=f"EngineCore_{self.rank}_input", daemon=True)
        self.output_thread = threading.Thread(
            target=self._guarded, args=(self._output_loop, init.output_addresses),
            name=f"EngineCore_{self.rank}_output", daemon=True)
        self.input_thread.start()
        self.output_thread.start()

    def _guarded(self, loop: Any, *args: Any) -> None:
        """Run an IO loop; if it dies, tell the busy loop (which then dies loudly)."""
        try:
            loop(*args)
        except Exception as e:
            logger.exception("%s failed", threading.current_thread().name)
            self.fail(f"engine IO thread failed: {e!r}")

    def _output_loop(self, addresses: list[str]) -> None:
        """Output queue -> sockets, never blocked by one front-end (`OutputSender`)."""
        with zmq.Context() as ctx:  # leaving it waits for the flush (linger)
            OutputSender(
                connect_outputs(ctx, addresses, self.secret), self.rank,
                max_backlog_bytes=self.parallel.engine_output_backlog,
                stall_timeout=self.parallel.engine_output_stall_timeout,
                on_change=lambda c, why: self.input_queue.put_nowait((CLIENT_NEWS, why, c)),
            ).run(self.output_queue, self.identity)

    def send_engine_dead(self) -> None:
        """Tell every front-end this engine is dead; wait (bounded) for the flush."""
        assert self.output_thread is not None
        self.output_queue.put_nowait(ENGINE_CORE_DEAD)
        self.output_thread.join(timeout=DEAD_LINGER_MS / 1000 + 1)
        if self.output_thread.is_alive():
            logger.error("could not flush ENGINE_CORE_DEAD to the front-ends in time")

    def stop(self) -> None:
        """Stop both threads (bounded); the outputs queued before go first."""
        self._stop.set()
        self.output_queue.put_nowait(None)
        for thread in (self.input_thread, self.output_thread):
            if thread is not None:
                thread.join(timeout=2.0)
