"""One traced request's story in one engine, and the spans it becomes when it finishes.

Scope: `RequestTrace`, held by the engine's `Request.trace` only when the request came
with a trace context (`EngineCoreRequest.trace_headers`) and this process traces. The
scheduler tells it each scheduling of a prefill chunk (`scheduled`, from
`Request.for_step`), each preemption (`preempted`) and the finish (`finished`, when
the request is freed: stop, length, abort), which writes the spans at once with
explicit times (this engine's monotonic clock turned into unix time):

    engine   arrival -> finish; rank, request id, token counts, cached tokens,
             preemptions, finish reason; `preempted` events; parent: the carrier's
             span (the API server's `route`, or its `migrate` for a moved request)
      queue    arrival -> first scheduled
      prefill  first scheduled -> first token; a `chunk` event per prefill chunk
               (its first position and size)
      decode   first token -> finish; `recompute_chunk` events (after a preemption)

Recording is a list append per prefill chunk and per preemption: no opentelemetry
call until the finish. Nothing here holds a prompt's tokens or text.

Not here: where the hooks sit (`dpserve.engine.request`, `dpserve.engine.scheduler`),
the span helpers (`dpserve.tracing.spans`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger(__name__)


class RequestTrace:
    """A traced request's times in this engine (module docstring)."""

    def __init__(self, carrier: dict[str, str], rank: int, num_prior_tokens: int = 0) -> None:
        self.carrier = carrier  # the parent span's context (W3C headers)
        self.rank = rank
        self.num_prior_tokens = num_prior_tokens  # tokens another rank generated (a move)
        # monotonic s -> unix ns, fixed once for the request
        self.wall_offset_ns = time.time_ns() - time.monotonic_ns()
        self.chunks: list[tuple[float, int, int]] = []  # (monotonic s, first position, size)
        self.preemptions: list[float] = []  # monotonic s

    def scheduled(self, start: int, num_new: int, num_prompt_tokens: int) -> None:
        """A step takes `num_new` tokens from position `start`: a prefill chunk unless
        it is one decode token."""
        if num_new > 1 or start < num_prompt_tokens:
            self.chunks.append((time.monotonic(), start, num_new))

    def preempted(self) -> None:
        self.preemptions.append(time.monotonic())

    def finished(self, request: Any) -> None:
        """The request (`dpserve.engine.request.Request`) is done here: write its spans.
        A failure to is logged, never raised into the scheduler."""
        try:
            self._emit(request, time.monotonic())
        except Exception:  # noqa: BLE001 - tracing must not break serving
            logger.exception("could not record the spans of request %s", request.request_id)

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self.wall_offset_ns

    def _emit(self, request: Any, now: float) -> None:
        from dpserve.tracing.spans import record_span

        arrival = request.engine_arrival
        scheduled = request.scheduled_at
        first = request.first_token_at
        reason = request.finish_reason
        prefilled = first if first is not None else now
        engine = record_span("engine", self.carrier, self._ns(arrival), self._ns(now), {
            "dpserve.rank": self.rank, "dpserve.request_id": request.request_id,
            "dpserve.prompt_tokens": request.num_prompt_tokens,
            "dpserve.output_tokens": request.num_output_tokens - self.num_prior_tokens,
            "dpserve.prior_output_tokens": self.num_prior_tokens,
            "dpserve.cached_tokens": max(request.num_cached_tokens, 0),
            "dpserve.preemptions": len(self.preemptions),
            "dpserve.finish_reason": reason.name.lower() if reason is not None else "none",
        }, events=[("preempted", self._ns(t), {}) for t in self.preemptions])
        record_span("queue", engine, self._ns(arrival),
                    self._ns(scheduled if scheduled is not None else now))
        if scheduled is None:
            return
        chunk = [("chunk" if t <= prefilled else "recompute_chunk", self._ns(t),
                  {"dpserve.start": start, "dpserve.tokens": size})
                 for t, start, size in self.chunks]
        record_span("prefill", engine, self._ns(scheduled), self._ns(prefilled),
                    {"dpserve.chunks": sum(name == "chunk" for name, _, _ in chunk)},
                    events=[c for c in chunk if c[0] == "chunk"])
        if first is not None:
            record_span("decode", engine, self._ns(first), self._ns(now),
                        events=[c for c in chunk if c[0] != "chunk"])
