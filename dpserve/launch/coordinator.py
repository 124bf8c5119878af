"""The DP coordinator: one process between the DP engines and the front-ends.

Scope:
* Load: keeps each engine's `[waiting, running]` counts (from `EngineReport`)
  and publishes them to every front-end as `CoordinatorUpdate`: at most once
  per `stats_interval_s` while they change, every `idle_publish_s` otherwise.
* Waves: keeps the global request wave and running/paused state. Rank 0 says
  `wave_complete=w` (all ranks paused) -> wave w+1, paused. A front-end that
  sent a request while paused (`WakeEngines`), or an engine that got a request
  of a finished wave (`start_wave`), makes the coordinator broadcast
  START_DP_WAVE to the engines. Wave news is published to front-ends at once.
* Scale: a front-end's `ScaleRequest` (or the autoscaler, `--data-parallel-
  autoscale`) becomes a `ScaleStatus` that the launcher (`dpserve.launch.scaler`)
  carries out; `ScaleEngines` from it resizes the tables (new ranks STARTING),
  its `ScaleResult` ends the change (`dpserve.launch.autoscale.ScaleBook`).
* Pause / sleep (`ControlChange` from a front-end): keeps the `ControlState`
  (rules in `dpserve.control`), broadcasts it to every engine as CONTROL (and
  to an engine that subscribes late, after READY), records the seq each
  engine reports reached (`control_done`), publishes both to the front-ends.
* Operators (`RankControl` from an API server): cordon / uncordon a rank
  (published in `EngineInfo.cordoned`: front-ends send it nothing new), or
  restart it (published once as `CoordinatorUpdate.restart`; the launcher that
  runs the rank restarts it). Per-rank figures for /engines (`RankInfoTable`:
  KV usage, tokens/s, pid, host from heartbeats) are published with the
  counts, at most every `INFO_PUBLISH_S` when only they changed.
* Lockstep DP group (`dp_store` given): hosts the engines' rendezvous store
  (`dpserve.engine.dp_store.DPStoreServer`: ZMQ, CURVE with the secret; here, so
  that any rank may die) and decides each group generation (`_DPGroup`): the
  serving ranks that have sent a heartbeat (so are loaded and stepping), sent
  as REGROUP_DP `_SETTLE_GROUP_S` after that set changes (start-up, a rank
  dead, isolated, back), and `REFORM_DELAY_S` after an engine reports a
  failed collective of the current generation.

Not here: load-balancing decisions (front-ends), the all-reduce that decides
when a wave ends (engines), starting engines (`dpserve.launch.engines`).

Sockets (all bound here; the wire format is in `dpserve.protocol`):
    front_publish_address   XPUB  -> CoordinatorUpdate to front-ends (XSUB),
                                  <- WakeEngines / ScaleEngines from them
    engine_report_address   PULL  <- EngineReport from engines (PUSH)
    engine_publish_address  XPUB  -> COORDINATOR_READY, then START_DP_WAVE and
                                  REGROUP_DP (SUB)
    dp_store (lockstep)     ROUTER at tcp://host:port <- StoreRequest (gloo's rendezvous)

The process exits on SIGTERM (it ignores Ctrl-C's SIGINT: the parent stops
it), when its parent dies (polled every second), or with exit code 1 when not
every engine subscribes in time.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq

from dpserve.config import AutoscaleConfig
from dpserve.control import next_state
from dpserve.launch.addresses import AddressAllocator
from dpserve.launch.autoscale import ScaleBook
from dpserve.launch.process import ProcessGroup, start_parent_watcher
from dpserve.logging_utils import name_process
from dpserve.protocol import (
    COORDINATOR_READY,
    ControlChange,
    ControlState,
    CoordinatorRequest,
    CoordinatorUpdate,
    EngineReport,
    RankControl,
    RankEvent,
    RankState,
    RankStatus,
    RegroupDP,
    RequestType,
    RestartRank,
    ScaleEngines,
    ScaleRequest,
    ScaleResult,
    StartDPWave,
    WakeEngines,
)
from dpserve.rank_info import INFO_PUBLISH_S, RankInfoTable
from dpserve.security import secure

logger = logging.getLogger(__name__)

_MAX_SLEEP_S = 1.0  # the longest a start-up wait sleeps
_HEALTH_CHECK_S = 0.25  # the loop looks at heartbeats at least this often
_SETTLE_S = 0.05  # after a quiet spell, wait this long for the other engines' reports
_SUBSCRIBE = 1  # first byte of an XPUB subscription frame (0 = unsubscribe)
# After a failed collective with no membership change yet, wait this long for the
# launcher's news (a dead rank) before forming the group again with the same ranks.
REFORM_DELAY_S = 1.0
_SETTLE_GROUP_S = 0.25  # membership news within this long forms one generation


class DPCoordinator:
    """Runs the coordinator process `DPCoordinator`; see the module docstring.

    Addresses are allocated per instance from `allocator` (its own ipc one
    when None; pass `AddressAllocator(local_only=False, host=...)` for tcp).
    With `remote_host`, each socket also binds a tcp:// address on that host
    (the `remote_*` attributes) for engines and front-ends on other hosts.
    `publish_counts=False` (external LB) publishes wave news only.
    `close()`, garbage collection and interpreter exit stop the process once.
    """

    def __init__(self, num_engines: int, allocator: AddressAllocator | None = None, *,
                 remote_host: str | None = None, publish_counts: bool = True,
                 secret: str | None = None, stats_interval_s: float = 0.1,
                 idle_publish_s: float = 5.0, startup_timeout_s: float = 600.0,
                 heartbeat_timeout_s: float = 3.0, stall_timeout_s: float = 30.0,
                 dp_store: tuple[str, int] | None = None, size_max: int | None = None,
                 autoscale: AutoscaleConfig | None = None) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        owned = allocator is None
        allocator = allocator or AddressAllocator(local_only=True)
        self.num_engines = num_engines
        self.front_publish_address = allocator.new_address("coord-front")
        self.engine_report_address = allocator.new_address("coord-report")
        self.engine_publish_address = allocator.new_address("coord-engines")
        tcp = AddressAllocator(local_only=False, host=remote_host) if remote_host else None
        self.remote_front_publish_address = tcp.new_address("") if tcp else None
        self.remote_engine_report_address = tcp.new_address("") if tcp else None
        self.remote_engine_publish_address = tcp.new_address("") if tcp else None
        self._settings = dict(publish_counts=publish_counts, secret=secret,
                              stats_interval_s=stats_interval_s,
                              idle_publish_s=idle_publish_s,
                              startup_timeout_s=startup_timeout_s,
                              heartbeat_timeout_s=heartbeat_timeout_s,
                              stall_timeout_s=stall_timeout_s, dp_store=dp_store,
                              size_max=size_max, autoscale=autoscale)
        self.proc: BaseProcess | None = None
        self._group = ProcessGroup(self, on_close=allocator.cleanup if owned else None)

    def start(self) -> None:
        """Spawn the coordinator process (returns at once; it binds its sockets)."""
        if self.proc is not None:
            raise RuntimeError("DPCoordinator already started")
        self.proc = self._group.spawn(run_coordinator, "DPCoordinator", **self._kwargs())

    def _kwargs(self) -> dict[str, Any]:
        return dict(num_engines=self.num_engines, parent_pid=os.getpid(),
                    front_publish_address=_both(self.front_publish_address,
                                                self.remote_front_publish_address),
                    engine_report_address=_both(self.engine_report_address,
                                                self.remote_engine_report_address),
                    engine_publish_address=_both(self.engine_publish_address,
                                                 self.remote_engine_publish_address),
                    **self._settings)

    def restart(self) -> None:
        """A new coordinator process on the same addresses (the old one has exited).

        Engines and front-ends reconnect by themselves; it sends READY once every
        engine has subscribed again, and learns loads and health from their reports."""
        assert self.proc is not None
        self.proc.join(timeout=1.0)
        self.proc = self._group.replace(self.proc, run_coordinator, **self._kwargs())

    def close(self) -> None:
        """Stop the process (terminate -> join -> kill) and remove owned ipc files."""
        self._group.close()

    def __enter__(self) -> DPCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _both(local: str, remote: str | None) -> list[str]:
    return [local] if remote is None else [local, remote]


class _LoadTable:
    """Per-engine `[waiting, running]` counts, ordered by (wave, step).

    Invariant: an engine's counts only move forward in (wave, step); a report
    older than the one already applied for that engine is dropped, so a stale
    snapshot never overwrites a newer one. When a report opens a newer global
    step while changes are unpublished, the counts are frozen as `snapshot`
    (the last complete step), which is published before the mixed state.
    """

    def __init__(self, num_engines: int) -> None:
        self.counts = [[0, 0] for _ in range(num_engines)]  # [num_engines][waiting, running]
        self.tokens = [0] * num_engines  # [num_engines] prompt tokens waiting (admission)
        self._seen = [(-1, -1)] * num_engines  # engine -> (wave, step) of its counts
        self._latest = (-1, -1)  # newest (wave, step) from any engine
        self.snapshot: list[list[int]] | None = None
        self.changed_at: float | None = None  # when the first unpublished change came

    def __len__(self) -> int:
        return len(self.counts)

    def apply(self, index: int, wave: int, step: int, counts: list[int],
              waiting_tokens: int = 0) -> bool:
        """Record one engine's counts; False when the report was stale."""
        if (wave, step) < self._seen[index]:
            logger.warning("dropping stale counts from engine %d: (wave, step) %s < %s",
                           index, (wave, step), self._seen[index])
            return False
        if (wave, step) > self._latest:
            if self.changed_at is not None:
                self.snapshot = [list(c) for c in self.counts]
            self._latest = (wave, step)
        self._seen[index] = (wave, step)
        self.counts[index] = [int(counts[0]), int(counts[1])]
        self.tokens[index] = int(waiting_tokens)
        if self.changed_at is None:
            self.changed_at = time.monotonic()
        return True

    def resize(self, num_engines: int) -> None:
        del self.counts[num_engines:], self._seen[num_engines:]
        grow = num_engines - len(self.counts)
        self.tokens = (self.tokens + [0] * num_engines)[:num_engines]
        self.counts += [[0, 0] for _ in range(grow)]
        self._seen += [(-1, -1)] * grow
        self.snapshot = None

    def take(self) -> list[list[int]]:
        """The counts to publish now: the frozen snapshot first, else the current ones."""
        if self.snapshot is not None:
            taken, self.snapshot = self.snapshot, None
            return taken
        self.changed_at = None
        return [list(c) for c in self.counts]


class _HealthTable:
    """Each rank's `RankStatus`, from heartbeats and the launchers' `RankEvent`s.

    A rank with no heartbeat for `heartbeat_timeout_s` (a frozen or stopped
    process), or with work but no finished step for `stall_timeout_s` (a hung
    forward or collective), turns UNHEALTHY; when both resume it is SERVING
    again. Timeouts apply from a rank's first heartbeat on (engines start them
    once READY). Invariant: news of an older incarnation than the one known is
    dropped, so a dead process can never speak for its replacement.
    """

    def __init__(self, num_engines: int, heartbeat_timeout_s: float,
                 stall_timeout_s: float) -> None:
        self.status = [RankStatus() for _ in range(num_engines)]
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._last_beat: list[float | None] = [None] * num_engines
        self._step: list[tuple[int, float, bool]] = [(-1, 0.0, False)] * num_engines

    def resize(self, num_engines: int) -> None:
        """Ranks past `num_engines` go; new ones are STARTING until they beat."""
        grow = num_engines - len(self.status)
        del self.status[num_engines:], self._last_beat[num_engines:], self._step[num_engines:]
        self.status += [RankStatus(RankState.STARTING, reason="scaling up")
                        for _ in range(grow)]
        self._last_beat += [None] * grow
        self._step += [(-1, 0.0, False)] * grow

    def on_heartbeat(self, report: EngineReport, now: float) -> bool:
        """Record a heartbeat; True when the rank's status changed."""
        rank, known = report.engine_index, self.status[report.engine_index]
        if report.incarnation < known.incarnation:
            return False  # a process this rank has already replaced
        self._last_beat[rank] = now
        step, since, _ = self._step[rank]
        if report.step != step or report.incarnation != known.incarnation:
            since = now
        self._step[rank] = (report.step, since, report.has_work)
        state = RankState.DRAINING if report.draining else RankState.SERVING
        if known.state in (state, RankState.DRAINING) and \
                report.incarnation == known.incarnation:
            return False  # (a draining process never serves again)
        if known.state is RankState.DEAD and report.incarnation == known.incarnation:
            return False  # only a new process brings a dead rank back
        self.status[rank] = RankStatus(state, report.incarnation,
                                       "got SIGTERM: finishes what it holds" if report.draining
                                       else "")
        return True

    def heard(self) -> list[bool]:
        """Per rank: a heartbeat of its current process has arrived."""
        return [beat is not None for beat in self._last_beat]

    def on_event(self, rank: int, status: RankStatus) -> bool:
        """A launcher's first-hand news; True when the rank's status changed."""
        if status.incarnation < self.status[rank].incarnation or status == self.status[rank]:
            return False
        if status.incarnation > self.status[rank].incarnation:
            self._last_beat[rank] = None  # a new process: timeouts from its first beat
        self.status[rank] = status
        return True

    def check(self, now: float) -> list[int]:
        """Mark serving ranks that stopped beating or stepping UNHEALTHY; the changed ranks."""
        changed = []
        for rank, status in enumerate(self.status):
            beat = self._last_beat[rank]
            if status.state is not RankState.SERVING or beat is None:
                continue
            _, since, has_work = self._step[rank]
            if now - beat > self.heartbeat_timeout_s:
                reason = f"no heartbeat for {now - beat:.1f} s"
            elif has_work and now - since > self.stall_timeout_s:
                reason = f"has work but finished no step for {now - since:.1f} s"
            else:
                continue
            self.status[rank] = RankStatus(RankState.UNHEALTHY, status.incarnation, reason)
            logger.warning("rank %d unhealthy: %s", rank, reason)
            changed.append(rank)
        return changed


class _DPGroup:
    """Lockstep: which ranks form the engines' DP group, generation by generation.

    Members are the ranks that serve (or drain) and have been heard (a heartbeat:
    loaded and in their busy loop): a dead, restarting or unhealthy rank is left
    out until it serves again. Invariant: generations only move
    forward, one per REGROUP_DP; a failure report of an older generation is
    dropped (that group is already gone).
    """

    def __init__(self) -> None:
        self.generation = 0  # 0: none formed yet
        self.members: list[int] = []
        self._due: float | None = None  # when to form the next generation

    @staticmethod
    def wanted(status: list[RankStatus], heard: list[bool]) -> list[int]:
        return [rank for rank, s in enumerate(status)
                if heard[rank] and s.state in (RankState.SERVING, RankState.DRAINING)]

    def on_failed(self, generation: int, now: float) -> None:
        """A member's collective of `generation` failed: form the group again soon."""
        if generation == self.generation and self.generation > 0:
            if self._due is None:
                self._due = now + REFORM_DELAY_S

    def next(self, status: list[RankStatus], heard: list[bool],
             now: float) -> RegroupDP | None:
        """The generation to announce now, if one is due."""
        members = self.wanted(status, heard)
        if members != self.members and self._due is None:
            self._due = now + _SETTLE_GROUP_S
        if self._due is None or now < self._due:
            return None
        self._due = None
        self.generation += 1
        self.members = members
        return RegroupDP(self.generation, members, len(status))

    @property
    def leader(self) -> int:
        """The rank that speaks for the group (reports wave completion)."""
        return self.members[0] if self.members else 0


class DPCoordinatorProc:
    """The coordinator's sockets and loop (runs inside the coordinator process)."""

    def __init__(self, num_engines: int, front_publish_address: str | list[str],
                 engine_report_address: str | list[str],
                 engine_publish_address: str | list[str], *,
                 publish_counts: bool = True, secret: str | None = None,
                 stats_interval_s: float = 0.1, idle_publish_s: float = 5.0,
                 startup_timeout_s: float = 600.0, heartbeat_timeout_s: float = 3.0,
                 stall_timeout_s: float = 30.0,
                 dp_store: tuple[str, int] | None = None, size_max: int | None = None,
                 autoscale: AutoscaleConfig | None = None) -> None:
        self.loads = _LoadTable(num_engines)
        self.scaling = ScaleBook(size_max, autoscale)  # run-time changes of the engine count
        self.health = _HealthTable(num_engines, heartbeat_timeout_s, stall_timeout_s)
        self.info = RankInfoTable(num_engines)  # what /engines shows besides counts
        self.group = _DPGroup() if dp_store is not None else None  # lockstep only
        self._store = _host_store(*dp_store, secret) if dp_store is not None else None
        self.wave = 0  # the current request wave
        self.running = False  # engines are in a running wave (else paused)
        self.control = ControlState()  # pause / sleep state of every rank
        self.control_done = [0] * num_engines  # the control seq each engine reached
        self._published_wave = 0
        self.stats_interval_s = stats_interval_s
        self.idle_publish_s = idle_publish_s
        self.startup_timeout_s = startup_timeout_s
        self.publish_counts = publish_counts
        self.secret = secret
        self.stop_requested = False
        self._last_publish = 0.0
        self._report_decoder = msgspec.msgpack.Decoder(EngineReport)
        self._request_decoder = msgspec.msgpack.Decoder(CoordinatorRequest)
        self.ctx = zmq.Context()
        self.front = self._bind(zmq.XPUB, front_publish_address)
        self.reports = self._bind(zmq.PULL, engine_report_address)
        self.engines = self._bind(zmq.XPUB, engine_publish_address)
        # Pass every subscription up (not only the first per topic), so each
        # engine is counted and each new front-end gets the state at once.
        self.front.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.engines.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._wake_r, wake_w = os.pipe()  # signal handlers wake the poller through it
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)

    def _bind(self, kind: int, addresses: str | list[str]) -> zmq.Socket:
        sock = secure(self.ctx.socket(kind), "server", self.secret)
        sock.setsockopt(zmq.LINGER, 0)
        for address in [addresses] if isinstance(addresses, str) else addresses:
            sock.bind(address)
        return sock

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        if self._store is not None:
            self._store.close()
        self.ctx.destroy(linger=0)

    def request_stop(self, signum: int = 0, frame: Any = None) -> None:
        self.stop_requested = True  # the loop sees it when the wakeup fd fires

    def _should_exit(self) -> bool:
        return self.stop_requested

    # ---- start-up ------------------------------------------------------------

    def wait_for_engines(self) -> bool:
        """Wait until every engine has subscribed, then publish READY; False on exit/timeout."""
        subscribed = 0
        deadline = time.monotonic() + self.startup_timeout_s
        while subscribed < len(self.loads):
            if self._should_exit():
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                logger.error("only %d of %d engines subscribed in %.0f s",
                             subscribed, len(self.loads), self.startup_timeout_s)
                return False
            if self.engines.poll(int(min(left, _MAX_SLEEP_S) * 1000) + 1):
                frame = self.engines.recv()
                if frame[:1] == bytes([_SUBSCRIBE]):
                    subscribed += 1
        self.engines.send(COORDINATOR_READY)
        logger.info("all %d engines subscribed; sent READY", subscribed)
        return True

    # ---- the loop --------------------------------------------------------------

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in (self.front, self.reports, self.engines):
            poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._should_exit():
            # 1. Sleep until the next publish is due, a message comes, or 1 s
            #    passes (to check on the parent).
            timeout = min(max(0.0, self._next_publish() - time.monotonic()), _HEALTH_CHECK_S)
            events = dict(poller.poll(int(timeout * 1000)))
            if self._wake_r in events:
                os.read(self._wake_r, 512)
            # 2. Front-ends: subscriptions, wake-ups, scale messages.
            if self.front in events:
                self._on_front_frames(self.front.recv_multipart())
            # 3. Engines: load counts and wave news.
            if self.reports in events:
                self._on_report_frames(self.reports.recv_multipart())
            # 4. Engine subscriptions after start-up (a restarted or scaled-up
            #    engine): it waits for READY, which running engines ignore.
            if self.engines in events:
                self._on_late_engine_frame(self.engines.recv())
            # 5. Ranks that stopped beating or stepping: unhealthy, published at once.
            if self.health.check(time.monotonic()):
                self._publish_counts()
            # 6. Lockstep: a new DP group generation when membership changed or
            #    a collective failed.
            self._regroup()
            # 7. Autoscale (--data-parallel-autoscale): a change when load says so.
            if self.scaling.autoscale_due(self.loads.counts, self.health.status,
                                          time.monotonic(),
                                          [i.ttft_s for i in self.info.info]):
                self._publish_counts()
            # 8. Publish the counts when due.
            if time.monotonic() >= self._next_publish():
                self._publish_counts()

    def _on_late_engine_frame(self, frame: bytes) -> None:
        """A subscription after start-up is a restarted (or added) engine waiting for
        READY; an unsubscription is an engine going away; anything else is junk."""
        if frame[:1] == bytes([_SUBSCRIBE]):
            logger.info("an engine subscribed after start-up; sending READY")
            self.engines.send(COORDINATOR_READY)
            if self.control.seq:  # it starts paused / asleep like the others
                self._send_control()
        elif frame[:1] != b"\x00":
            logger.error("engine socket: dropping a frame that is no subscription: %r",
                         frame[:32])

    def _next_publish(self) -> float:
        """When the counts are next due: soon after a change, else at the idle period."""
        loads = self.loads
        if loads.snapshot is not None:
            return self._last_publish + self.stats_interval_s
        if loads.changed_at is not None:
            settle = min(_SETTLE_S, self.stats_interval_s / 2)
            return max(self._last_publish + self.stats_interval_s, loads.changed_at + settle)
        if self.info.changed:  # only the /engines figures moved
            return self._last_publish + min(INFO_PUBLISH_S, self.idle_publish_s)
        return self._last_publish + self.idle_publish_s

    # ---- front-ends -------------------------------------------------------------

    def _on_front_frames(self, frames: list[bytes]) -> None:
        body = frames[0]
        if len(frames) == 1 and body[:1] in (b"\x00", b"\x01"):
            if body[:1] == bytes([_SUBSCRIBE]):
                self._publish_counts()  # a new front-end gets the state at once
            return
        try:
            request = self._request_decoder.decode(body)
        except msgspec.DecodeError:
            logger.error("bad message from a front-end: %r", body[:64])
            return
        if isinstance(request, ScaleEngines):
            self._on_scale(request.num_engines)
        elif isinstance(request, (ScaleRequest, ScaleResult)):
            answer = self.scaling.on_request(request, len(self.loads), time.monotonic())
            if answer is not None:  # to the asker only in effect: others ignore its id
                self.front.send(msgspec.msgpack.encode(CoordinatorUpdate(
                    None, self.wave, self.running, scale=answer)))
            else:
                self._publish_counts()
        elif isinstance(request, RankEvent):
            self._on_rank_event(request)
        elif isinstance(request, ControlChange):
            self._on_control(request)
        elif isinstance(request, RankControl):
            self._on_rank_control(request)
        else:
            self._on_wake(request)

    def _on_rank_event(self, event: RankEvent) -> None:
        if not 0 <= event.rank < len(self.loads):
            logger.warning("rank event for unknown rank %d (have %d)", event.rank,
                           len(self.loads))
            return
        if self.health.on_event(event.rank, event.status):
            logger.info("rank %d %s (incarnation %d)%s", event.rank, event.status.state.value,
                        event.status.incarnation,
                        f": {event.status.reason}" if event.status.reason else "")
            self._publish_counts()

    def _on_rank_control(self, control: RankControl) -> None:
        """An operator's cordon / uncordon (published at once) or restart (published
        once, for the rank's launcher)."""
        rank = control.rank
        if not 0 <= rank < len(self.loads):
            logger.warning("%s for unknown rank %d (have %d)", control.action, rank,
                           len(self.loads))
        elif control.action in ("cordon", "uncordon"):
            if self.info.cordon(rank, control.action == "cordon"):
                logger.info("rank %d %sed by an operator", rank, control.action)
            self._publish_counts()  # also when unchanged: the asker waits for an update
        elif control.action == "restart":
            incarnation = self.health.status[rank].incarnation
            logger.info("rank %d (incarnation %d): restart asked by an operator", rank,
                        incarnation)
            self._publish_counts(restart=RestartRank(rank, incarnation))
        else:
            logger.warning("unknown rank control %r dropped", control.action)

    def _on_wake(self, request: WakeEngines) -> None:
        """A front-end sent a request while it thought the engines were paused."""
        if self.running:
            return  # someone already started the wave
        exclude = request.engine_index
        if request.wave < self.wave:
            exclude = None  # a stale-wave request: every engine must hear the start
        self.running = True
        self._send_start_wave(self.wave, exclude)
        self._publish_wave_state()

    def _on_control(self, change: ControlChange) -> None:
        """Pause / resume / sleep / wake_up / reset_prefix_cache on every engine."""
        try:
            self.control = next_state(self.control, change)
        except ValueError as e:
            logger.error("ignoring a control change: %s", e)
            return
        logger.info("control state %d: %s %s", self.control.seq, change.op, change.arg)
        self._send_control()
        self._publish_counts()

    def _send_control(self) -> None:
        self.engines.send_multipart([RequestType.CONTROL.value,
                                     msgspec.msgpack.encode(self.control)])

    def _on_scale(self, num_engines: int) -> None:
        old = len(self.loads)
        if num_engines < 1:
            logger.error("ignoring a scale to %d engines", num_engines)
            return
        self.loads.resize(num_engines)
        self.health.resize(num_engines)
        self.control_done = (self.control_done + [0] * num_engines)[:num_engines]
        self.info.resize(num_engines)
        if num_engines > old:
            # New engines start in wave 0 and paused; say "paused" so the next
            # request wakes everyone rather than leaving old engines behind.
            self.running = False
        logger.info("scaled from %d to %d engines", old, num_engines)
        self._publish_counts()

    # ---- engines ----------------------------------------------------------------

    def _on_report_frames(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 1:
                raise ValueError(f"{len(frames)} frames, expected 1")
            report = self._report_decoder.decode(frames[0])
        except (ValueError, msgspec.DecodeError) as e:
            logger.error("dropping a bad report from an engine: %s", e)
            return
        self._on_engine_report(report)

    def _on_engine_report(self, report: EngineReport) -> None:
        index = report.engine_index
        if not 0 <= index < len(self.loads):
            logger.warning("report from unknown engine %d (have %d)", index, len(self.loads))
            return
        if report.heartbeat:
            self.info.on_heartbeat(report, time.monotonic())
            if self.health.on_heartbeat(report, time.monotonic()):
                logger.info("rank %d serving (incarnation %d)", index, report.incarnation)
                self._publish_counts()
            return
        if report.request_counts is not None:
            if self.loads.apply(index, report.wave, report.step, report.request_counts,
                                report.waiting_tokens):
                self.info.on_wave(index, report.wave)
        if report.control_done is not None:
            self.control_done[index] = report.control_done
            self._publish_counts()  # a front-end may wait for it
        if report.group_failed is not None and self.group is not None:
            logger.warning("engine %d: DP group generation %d failed there", index,
                           report.group_failed)
            self.group.on_failed(report.group_failed, time.monotonic())
        if report.wave_complete is not None:
            self._on_wave_complete(index, report.wave_complete)
        elif report.start_wave is not None:
            self._on_start_wave(index, report.start_wave)

    def _on_wave_complete(self, index: int, wave: int) -> None:
        # Invariant: the group's leader alone reports wave completion (it speaks
        # for all members after their all-reduce); a report from another rank is
        # ignored. The leader is the lowest member (rank 0 unless it is out).
        leader = self.group.leader if self.group is not None else 0
        if index != leader:
            logger.error("engine %d reported wave_complete=%d; only rank %d may", index,
                         wave, leader)
            return
        # Invariant: waves only move forward; late news of an older wave is dropped.
        if wave < self.wave:
            return
        self.wave, self.running = wave + 1, False
        self._publish_wave_state()

    def _on_start_wave(self, index: int, wave: int) -> None:
        """Engine `index` got a request of a finished wave while paused: start `wave`."""
        # Invariant: waves only move forward; a start of an older wave, or of
        # the current one while it already runs, is dropped.
        if wave < self.wave or (wave == self.wave and self.running):
            return
        self.wave, self.running = wave, True
        self._send_start_wave(wave, exclude=index)
        self._publish_wave_state()

    # ---- sending ----------------------------------------------------------------

    def _send_start_wave(self, wave: int, exclude: int | None) -> None:
        body = msgspec.msgpack.encode(StartDPWave(wave, exclude))
        self.engines.send_multipart([RequestType.START_DP_WAVE.value, body])
        logger.debug("START_DP_WAVE wave=%d exclude=%s", wave, exclude)

    def _regroup(self) -> None:
        """Lockstep: broadcast REGROUP_DP when `_DPGroup` says a generation is due."""
        if self.group is None:
            return
        message = self.group.next(self.health.status, self.health.heard(), time.monotonic())
        if message is None:
            return
        logger.info("DP group generation %d: ranks %s", message.generation, message.members)
        self.engines.send_multipart([RequestType.REGROUP_DP.value,
                                     msgspec.msgpack.encode(message)])

    def _publish_wave_state(self) -> None:
        assert self.wave >= self._published_wave, "waves only move forward"
        self._published_wave = self.wave
        self.front.send(msgspec.msgpack.encode(CoordinatorUpdate(None, self.wave, self.running)))

    def _publish_counts(self, restart: RestartRank | None = None) -> None:
        counts = self.loads.take()
        update = CoordinatorUpdate(counts if self.publish_counts else None, self.wave,
                                   self.running, list(self.health.status),
                                   # (no news while nothing was ever changed or waits)
                                   self.control if self.control.seq else None,
                                   list(self.control_done) if self.control.seq else None,
                                   list(self.loads.tokens) if self.publish_counts
                                   and any(self.loads.tokens) else None,
                                   engines=self.info.take(), restart=restart,
                                   scale=self.scaling.status,
                                   autoscale_decisions=self.scaling.decisions())
        self.front.send(msgspec.msgpack.encode(update))
        self._last_publish = time.monotonic()


def _host_store(host: str, port: int, secret: str | None) -> Any:
    """The store server of the engines' lockstep DP group (lives with this process),
    bound to `host` only; imported here: it brings torch, which only lockstep needs."""
    from dpserve.engine.dp_store import DPStoreServer, store_address

    address = store_address(host, port)
    logger.info("hosting the DP group store at %s", address)
    return DPStoreServer(address, secret)


def run_coordinator(num_engines: int, front_publish_address: str | list[str],
                    engine_report_address: str | list[str],
                    engine_publish_address: str | list[str], parent_pid: int,
                    **settings: Any) -> None:
    """Process target: exit 0 on a stop signal or parent death, 1 on a failure."""
    name_process("DPCoordinator")
    coordinator: DPCoordinatorProc | None = None
    exit_code = 0
    try:
        coordinator = DPCoordinatorProc(num_engines, front_publish_address,
                                        engine_report_address, engine_publish_address,
                                        **settings)
        signal.signal(signal.SIGTERM, coordinator.request_stop)
        # Ctrl-C reaches the whole process group: the launcher drains, then SIGTERMs us.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        start_parent_watcher(parent_pid, "the DP coordinator")
        if coordinator.wait_for_engines():
            coordinator.run()
        elif not coordinator.stop_requested and os.getppid() == parent_pid:
            exit_code = 1  # start-up timed out
    except Exception:
        logger.exception("DP coordinator failed")
        exit_code = 1
    finally:
        if coordinator is not None:
            coordinator.close()
    logger.info("DP coordinator exiting (code %d)", exit_code)
    sys.exit(exit_code)
