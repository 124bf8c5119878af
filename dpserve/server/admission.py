"""Admission: the check `OpenAIServing` runs before a request is sent to an engine.

503 while paused or asleep (code "server_paused" / "server_sleeping",
Retry-After); 429 when every serving rank's queue is at
`--max-num-queued-requests` or `--max-num-queued-tokens` (code
"too_many_requests", Retry-After). Nothing is sent to an engine then, so no DP
wave starts. The figures are the engines' `ClusterView`'s (`queued()`: with a
DP coordinator its counts plus what this API server sent since; without one,
what this API server has in flight, past `max_num_seqs` running).

Not here: the pause / sleep routes (`dpserve.server.ops.control`).
"""

from __future__ import annotations

from dpserve.frontend.cluster import ClusterView
from dpserve.server.errors import APIError

RETRY_AFTER_S = 1  # the Retry-After of a 503 (paused, asleep) or a 429 (queues full)


class Admission:
    """The check before a request is sent (module docstring); `max_num_seqs` is how
    many requests an engine runs at once (without a coordinator, what is in flight
    past it counts as waiting)."""

    def __init__(self, cluster: ClusterView, max_num_queued_requests: int | None = None,
                 max_num_queued_tokens: int | None = None, max_num_seqs: int = 0) -> None:
        self.cluster = cluster
        self.max_requests = max_num_queued_requests
        self.max_tokens = max_num_queued_tokens
        self.max_num_seqs = max_num_seqs
        self.rejected = 0  # 429s answered

    def __call__(self, prompt_lens: list[int]) -> None:
        state = self.cluster.control
        if state.sleep_level > 0:
            raise _unavailable("the server is asleep (POST /wake_up); retry later",
                               "server_sleeping")
        if state.paused is not None:
            raise _unavailable("the server is paused (POST /resume); retry later",
                               "server_paused")
        if (self.max_requests or self.max_tokens) and self._all_full():
            self.rejected += 1
            raise APIError(429, "every engine's queue is full (--max-num-queued-requests "
                           "/ --max-num-queued-tokens); retry later", type="server_error",
                           code="too_many_requests",
                           headers={"Retry-After": str(RETRY_AFTER_S)})

    def _all_full(self) -> bool:
        queues = self.cluster.queued()
        if not queues:
            return False  # no serving rank: the engine client answers that (503)
        return all(self._full(requests, tokens) for requests, tokens in queues)

    def _full(self, requests: int, tokens: int) -> bool:
        if not self.cluster.has_coordinator:
            requests = max(0, requests - self.max_num_seqs)
        return bool((self.max_requests and requests >= self.max_requests)
                    or (self.max_tokens and tokens >= self.max_tokens))


def _unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, type="server_error", code=code,
                    headers={"Retry-After": str(RETRY_AFTER_S)})
