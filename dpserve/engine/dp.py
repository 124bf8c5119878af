"""DPReporter: one data-parallel engine's link to the DP coordinator.

Scope (dense models: engines step independently): connect to the
coordinator, wait for its COORDINATOR_READY (every engine has subscribed),
then report this engine's `[waiting, running]` counts as `EngineReport`s,
only when they changed. `EngineCoreProc` holds one when `dp_size > 1`.

Not here: request waves, dummy batches and the all-reduce that lockstep
(MoE) engines need; START_DP_WAVE messages are left unread on the SUB
socket for now (the coordinator only sends them after a wake-up, which
dense-model front-ends never ask for).

Sockets (the coordinator binds both; see `dpserve.coordinator`):
    report   PUSH -> coordinator PULL   EngineReport
    publish  SUB  <- coordinator XPUB   COORDINATOR_READY, later START_DP_WAVE

Both are used from the engine's main thread only (ZMQ sockets are not
thread-safe); a report is one small non-blocking send.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from dpserve.protocol import COORDINATOR_READY, EngineReport

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0  # wait for COORDINATOR_READY (all engines subscribed)


class DPReporter:
    """Reports one engine's request counts to the coordinator; see the module docstring.

    Connect at construction (so the subscription travels while the model
    loads), `wait_ready()` before serving, `report()` after each change.
    """

    def __init__(self, rank: int, report_address: str, publish_address: str) -> None:
        self.rank = rank
        self._ctx = zmq.Context()
        self._report = self._ctx.socket(zmq.PUSH)
        self._report.setsockopt(zmq.LINGER, 0)
        self._report.connect(report_address)
        self._publish = self._ctx.socket(zmq.SUB)
        self._publish.setsockopt(zmq.LINGER, 0)
        self._publish.setsockopt(zmq.SUBSCRIBE, b"")
        self._publish.connect(publish_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._last_counts: tuple[int, int] | None = None
        self._step = 0  # steps run so far: orders this engine's reports at the coordinator

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Block until the coordinator says READY; TimeoutError after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._publish.poll(int(left * 1000) + 1):
                raise TimeoutError(f"engine {self.rank}: no COORDINATOR_READY from the DP "
                                   f"coordinator within {timeout:.0f} s")
            frames = self._publish.recv_multipart()
            if frames == [COORDINATOR_READY]:
                logger.info("engine %d: DP coordinator ready", self.rank)
                return
            logger.debug("engine %d: ignoring coordinator message before READY", self.rank)

    def step_done(self) -> None:
        """Count one engine step (reports carry the step they were taken after)."""
        self._step += 1

    def report(self, counts: tuple[int, int]) -> None:
        """Send `(waiting, running)` if it differs from the last counts sent."""
        if counts == self._last_counts:
            return
        self._last_counts = counts
        body = self._encoder.encode(EngineReport(
            engine_index=self.rank, request_counts=list(counts), step=self._step, wave=0))
        try:
            self._report.send(body, flags=zmq.NOBLOCK)
        except zmq.Again:  # the coordinator is stuck or gone; the launcher watches it
            self._last_counts = None  # try again next time
            logger.warning("engine %d: could not queue a load report", self.rank)

    def close(self) -> None:
        self._ctx.destroy(linger=0)
