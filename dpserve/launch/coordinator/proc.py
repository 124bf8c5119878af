"""The DP coordinator process: its sockets and its loop (`DPCoordinatorProc`).

Scope: the loop that reads the front-ends, the engines' reports and late
subscriptions, and the tenant desk, and publishes `CoordinatorUpdate`s: the
load counts (at most every `stats_interval_s` while they change, every
`idle_publish_s` otherwise), rank health, pause / sleep, scale news, per-rank
figures, the LoRA registry. Its state is in IO-free parts: `LoadTable`,
`HealthTable`, `ControlBook` (tables.py), `Waves` (waves.py), `DPGroup`
(dp_group.py), `ScaleBook` (autoscale.py), `LoRARegistry` (loras.py),
`PrefixRelay` (prefix_relay.py), `TenantDesk` (tenants.py). In lockstep mode it
hosts the engines' DP group store, so that any rank may die.

Invariants: waves only move forward, and only the DP group's leader reports a
wave complete (`Waves`); an engine's counts only move forward in (wave, step)
(`LoadTable`); a restarted or added engine gets READY (with the LoRA registry)
and the current control state.

Sockets (all bound here; the wire format is in `dpserve.protocol`): front
publish XPUB (updates out; WakeEngines, scale and control messages in), engine
report PULL, engine publish XPUB (READY, START_DP_WAVE, REGROUP_DP, CONTROL),
the DP store ROUTER (lockstep), the tenant ROUTER (--tenant-limits).

The process exits on SIGTERM (it ignores Ctrl-C's SIGINT: the parent stops it),
when its parent dies, or with exit code 1 when not every engine subscribes in
time.

Not here: the launcher's handle on the process (`handle.py`), load-balancing
decisions (front-ends), the all-reduce that ends a wave (engines), starting
engines (`dpserve.launch.engines`).

Design: docs/design/coordinator.md
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Any

import msgspec
import zmq

from dpserve.config import AutoscaleConfig
from dpserve.launch.coordinator.autoscale import ScaleBook
from dpserve.launch.coordinator.dp_group import DPGroup
from dpserve.launch.coordinator.loras import LoRARegistry
from dpserve.launch.coordinator.prefix_relay import PrefixRelay
from dpserve.launch.coordinator.tables import ControlBook, HealthTable, LoadTable
from dpserve.launch.coordinator.tenants import TenantDesk
from dpserve.launch.coordinator.waves import Waves
from dpserve.logging_utils import name_process
from dpserve.parent_watch import start_parent_watcher
from dpserve.protocol import (
    ControlChange,
    CoordinatorRequest,
    CoordinatorUpdate,
    EngineReport,
    LoRAChange,
    RankControl,
    RankEvent,
    RequestType,
    RestartRank,
    ScaleEngines,
    ScaleRequest,
    ScaleResult,
    StartDPWave,
)
from dpserve.rank_info import INFO_PUBLISH_S, RankInfoTable
from dpserve.security import secure
from dpserve.tenancy.limits import TenantLimits

logger = logging.getLogger("dpserve.launch.coordinator")

_MAX_SLEEP_S = 1.0  # the longest a start-up wait sleeps
_HEALTH_CHECK_S = 0.25  # the loop looks at heartbeats at least this often
_SETTLE_S = 0.05  # after a quiet spell, wait this long for the other engines' reports
_SUBSCRIBE = 1  # first byte of an XPUB subscription frame (0 = unsubscribe)


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
                 autoscale: AutoscaleConfig | None = None,
                 loras: dict[str, str] | None = None, tenant_address: str | None = None,
                 tenant_limits: TenantLimits | None = None) -> None:
        self.loras = LoRARegistry(loras)  # the DP-wide adapter registry (LoRA on)
        self.loads = LoadTable(num_engines)
        self.scaling = ScaleBook(size_max, autoscale)  # run-time changes of the engine count
        self.health = HealthTable(num_engines, heartbeat_timeout_s, stall_timeout_s)
        self.info = RankInfoTable(num_engines)  # what /engines shows besides counts
        self.group = DPGroup() if dp_store is not None else None  # lockstep only
        self._store = _host_store(*dp_store, secret) if dp_store is not None else None
        self.waves = Waves()  # the request wave, running or paused
        self.control = ControlBook(num_engines)  # pause / sleep of every rank
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
        self.prefixes = PrefixRelay(self.front)  # API servers' prefix facts, to the others
        self.tenants = _tenant_desk(self.ctx, tenant_address, tenant_limits, secret)
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
        self._send_ready()
        logger.info("all %d engines subscribed; sent READY", subscribed)
        return True

    # ---- the loop --------------------------------------------------------------

    def run(self) -> None:
        poller = zmq.Poller()
        tenants = [self.tenants.socket] if self.tenants is not None else []
        for sock in (self.front, self.reports, self.engines, *tenants):
            poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._should_exit():
            # 1. Sleep until the next publish or DP group generation is due, a
            #    message comes, or _HEALTH_CHECK_S passes (heartbeats, the parent).
            wake = self._next_publish()
            if self.group is not None and self.group.due is not None:
                wake = min(wake, self.group.due)  # a generation is due (step 6)
            timeout = min(max(0.0, wake - time.monotonic()), _HEALTH_CHECK_S)
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
            if self.tenants is not None and self.tenants.socket in events:
                self.tenants.on_frames()  # 4b. tenant admissions (answered at once), ends
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
            self._send_ready()
            if self.control.state.seq:  # it starts paused / asleep like the others
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
        waves = self.waves
        if self.prefixes.on_frame(body, len(self.loads), waves.wave, waves.running):
            return  # an API server's prefix facts, relayed (or dropped)
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
                    None, waves.wave, waves.running, scale=answer)))
            else:
                self._publish_counts()
        elif isinstance(request, RankEvent):
            self._on_rank_event(request)
        elif isinstance(request, ControlChange):  # pause / sleep ... on every engine
            if self.control.change(request):
                self._send_control()
                self._publish_counts()
        elif isinstance(request, RankControl):
            self._on_rank_control(request)
        elif isinstance(request, LoRAChange):  # the registry changes, published at once
            if self.loras.apply(request):
                self._publish_counts()
        else:  # WakeEngines: a request sent while the engines seemed paused
            self._start_wave(self.waves.on_wake(request))

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

    def _send_ready(self) -> None:
        """READY; with LoRA on, the adapter registry as a second frame."""
        self.engines.send_multipart(self.loras.ready_frames())

    def _send_control(self) -> None:
        self.engines.send_multipart([RequestType.CONTROL.value,
                                     msgspec.msgpack.encode(self.control.state)])

    def _on_scale(self, num_engines: int) -> None:
        old = len(self.loads)
        if num_engines < 1:
            logger.error("ignoring a scale to %d engines", num_engines)
            return
        self.loads.resize(num_engines)
        self.health.resize(num_engines)
        self.control.resize(num_engines)
        self.info.resize(num_engines)
        if num_engines > old:
            self.waves.scaled_up()  # paused: the next request wakes every engine
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
            if self.loras.seed(report):  # a restarted coordinator's registry, complete
                self._publish_counts()
            if self.health.on_heartbeat(report, time.monotonic()):
                logger.info("rank %d serving (incarnation %d)", index, report.incarnation)
                self._publish_counts()
            return
        if report.request_counts is not None:
            if self.loads.apply(index, report.wave, report.step, report.request_counts,
                                report.waiting_tokens):
                self.info.on_wave(index, report.wave)
        if report.control_done is not None:
            self.control.done[index] = report.control_done
            self._publish_counts()  # a front-end may wait for it
        if report.group_failed is not None and self.group is not None:
            logger.warning("engine %d: DP group generation %d failed there", index,
                           report.group_failed)
            self.group.on_failed(report.group_failed, time.monotonic())
        if report.wave_complete is not None:
            leader = self.group.leader if self.group is not None else 0
            if self.waves.on_wave_complete(index, report.wave_complete, leader):
                self._publish_wave_state()
        elif report.start_wave is not None:
            self._start_wave(self.waves.on_start_wave(index, report.start_wave))

    # ---- sending ----------------------------------------------------------------

    def _start_wave(self, start: StartDPWave | None) -> None:
        """START_DP_WAVE to the engines (but the one excluded), then the news."""
        if start is None:
            return
        body = msgspec.msgpack.encode(start)
        self.engines.send_multipart([RequestType.START_DP_WAVE.value, body])
        logger.debug("START_DP_WAVE wave=%d exclude=%s", start.wave, start.exclude_engine_index)
        self._publish_wave_state()

    def _regroup(self) -> None:
        """Lockstep: broadcast REGROUP_DP when `DPGroup` says a generation is due."""
        if self.group is None:
            return
        message = self.group.next(self.health.status, self.health.heard(), time.monotonic())
        if message is None:
            return
        logger.info("DP group generation %d: ranks %s", message.generation, message.members)
        self.engines.send_multipart([RequestType.REGROUP_DP.value,
                                     msgspec.msgpack.encode(message)])

    def _publish_wave_state(self) -> None:
        self.waves.publish()
        update = CoordinatorUpdate(None, self.waves.wave, self.waves.running)
        self.front.send(msgspec.msgpack.encode(update))

    def _publish_counts(self, restart: RestartRank | None = None) -> None:
        counts = self.loads.take()
        control, control_done = self.control.published()
        update = CoordinatorUpdate(counts if self.publish_counts else None, self.waves.wave,
                                   self.waves.running, list(self.health.status),
                                   control, control_done,
                                   list(self.loads.tokens) if self.publish_counts
                                   and any(self.loads.tokens) else None,
                                   engines=self.info.take(), restart=restart,
                                   scale=self.scaling.status,
                                   autoscale_decisions=self.scaling.decisions(),
                                   loras=self.loras.published())
        self.front.send(msgspec.msgpack.encode(update))
        self._last_publish = time.monotonic()


def _tenant_desk(ctx: zmq.Context, address: str | None, limits: TenantLimits | None,
                 secret: str | None) -> TenantDesk | None:
    """The tenant ledger's desk at `address` (None: no --tenant-limits)."""
    if address is None:
        return None
    return TenantDesk(ctx, address, limits or TenantLimits(), secret)


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
