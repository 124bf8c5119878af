"""CPU tests of `--scheduling-policy`: priorities, tenant fairness (deficit round robin)
and priority preemption, with the real Scheduler and KVCacheManager driven by hand-made
model outputs (as tests/engine/test_scheduler.py)."""

from __future__ import annotations

import functools
import random
from collections import Counter

import pytest
from test_scheduler import BS, Driver, check_all_free, shape, step

from dpserve.config import CacheConfig, ConfigError, EngineArgs, SchedulerConfig
from dpserve.engine.request import Request, RequestStatus
from dpserve.engine.scheduler import Scheduler
from dpserve.engine.waiting_queue import DRR_QUANTUM, WaitingQueue
from dpserve.sampling_params import SamplingParams


def make_scheduler(policy: str = "priority", num_blocks: int = 64, budget: int = 64,
                   max_seqs: int = 8, max_model_len: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                        max_model_len=max_model_len, policy=policy),
        CacheConfig(block_size=BS, kv_cache_memory=None, gpu_memory_utilization=0.9,
                    enable_prefix_caching=False, num_kv_blocks=num_blocks),
        num_blocks)


def req(req_id: str, prompt: int = 4, priority: int = 0, tenant: str | None = None,
        max_tokens: int = 8) -> Request:
    # Distinct tokens per request: no prefix sharing between them.
    base = 1000 * (1 + sum(map(ord, req_id)))
    return Request(req_id, [base + i for i in range(prompt)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=None,
                   priority=priority, tenant=tenant)


def admitted(sched: Scheduler) -> list[str]:
    """Ids of the requests that start (their first chunk) in the next step."""
    out, _ = step(sched)
    return [s.req_id for s in out.scheduled if s.start == 0]


def run_all(sched: Scheduler) -> list[str]:
    """Step until every request finished; the ids in the order they first ran."""
    order: list[str] = []
    for _ in range(10_000):
        if not sched.has_unfinished_requests():
            break
        order += [r for r in admitted(sched) if r not in order]
    check_all_free(sched)
    return order


# ---- order ------------------------------------------------------------------------

def test_lower_priority_runs_first_then_arrival():
    sched = make_scheduler(max_seqs=1)
    for name, priority in [("late", 5), ("a", 0), ("urgent", -3), ("b", 0), ("later", 5)]:
        sched.add_request(req(name, priority=priority, max_tokens=2))
    assert run_all(sched) == ["urgent", "a", "b", "late", "later"]


def test_fcfs_ignores_priorities():
    sched = make_scheduler("fcfs", max_seqs=1)
    for name, priority in [("late", 5), ("a", 0), ("urgent", -3)]:
        sched.add_request(req(name, priority=priority, max_tokens=2))
    assert run_all(sched) == ["late", "a", "urgent"]
    assert sched.make_stats().waiting_by_priority == []


def test_waiting_counts_by_priority_only_when_some_is_not_zero():
    sched = make_scheduler(max_seqs=1)
    sched.add_request(req("a"))
    sched.add_request(req("b"))
    assert sched.make_stats().waiting_by_priority == []  # nothing new on the wire
    sched.add_request(req("c", priority=5))
    sched.add_request(req("d", priority=-1))
    assert sched.make_stats().waiting_by_priority == [[-1, 1], [0, 2], [5, 1]]
    step(sched)  # d runs (max_num_seqs 1)
    assert sched.make_stats().waiting_by_priority == [[0, 2], [5, 1]]
    sched.finish_requests(["c"])
    assert sched.make_stats().waiting_by_priority == []


def test_the_policy_option_is_checked():
    with pytest.raises(ConfigError, match="scheduling_policy must be one of priority, fcfs"):
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=1, max_model_len=8,
                        policy="lifo")
    assert EngineArgs().scheduling_policy == "priority"


# ---- tenants ----------------------------------------------------------------------

def shares(policy: str) -> Counter:
    """Output tokens per tenant while both are backlogged: tenant `burst` adds three
    requests for each one of tenant `steady`, every step."""
    sched = make_scheduler(policy, num_blocks=256, max_seqs=4)
    tokens: Counter = Counter()
    for i in range(120):
        for j in range(3):
            sched.add_request(req(f"burst-{i}-{j}", tenant="burst"))
        sched.add_request(req(f"steady-{i}", tenant="steady"))
        if i < 20:  # both queues fill up first
            step(sched)
            continue
        waiting = Counter(r.tenant for r in sched.waiting)
        assert waiting["burst"] > 0 and waiting["steady"] > 0  # both backlogged
        _, deltas = step(sched)
        tokens.update(d.request_id.split("-")[0] for d in deltas if d.new_token_ids)
    return tokens


def test_deficit_round_robin_gives_a_bursting_tenant_an_equal_share():
    fair = shares("priority")
    assert abs(fair["burst"] - fair["steady"]) <= 0.2 * max(fair.values()), fair
    fcfs = shares("fcfs")  # the same load in arrival order: 3 to 1
    assert fcfs["burst"] > 2 * fcfs["steady"], fcfs


def test_drr_shares_tokens_not_requests():
    """A tenant whose requests cost twice as much (prompt + max_tokens) gets half as
    many admitted: equal tokens."""
    queue = WaitingQueue(fair=True, max_model_len=4096)
    for i in range(200):
        queue.add(req(f"big-{i}", prompt=100, max_tokens=300, tenant="big"))
        queue.add(req(f"small-{i}", prompt=100, max_tokens=100, tenant="small"))
    cost: Counter = Counter()
    for _ in range(150):
        r = queue.peek()
        assert r is not None and queue.peek() is r  # peeking again: the same one
        queue.pop(r)
        cost[r.tenant] += r.num_prompt_tokens + r.sampling_params.max_tokens
    assert abs(cost["big"] - cost["small"]) <= 400 + DRR_QUANTUM, cost
    assert len(queue) == 250


def test_a_preempted_request_keeps_its_place_and_is_not_charged_again():
    queue = WaitingQueue(fair=True, max_model_len=4096)
    for i in range(3):
        queue.add(req(f"a{i}", tenant="a"))
        queue.add(req(f"b{i}", tenant="b"))
    first = queue.peek()
    queue.pop(first)
    first.scheduled_at, first.num_preemptions = 1.0, 1  # it ran, then was preempted
    queue.push_front(first)
    order = []
    while (r := queue.peek()) is not None:
        queue.pop(r)
        order.append(r.request_id)
    tenant = first.tenant
    mine = [x for x in order if x.startswith(tenant)]
    assert mine[0] == first.request_id  # the front of its own tenant's queue
    # Not charged again: the tenants still alternate one for one afterwards.
    assert Counter(x[0] for x in order[:4]) == Counter({"a": 2, "b": 2}), order


# ---- preemption -------------------------------------------------------------------

def grow_until_preempted(policy: str) -> tuple[list[str], list[str]]:
    """Three requests admitted together (priorities 0, 5, 1) grow until the pool runs
    out; (the running order, the first preempted ids)."""
    sched = make_scheduler(policy, num_blocks=7, max_model_len=28)
    sched.add_request(req("a", priority=0, max_tokens=20))
    sched.add_request(req("b", priority=5, max_tokens=20))
    sched.add_request(req("c", priority=1, max_tokens=20))
    running_order = []
    for _ in range(20):
        out, _ = step(sched)
        running_order = running_order or [r.request_id for r in sched.running]
        if out.preempted_req_ids:
            assert all(sched.requests[r].status == RequestStatus.PREEMPTED
                       for r in out.preempted_req_ids)
            return running_order, out.preempted_req_ids
    raise AssertionError("nothing was preempted")


def test_blocks_running_out_preempt_the_lowest_priority():
    order, preempted = grow_until_preempted("priority")
    assert order == ["a", "c", "b"] and preempted == ["b"]
    order, preempted = grow_until_preempted("fcfs")  # the last admitted
    assert order == ["a", "b", "c"] and preempted == ["c"]


def test_an_urgent_waiting_request_preempts_less_urgent_running_ones_for_a_slot():
    sched = make_scheduler(max_seqs=2)
    sched.add_request(req("low1", priority=10, max_tokens=30))
    sched.add_request(req("low2", priority=10, max_tokens=30))
    step(sched)
    sched.add_request(req("same", priority=10))  # as urgent: waits for a slot
    out, _ = step(sched)
    assert not out.preempted_req_ids and [r.request_id for r in sched.running] == [
        "low1", "low2"]
    sched.add_request(req("urgent", priority=-10))
    out, _ = step(sched)
    assert out.preempted_req_ids == ["low2"]  # the latest admitted of the least urgent
    assert ("urgent", 0, 4) in shape(out) and [r.request_id for r in sched.running] == [
        "urgent", "low1"]
    assert sched.requests["low2"].status == RequestStatus.PREEMPTED
    run_all(sched)


def test_an_urgent_waiting_request_preempts_for_blocks_and_fcfs_does_not():
    for policy in ("priority", "fcfs"):
        # 6 blocks: after 4 steps two low requests of 8 tokens have 11 computed each,
        # in 3 blocks each, and their next token still fits the third.
        sched = make_scheduler(policy, num_blocks=6, max_model_len=24)
        sched.add_request(req("low1", prompt=8, priority=10, max_tokens=16))
        sched.add_request(req("low2", prompt=8, priority=10, max_tokens=16))
        for _ in range(4):
            step(sched)
        assert sched.kv_cache.num_free_blocks == 0
        sched.add_request(req("urgent", prompt=8, priority=-10, max_tokens=2))
        out, _ = step(sched)
        if policy == "priority":
            assert out.preempted_req_ids == ["low2"] and ("urgent", 0, 8) in shape(out)
        else:
            assert out.preempted_req_ids == [] and "urgent" not in [s[0] for s in
                                                                    shape(out)]
        run_all(sched)


def test_equal_priorities_behave_as_fcfs():
    """With every priority 0 and one tenant, both policies schedule the same steps."""
    runs = []
    for policy in ("priority", "fcfs"):
        rng = random.Random(7)
        sched = make_scheduler(policy, num_blocks=10, budget=12, max_seqs=3,
                               max_model_len=24)
        shapes = []
        for i in range(60):
            if rng.random() < 0.4:
                sched.add_request(req(f"r{i}", prompt=rng.randint(1, 10),
                                      max_tokens=rng.randint(1, 8)))
            out, _ = step(sched)
            shapes.append((shape(out), out.preempted_req_ids))
        runs.append(shapes)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("first_seed", [0, 100])
def test_seeded_random_runs_with_priorities_and_tenants_drain_clean(first_seed):
    """tests/engine/test_scheduler.py's random walk (blocks, KV reads, deltas checked every
    step) with random priorities and tenants."""
    for seed in range(first_seed, first_seed + 100):
        rng = random.Random(seed)
        driver = Driver(rng.randint(2, 10), rng.randint(1, 12), rng.randint(1, 4),
                        prefix_caching=rng.random() < 0.8)
        for _ in range(40):
            move = rng.random()
            if move < 0.35:
                driver.add([rng.randint(0, 1) for _ in range(rng.randint(1, 12))],
                           rng.randint(1, 8))
                added = driver.requests[f"r{len(driver.requests) - 1}"]
                # Re-queued with tags (the driver queued it untagged).
                driver.sched.waiting.pop(added, charge=False)
                added.priority = rng.choice([-1, 0, 0, 3])
                added.tenant = rng.choice([None, "a", "b"])
                driver.sched.waiting.add(added)
            elif move < 0.9 or not driver.requests:
                victim = (rng.choice(sorted(driver.requests))
                          if driver.requests and rng.random() < 0.1 else None)
                driver.step(functools.partial(rng.randint, 0, 4), victim)
                priorities = [driver.sched.waiting.priority(r) for r in driver.sched.running]
                assert priorities == sorted(priorities)
            else:
                driver.abort(rng.choice(sorted(driver.requests)))
        driver.drain()
