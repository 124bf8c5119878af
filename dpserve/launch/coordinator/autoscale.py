"""Run-time changes of the DP engine count, as the coordinator keeps them.

Scope (inside the coordinator process, no sockets here):
* `ScaleBook`: the one change that may run at a time. A front-end's
  `ScaleRequest` becomes PENDING (the launcher's `dpserve.launch.scaler` takes
  it), or is answered at once: DONE when the size is already that, REJECTED
  while another change runs, FAILED for a size out of [1, size_max]. The
  launcher's `ScaleResult` ends it (DONE / FAILED, or REFUSED when the
  placement cannot hold the new size: the launcher checks that, as no ceiling
  need be declared).
* `Autoscaler` (`--data-parallel-autoscale MIN:MAX`): from the engines' load
  counts, one rank more when the mean number of waiting requests per serving
  rank stays above `up_queue` (or, with `up_ttft_s`, a serving rank's recent
  mean time to first token stays above it) for `up_window_s`; one rank less when the mean
  of waiting + running stays below `down_load` for `down_window_s`. Hysteresis:
  separate thresholds and windows, and no decision within `cooldown_s` of the
  end of the last change (or while one runs). Every decision is logged with
  its reason and counted (published as `CoordinatorUpdate.autoscale_decisions`,
  shown as `dpserve:autoscale_decisions_total{direction}`).

Not here: starting or stopping engines (`dpserve.launch.scaler`), HTTP
(`dpserve.server.ops.scale`).
"""

from __future__ import annotations

import itertools
import logging
import sys

from dpserve.config import AutoscaleConfig
from dpserve.protocol import (
    RankState,
    RankStatus,
    ScalePhase,
    ScaleRequest,
    ScaleResult,
    ScaleStatus,
)

logger = logging.getLogger(__name__)

NO_CEILING = sys.maxsize  # ScaleBook.size_max when no ceiling was declared


class Autoscaler:
    """Decides one step up or down from the load counts; see the module docstring."""

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self._high_since: float | None = None  # load above the up target since
        self._low_since: float | None = None  # load below the down target since
        self.decisions = {"up": 0, "down": 0}

    def reset(self, now: float) -> None:
        """A change ended (or started): windows start again."""
        self._high_since = self._low_since = None

    def decide(self, counts: list[list[int]], status: list[RankStatus],
               now: float, ttft: list[float] | None = None) -> tuple[int, str] | None:
        """(new size, reason) when a window has passed, else None. `ttft`: each rank's
        recent mean time to first token (s), from its heartbeats."""
        c = self.config
        size = len(status)
        serving = [r for r, s in enumerate(status) if s.state is RankState.SERVING]
        if not serving:
            self.reset(now)
            return None
        waiting = sum(counts[r][0] for r in range(min(size, len(counts)))) / len(serving)
        load = sum(sum(counts[r]) for r in range(min(size, len(counts)))) / len(serving)
        slowest = max((ttft[r] for r in serving if r < len(ttft)), default=0.0) if ttft else 0.0
        slow = c.up_ttft_s is not None and slowest > c.up_ttft_s
        high = (waiting > c.up_queue or slow) and size < c.max_size
        low = load < c.down_load and size > c.min_size
        if not high:
            self._high_since = None
        elif self._high_since is None:
            self._high_since = now
        if not low:
            self._low_since = None
        elif self._low_since is None:
            self._low_since = now
        if self._high_since is not None and now - self._high_since >= c.up_window_s:
            why = (f"mean waiting requests per serving rank {waiting:.2f} > {c.up_queue:g}"
                   if waiting > c.up_queue else
                   f"a serving rank's mean time to first token {slowest:.2f} s > "
                   f"{c.up_ttft_s:g} s")
            return size + 1, f"{why} for {c.up_window_s:g} s"
        if self._low_since is not None and now - self._low_since >= c.down_window_s:
            return size - 1, (f"mean waiting + running requests per serving rank "
                              f"{load:.2f} < {c.down_load:g} for {c.down_window_s:g} s")
        return None


class ScaleBook:
    """The change of the engine count that runs (at most one), and the last one.

    `size_max`: the largest size a change may reach (`NO_CEILING`: none declared, the
    launcher refuses what the placement cannot hold; None: no run-time scaling).
    """

    def __init__(self, size_max: int | None, autoscale: AutoscaleConfig | None = None) -> None:
        self.size_max = size_max
        self.status: ScaleStatus | None = None  # the running change, else the last one
        self.autoscaler = Autoscaler(autoscale) if autoscale is not None else None
        self._ended_at: float | None = None  # when the last change ended
        self._ids = itertools.count(1)

    @property
    def busy(self) -> bool:
        return self.status is not None and self.status.phase is ScalePhase.PENDING

    def on_request(self, request: ScaleRequest | ScaleResult, size: int,
                   now: float) -> ScaleStatus | None:
        """A front-end's request or the launcher's result; returns an answer to publish
        at once when it is not the change itself (rejected, failed, nothing to do)."""
        if isinstance(request, ScaleResult):
            self._on_result(request, now)
            return None
        n = request.num_engines
        answer = ScaleStatus(request.scale_id, ScalePhase.REJECTED, size, n)
        if self.size_max is None:
            answer.phase, answer.message = ScalePhase.FAILED, "scaling at run time is off"
        elif not 1 <= n <= self.size_max:
            answer.phase = ScalePhase.FAILED
            answer.message = (f"new size {n} is not in [1, {self.size_max}]"
                              if self.size_max != NO_CEILING else f"new size {n} is below 1")
        elif self.busy:
            assert self.status is not None
            answer.message = (f"a change from {self.status.old_size} to "
                              f"{self.status.new_size} engines is in progress")
        elif n == size:
            answer.phase, answer.message = ScalePhase.DONE, "already at that size"
        else:
            self._start(ScaleStatus(request.scale_id, ScalePhase.PENDING, size, n), now)
            return None
        return answer

    def _start(self, status: ScaleStatus, now: float) -> None:
        logger.info("scale %s: %d -> %d engines%s", status.scale_id, status.old_size,
                    status.new_size, f" ({status.message})" if status.message else "")
        self.status = status
        if self.autoscaler is not None:
            self.autoscaler.reset(now)

    def _on_result(self, result: ScaleResult, now: float) -> None:
        status = self.status
        if status is None or status.scale_id != result.scale_id or not self.busy:
            logger.warning("result of an unknown scale %s dropped", result.scale_id)
            return
        phase = (ScalePhase.DONE if result.ok else
                 ScalePhase.REFUSED if result.refused else ScalePhase.FAILED)
        self.status = ScaleStatus(status.scale_id, phase, status.old_size, status.new_size,
                                  result.message)
        self._ended_at = now
        if self.autoscaler is not None:
            self.autoscaler.reset(now)
        (logger.info if result.ok else logger.error)(
            "scale %s %s: %d -> %d engines%s", status.scale_id, self.status.phase.value,
            status.old_size, status.new_size, f": {result.message}" if result.message else "")

    def autoscale_due(self, counts: list[list[int]], status: list[RankStatus],
                      now: float, ttft: list[float] | None = None) -> bool:
        """Autoscale: start a change when the load says so; True when one started."""
        scaler = self.autoscaler
        if scaler is None or self.busy:
            return False
        if self._ended_at is not None and now - self._ended_at < scaler.config.cooldown_s:
            return False
        decision = scaler.decide(counts, status, now, ttft)
        if decision is None:
            return False
        size, reason = decision
        direction = "up" if size > len(status) else "down"
        scaler.decisions[direction] += 1
        logger.warning("autoscale %s: %d -> %d engines: %s", direction, len(status), size,
                       reason)
        self._start(ScaleStatus(f"autoscale-{next(self._ids)}", ScalePhase.PENDING,
                                len(status), size, f"autoscale {direction}: {reason}"), now)
        return True

    def decisions(self) -> list[int] | None:
        """[up, down] decisions so far (None without an autoscaler)."""
        if self.autoscaler is None:
            return None
        return [self.autoscaler.decisions["up"], self.autoscaler.decisions["down"]]
