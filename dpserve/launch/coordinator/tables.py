"""The coordinator's rank tables: load counts, health, pause / sleep of each rank.

Scope (inside the coordinator process, no sockets here): `LoadTable` (each
engine's `[waiting, running]` counts, ordered by (wave, step)), `HealthTable`
(each rank's `RankStatus`, from heartbeats and the launchers' `RankEvent`s) and
`ControlBook` (the pause / sleep `ControlState` of every rank, rules in
`dpserve.control`, and the seq each engine reports it reached). The per-rank
figures for /engines are `dpserve.rank_info.RankInfoTable`.

Not here: the sockets and the loop that feed them (`dpserve.launch.coordinator.proc`).
"""

from __future__ import annotations

import logging
import time

from dpserve.control import next_state
from dpserve.protocol import ControlChange, ControlState, EngineReport, RankState, RankStatus

logger = logging.getLogger("dpserve.launch.coordinator")


class LoadTable:
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


class HealthTable:
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


class ControlBook:
    """Pause / sleep of every rank: the state the engines are told (CONTROL), and
    the control seq each engine reported reached (`done`)."""

    def __init__(self, num_engines: int) -> None:
        self.state = ControlState()
        self.done = [0] * num_engines  # the control seq each engine reached

    def change(self, change: ControlChange) -> bool:
        """Pause / resume / sleep / wake_up / reset_prefix_cache on every engine;
        True: the new state goes to the engines (and the front-ends)."""
        try:
            self.state = next_state(self.state, change)
        except ValueError as e:
            logger.error("ignoring a control change: %s", e)
            return False
        logger.info("control state %d: %s %s", self.state.seq, change.op, change.arg)
        return True

    def resize(self, num_engines: int) -> None:
        self.done = (self.done + [0] * num_engines)[:num_engines]

    def published(self) -> tuple[ControlState | None, list[int] | None]:
        """(state, done) for a publish; no news while nothing was ever changed."""
        if not self.state.seq:
            return None, None
        return self.state, list(self.done)
