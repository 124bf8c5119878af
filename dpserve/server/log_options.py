"""What the API server logs (vLLM's option names): one line per request arrival and
finish (`--enable-log-requests`), uvicorn's access log (on by default; off with
`--disable-uvicorn-access-log`, or for some paths with
`--disable-access-log-for-endpoints /health,/metrics`), and the periodic stats line
(`--log-stats-interval`, `--disable-log-stats`; server/metrics/stats_log.py).

`add_log_args` adds the flags, `LogOptions.from_args` reads them once,
`configure_access_log` sets uvicorn's access logger up, `logged_stream` wraps a
request's output stream when requests are logged.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from dpserve.errors import ConfigError
from dpserve.outputs import RequestOutput
from dpserve.sampling_params import SamplingParams

logger = logging.getLogger("dpserve.requests")


@dataclass(frozen=True)
class LogOptions:
    log_requests: bool = False  # a line per request arrival and finish
    access_log: bool = True  # uvicorn's line per HTTP response
    access_log_skip: tuple[str, ...] = ()  # paths whose responses are not logged
    log_stats_interval: float | None = 10.0  # seconds between stats lines (None: off)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LogOptions:
        raw = getattr(args, "disable_access_log_for_endpoints", None) or ""
        skip = tuple(p.strip() for p in raw.split(",") if p.strip())
        if any(not p.startswith("/") for p in skip):
            raise ConfigError(f"--disable-access-log-for-endpoints takes paths starting "
                              f"with '/', comma-separated (e.g. /health,/metrics), got {raw!r}")
        interval = getattr(args, "log_stats_interval", 10.0)
        if interval is not None and not interval > 0:
            raise ConfigError(f"--log-stats-interval must be positive, got {interval}")
        return cls(log_requests=bool(getattr(args, "enable_log_requests", False)),
                   access_log=not getattr(args, "disable_uvicorn_access_log", False),
                   access_log_skip=skip,
                   log_stats_interval=None if getattr(args, "disable_log_stats", False)
                   else interval)


def add_log_args(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--enable-log-requests", action="store_true",
      help="Log each request's arrival (id, prompt tokens, sampling parameters) and finish.")
    a("--disable-uvicorn-access-log", action="store_true",
      help="No access log line per HTTP response.")
    a("--disable-access-log-for-endpoints", default=None,
      help="No access log lines for these paths, comma-separated (e.g. /health,/metrics).")
    a("--log-stats-interval", type=float, default=10.0,
      help="Seconds between the API server's stats lines (per-rank throughput, "
           "running/waiting requests, KV-cache usage).")
    a("--disable-log-stats", action="store_true", help="No periodic stats line.")


class _SkipPaths(logging.Filter):
    """Drops uvicorn access records (args: client, method, path, http version, status)
    whose path, without its query, is one of `paths`."""

    def __init__(self, paths: tuple[str, ...]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in self.paths
        return True


def configure_access_log(options: LogOptions) -> None:
    """After uvicorn.Config is made (it sets its loggers' levels): access lines at INFO
    whatever --uvicorn-log-level says, minus the skipped paths."""
    access = logging.getLogger("uvicorn.access")
    for f in [f for f in access.filters if isinstance(f, _SkipPaths)]:
        access.removeFilter(f)
    if not options.access_log:
        return
    access.setLevel(logging.INFO)
    if options.access_log_skip:
        access.addFilter(_SkipPaths(options.access_log_skip))


async def logged_stream(stream: AsyncIterator[RequestOutput], request_id: str,
                        num_prompt_tokens: int, params: SamplingParams,
                        ) -> AsyncIterator[RequestOutput]:
    """`stream` as is, with a log line when it starts and when it ends."""
    logger.info("request %s arrived: %d prompt tokens, params %s", request_id,
                num_prompt_tokens, params)
    tokens, reasons = 0, "aborted"
    try:
        async with aclosing(stream):  # type: ignore[type-var]  # a closed stream aborts
            async for out in stream:
                tokens += sum(len(c.token_ids) for c in out.outputs)
                if out.finished:
                    reasons = ",".join(str(c.finish_reason) for c in out.outputs)
                yield out
    finally:
        logger.info("request %s finished (%s): %d output tokens", request_id, reasons,
                    tokens)
