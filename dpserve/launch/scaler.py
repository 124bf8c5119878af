"""The launcher's side of changing the number of DP engines at run time.

`Scaler` (a thread of the launcher, the process that owns the engines) reads
the coordinator's `CoordinatorUpdate`s on its front socket and carries out
each PENDING `ScaleStatus` (from a front-end's `POST /scale_elastic_ep`, or
the autoscaler), one at a time; the coordinator rejects a second meanwhile:

    up   N -> M   ScaleEngines(M): the coordinator's tables grow, ranks N..M-1
                  STARTING (front-ends add them, send them nothing yet); new
                  engines (processes, or Ray actors in new placement groups)
                  handshake and connect to every API server and the
                  coordinator; RankEvent SERVING; done once the coordinator
                  publishes them serving (lockstep: the next DP group
                  generation takes them in).
    down M -> N   RankEvent DRAINING for ranks N..M-1: every front-end stops
                  sending them new work, their requests run on; once their
                  counts stay at zero (after `_IN_TRANSIT_S`, for requests sent
                  just before), or after `drain_timeout` s (front-ends then move
                  what is left to the other ranks, as after a failure),
                  ScaleEngines(N): the tables shrink (lockstep: a generation
                  without them), then the engines are stopped.

Before anything starts, a size this host cannot hold (`placement.engines_fit`:
cores or CUDA devices; under Ray, a rank its cluster cannot place) is refused
(REFUSED, the message says what is missing). A failed start stops the new
engines and shrinks the tables back (FAILED); every result goes back as
`ScaleResult`. Every wait is bounded.

Not here: validation of the size and the one-at-a-time rule (the
coordinator's `dpserve.launch.coordinator.autoscale.ScaleBook`), HTTP (`dpserve.server.ops.scale`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import msgspec
import zmq

from dpserve.protocol import (
    CoordinatorUpdate,
    RankEvent,
    RankState,
    RankStatus,
    ScaleEngines,
    ScalePhase,
    ScaleResult,
    ScaleStatus,
)
from dpserve.security import secure

if TYPE_CHECKING:
    from dpserve.config import EngineConfig

logger = logging.getLogger(__name__)

_IN_TRANSIT_S = 1.5  # a request sent just before DRAINING reaches its engine by then
_STATE_TIMEOUT_S = 30.0  # the coordinator publishes a rank state change within this
_STOP_TIMEOUT_S = 10.0  # a drained engine exits within this after SIGTERM (then: killed)
_REGROUP_S = 1.0  # lockstep: time for the generation without the removed ranks


class ScaleError(RuntimeError):
    """A change of the engine count failed (the message says why)."""


class CapacityError(ScaleError):
    """The placement cannot hold the new engine count (the message says what is
    missing); nothing was started."""


class ScalableHost(Protocol):
    """What the Scaler needs of the host's launch (`dpserve.launch.host.EngineLaunch`)."""

    coordinator_address: str | None  # the coordinator's front XPUB
    ranks: tuple[int, ...]  # the engines this host's front-ends send to

    def check_room(self, size: int) -> None:
        """CapacityError when this host cannot hold `size` engines (mp backend)."""
        ...

    def add_engines(self, ranks: list[int]) -> None:
        """Start engines for new `ranks`, READY when this returns (raises otherwise;
        CapacityError when the placement, e.g. Ray's cluster, cannot hold them)."""
        ...

    def remove_engine(self, rank: int, timeout: float) -> None:
        """Stop `rank`'s engine (it holds no requests any more)."""
        ...


class Scaler:
    """See the module docstring. `close()` stops the thread (idempotent)."""

    def __init__(self, launch: ScalableHost, config: EngineConfig) -> None:
        assert launch.coordinator_address is not None
        self.launch = launch
        self.lockstep = config.parallel.data_parallel_lockstep
        self.drain_timeout = config.shutdown_timeout
        self.counts: list[list[int]] = []  # the coordinator's last [waiting, running] per rank
        self.ranks: list[RankStatus] = []  # the coordinator's last rank states
        self._handled: set[str] = set()
        self._decoder = msgspec.msgpack.Decoder(CoordinatorUpdate)
        self._encoder = msgspec.msgpack.Encoder()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = secure(self._ctx.socket(zmq.XSUB), "client",
                            config.parallel.data_parallel_secret)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(launch.coordinator_address)
        self._sock.send(b"\x01")  # subscribe to everything
        self._thread = threading.Thread(target=self._serve, name="scaler", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._ctx.destroy(linger=0)

    # ---- the loop ----------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                update = self._receive(0.25)
                scale = update.scale if update is not None else None
                if scale is not None and scale.phase is ScalePhase.PENDING \
                        and scale.scale_id not in self._handled:
                    self._handled.add(scale.scale_id)
                    self._carry_out(scale)
        except zmq.ZMQError:
            if not self._stop.is_set():
                logger.exception("scaler: lost the coordinator socket")

    def _receive(self, timeout: float) -> CoordinatorUpdate | None:
        """The next update (None after `timeout` s); keeps the counts and rank states."""
        if not self._sock.poll(int(timeout * 1000)):
            return None
        try:
            update = self._decoder.decode(self._sock.recv())
        except msgspec.DecodeError as e:
            logger.error("scaler: undecodable coordinator message dropped: %s", e)
            return None
        if update.counts is not None:
            self.counts = update.counts
        if update.ranks is not None:
            self.ranks = update.ranks
        return update

    def _send(self, message: msgspec.Struct) -> None:
        self._sock.send(self._encoder.encode(message))

    def _carry_out(self, scale: ScaleStatus) -> None:
        old, new = len(self.launch.ranks), scale.new_size
        logger.info("scaling from %d to %d engines (%s)%s", old, new, scale.scale_id,
                    f": {scale.message}" if scale.message else "")
        started = time.monotonic()
        try:
            if new > old:
                self._up(old, new)
            elif new < old:
                self._down(old, new)
            ok, message = True, ""
        except CapacityError as e:
            logger.warning("not scaling from %d to %d engines: %s", old, new, e)
            self._send(ScaleResult(scale.scale_id, False, str(e), refused=True))
            return
        except Exception as e:  # noqa: BLE001 - a failed change is an answer, not a crash
            logger.error("scaling from %d to %d engines failed: %s", old, new, e)
            ok, message = False, f"{type(e).__name__}: {e}" if not isinstance(
                e, ScaleError) else str(e)
        if ok:
            logger.info("scaled from %d to %d engines in %.1f s", old, new,
                        time.monotonic() - started)
        self._send(ScaleResult(scale.scale_id, ok, message))

    # ---- up and down -------------------------------------------------------------

    def _up(self, old: int, new: int) -> None:
        ranks = list(range(old, new))
        self.launch.check_room(new)  # first: a refused change touches nothing
        self._send(ScaleEngines(new))  # the new ranks are STARTING everywhere
        try:
            self.launch.add_engines(ranks)
        except BaseException:
            self._send(ScaleEngines(old))
            raise
        for rank in ranks:
            self._send(RankEvent(rank, RankStatus(RankState.SERVING)))
        self._wait(lambda: len(self.ranks) >= new and all(
            self.ranks[r].state is RankState.SERVING for r in ranks),
            _STATE_TIMEOUT_S, f"ranks {ranks} to be published serving")

    def _down(self, old: int, new: int) -> None:
        ranks = list(range(new, old))
        self._wait(lambda: len(self.ranks) >= old, _STATE_TIMEOUT_S, "the rank states")
        for rank in ranks:
            incarnation = self.ranks[rank].incarnation
            self._send(RankEvent(rank, RankStatus(RankState.DRAINING, incarnation,
                                                  f"scaling down to {new} engines")))
        self._wait(lambda: all(self.ranks[r].state is not RankState.SERVING for r in ranks),
                   _STATE_TIMEOUT_S, f"ranks {ranks} to be published draining")
        self._pause(_IN_TRANSIT_S)
        try:
            self._wait(lambda: all(self.counts[r] == [0, 0] for r in ranks
                                   if r < len(self.counts)),
                       self.drain_timeout, f"ranks {ranks} to finish their requests")
        except ScaleError as e:
            logger.warning("%s; the front-ends move what is left to the other ranks", e)
        self._send(ScaleEngines(new))  # front-ends forget them (and move any leftovers)
        self._wait(lambda: len(self.ranks) == new, _STATE_TIMEOUT_S,
                   f"the coordinator to publish {new} engines")
        if self.lockstep:
            self._pause(_REGROUP_S)  # the next DP group generation leaves them out
        for rank in reversed(ranks):
            self.launch.remove_engine(rank, timeout=_STOP_TIMEOUT_S)
            logger.info("rank %d stopped (scaled down)", rank)

    # ---- waits -------------------------------------------------------------------

    def _wait(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        """Read updates until `done()`; ScaleError after `timeout` s or on close."""
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0 or self._stop.is_set():
                raise ScaleError(f"timed out after {timeout:g} s waiting for {what}")
            self._receive(min(left, 0.25))

    def _pause(self, seconds: float) -> None:
        """Keep reading updates for `seconds` (so the last ones are known)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
            self._receive(min(left, 0.25))
