"""The API server's periodic stats line (`--log-stats-interval`, default 10 s; off with
`--disable-log-stats`): per engine, the prompt and generation throughput of this API
server's requests over the interval, and the engine's running / waiting requests and
KV-cache usage (its latest SchedulerStats). Quiet while every engine is idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dpserve.frontend.async_llm import AsyncLLM, IterationStats
    from dpserve.protocol import SchedulerStats

logger = logging.getLogger("dpserve.stats")


class StatsLine:
    """A stats listener: counts tokens per engine between two `log` calls."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}  # engine index -> [prompt, generation]

    def record(self, engine_index: int | None, scheduler_stats: SchedulerStats | None,
               iteration: IterationStats | None) -> None:
        if engine_index is None or iteration is None:
            return
        counts = self.tokens.setdefault(engine_index, [0, 0])
        counts[0] += iteration.num_prompt_tokens
        counts[1] += iteration.num_generation_tokens

    def log(self, elapsed: float, stats: dict[int, SchedulerStats]) -> None:
        """One line per engine, unless all are idle; then start counting again."""
        tokens, self.tokens = self.tokens, {}
        busy = any(sum(t) for t in tokens.values()) or any(
            s.num_running or s.num_waiting for s in stats.values())
        if not busy:
            return
        for engine in sorted(set(tokens) | set(stats)):
            prompt, generation = tokens.get(engine, (0, 0))
            s = stats.get(engine)
            state = (f"running {s.num_running}, waiting {s.num_waiting}, KV cache "
                     f"{100 * s.kv_cache_usage:.1f}%" if s is not None else "no stats yet")
            logger.info("engine %d: prompt %.1f tok/s, generation %.1f tok/s, %s", engine,
                        prompt / elapsed, generation / elapsed, state)


async def log_stats_every(llm: AsyncLLM, interval: float) -> None:
    """Run until cancelled: a StatsLine on `llm`, logged every `interval` seconds."""
    line = StatsLine()
    llm.add_stats_listener(line)
    last = time.monotonic()
    while True:
        await asyncio.sleep(interval)
        now = time.monotonic()
        line.log(now - last, dict(llm.scheduler_stats))
        last = now
