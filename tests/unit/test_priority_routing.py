"""The balancer with priorities (`dpserve.frontend.routing`, pure logic over named fake
engine states): a request's load counts only the waiting requests of its priority or
more urgent, by each rank's `SchedulerStats.waiting_by_priority`."""

from __future__ import annotations

import pytest
from fakes import engines

from dpserve import SamplingParams
from dpserve.frontend.routing import Router, less_urgent_waiting
from dpserve.protocol import EngineCoreRequest, SchedulerStats


def stats(by_priority: list[list[int]]) -> SchedulerStats:
    return SchedulerStats(num_waiting=sum(n for _, n in by_priority), num_running=0,
                          kv_cache_usage=0.0, prefix_cache_queries=0, prefix_cache_hits=0,
                          num_preemptions=0, num_free_blocks=100,
                          waiting_by_priority=by_priority)


def request(priority: int) -> EngineCoreRequest:
    return EngineCoreRequest("r", [1, 2, 3], SamplingParams(), priority=priority)


def test_less_urgent_waiting_counts_the_priorities_after_the_requests():
    figures = stats([[-5, 1], [0, 2], [10, 8]])
    assert [less_urgent_waiting(figures, p) for p in (-10, -5, 0, 9, 10)] == [11, 10, 8, 8, 0]
    assert less_urgent_waiting(stats([]), 0) == 0 and less_urgent_waiting(None, 0) == 0


@pytest.mark.parametrize("policy", ["least-loaded", "cache-aware"])
@pytest.mark.parametrize("balanced", [True, False])
def test_an_urgent_request_goes_where_fewer_urgent_requests_wait(policy, balanced):
    live = engines(2)
    # Rank 0: 8 low-priority requests waiting, 2 running. Rank 1: 3 urgent ones waiting.
    live[0].waiting, live[0].running, live[0].num_requests = 8, 2, 10
    live[0].stats = stats([[10, 8]])
    live[1].waiting, live[1].num_requests = 3, 3
    live[1].stats = stats([[-10, 3]])
    router = Router(policy)
    assert router.choose(live, request(-10), balanced=balanced) is live[0]
    assert router.choose(live, request(10), balanced=balanced) is live[1]  # all count
    assert router.choose(live, request(0), balanced=balanced) is live[0]


def test_without_priorities_the_load_is_unchanged():
    live = engines(2)
    live[0].waiting, live[1].running = 1, 3  # 4 vs 3
    live[0].stats = live[1].stats = stats([])
    assert Router().choose(live, request(0), balanced=True) is live[1]
    assert Router().choose(live, request(-3), balanced=True) is live[1]
