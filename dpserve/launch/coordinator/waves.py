"""The DP-wide request wave, as the coordinator keeps it (IO-free).

Scope: `Waves`: the current wave and whether the engines run it or are paused.
Each event returns what the coordinator's loop must send: a `StartDPWave` for
the engines (or None), and `changed` says the wave state is news for the
front-ends (published at once).

* Rank 0 (the DP group's leader) says `wave_complete=w`: every rank paused
  after their all-reduce, so wave w+1 starts, paused.
* A front-end that sent a request while it thought the engines paused
  (`WakeEngines`), or an engine that got a request of a finished wave
  (`start_wave`), starts the wave on the other engines.
* Engines added by scaling start in wave 0, paused: the state says "paused",
  so the next request wakes every engine.

Invariants: waves only move forward (late news of an older wave is dropped);
the leader alone reports wave completion (a report from another rank is
ignored, logged).

Not here: the all-reduce that ends a wave (the engines, `dpserve.engine.dp`),
the sockets (`dpserve.launch.coordinator.proc`).
"""

from __future__ import annotations

import logging

from dpserve.protocol import StartDPWave, WakeEngines

logger = logging.getLogger("dpserve.launch.coordinator")


class Waves:
    """The wave and its running / paused state (module docstring)."""

    def __init__(self) -> None:
        self.wave = 0  # the current request wave
        self.running = False  # engines are in a running wave (else paused)
        self.published = 0  # the last wave published (never goes back)

    def on_wake(self, request: WakeEngines) -> StartDPWave | None:
        """A front-end sent a request while it thought the engines were paused."""
        if self.running:
            return None  # someone already started the wave
        exclude = request.engine_index
        if request.wave < self.wave:
            exclude = None  # a stale-wave request: every engine must hear the start
        self.running = True
        return StartDPWave(self.wave, exclude)

    def on_wave_complete(self, index: int, wave: int, leader: int) -> bool:
        """Engine `index` says `wave` ended everywhere; True: the state changed."""
        # Invariant: the group's leader alone reports wave completion (it speaks
        # for all members after their all-reduce); a report from another rank is
        # ignored. The leader is the lowest member (rank 0 unless it is out).
        if index != leader:
            logger.error("engine %d reported wave_complete=%d; only rank %d may", index,
                         wave, leader)
            return False
        # Invariant: waves only move forward; late news of an older wave is dropped.
        if wave < self.wave:
            return False
        self.wave, self.running = wave + 1, False
        return True

    def on_start_wave(self, index: int, wave: int) -> StartDPWave | None:
        """Engine `index` got a request of a finished wave while paused: start `wave`."""
        # Invariant: waves only move forward; a start of an older wave, or of
        # the current one while it already runs, is dropped.
        if wave < self.wave or (wave == self.wave and self.running):
            return None
        self.wave, self.running = wave, True
        return StartDPWave(wave, exclude_engine_index=index)

    def scaled_up(self) -> None:
        """New engines start in wave 0 and paused; say "paused" so the next request
        wakes everyone rather than leaving old engines behind."""
        self.running = False

    def publish(self) -> None:
        """The state goes out now (waves only move forward)."""
        assert self.wave >= self.published, "waves only move forward"
        self.published = self.wave
