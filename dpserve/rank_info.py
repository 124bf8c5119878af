"""Per-rank figures for `GET /engines`: token rates and the coordinator's info table.

Scope: `TokenRate` (output tokens per second from cumulative counts over a
sliding window) and `RankInfoTable`, which the DP coordinator fills from
engine heartbeats (KV usage, tokens, pid, host), load reports (wave) and
operators' `RankControl`s (cordon), and publishes as `EngineInfo` per rank in
`CoordinatorUpdate.engines`, so every API server answers /engines alike.

Not here: the coordinator's sockets and loop (`dpserve.launch.coordinator`),
the HTTP view (`dpserve.server.ops.engines`).
"""

from __future__ import annotations

import collections
import time

from dpserve.protocol import EngineInfo, EngineReport

RATE_WINDOW_S = 5.0  # tokens/s is averaged over about this long
INFO_PUBLISH_S = 1.0  # changed figures are published at most this often


class TokenRate:
    """Tokens per second from `(time, cumulative count)` samples of the last
    `window_s` seconds. A count that goes down (a new process) starts over."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, count: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._samples and count < self._samples[-1][1]:
            self._samples.clear()
        self._samples.append((now, count))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def rate(self, now: float | None = None) -> float:
        """Tokens/s between the oldest kept sample and the newest (0 with fewer than 2,
        or when the newest is older than the window: the counts stopped coming)."""
        now = time.monotonic() if now is None else now
        if len(self._samples) < 2 or now - self._samples[-1][0] > self.window_s:
            return 0.0
        (t0, c0), (t1, c1) = self._samples[0], self._samples[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else 0.0


class RankInfoTable:
    """Each rank's `EngineInfo`, kept by the coordinator; `changed` says that figures
    moved since the last `take()` (the coordinator publishes them then, at most every
    `INFO_PUBLISH_S`)."""

    def __init__(self, num_engines: int) -> None:
        self.info = [EngineInfo() for _ in range(num_engines)]
        self._rates = [TokenRate() for _ in range(num_engines)]
        self._incarnation = [0] * num_engines
        self.changed = False

    def resize(self, num_engines: int) -> None:
        grow = num_engines - len(self.info)
        del self.info[num_engines:], self._rates[num_engines:]
        del self._incarnation[num_engines:]
        self.info += [EngineInfo() for _ in range(grow)]
        self._rates += [TokenRate() for _ in range(grow)]
        self._incarnation += [0] * grow

    def on_heartbeat(self, report: EngineReport, now: float) -> None:
        rank = report.engine_index
        if report.incarnation < self._incarnation[rank]:
            return  # a process this rank has already replaced
        if report.incarnation > self._incarnation[rank]:
            self._incarnation[rank] = report.incarnation
            self._rates[rank] = TokenRate()
        self._rates[rank].add(report.generated_tokens, now)
        self._set(rank, kv_cache_usage=round(report.kv_cache_usage, 4),
                  ttft_s=round(report.ttft_s, 3),
                  tokens_per_s=round(self._rates[rank].rate(now), 2), pid=report.pid,
                  host=report.host, tp_workers=report.tp_workers, lora=report.lora,
                  kv_store_address=report.kv_store_address)

    def on_wave(self, rank: int, wave: int) -> None:
        self._set(rank, wave=wave)

    def cordon(self, rank: int, cordoned: bool) -> bool:
        """Set a rank's cordon; True when that changed it."""
        if self.info[rank].cordoned == cordoned:
            return False
        self._set(rank, cordoned=cordoned)
        return True

    def _set(self, rank: int, **fields: object) -> None:
        old = self.info[rank]
        if any(getattr(old, name) != value for name, value in fields.items()):
            self.info[rank] = EngineInfo(**{**{f: getattr(old, f) for f in
                                               EngineInfo.__struct_fields__}, **fields})
            self.changed = True

    def take(self) -> list[EngineInfo]:
        """The figures to publish now (a copy); clears `changed`."""
        self.changed = False
        return list(self.info)
