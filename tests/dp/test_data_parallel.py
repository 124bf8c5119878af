"""Data parallel over real processes: `dpserve serve --data-parallel-size 2` (one
API server, two engines, the DP coordinator) hit over HTTP: load spread by the
coordinator's counts, results equal to one offline engine, rank pinning with
`X-data-parallel-rank`, and a SIGTERM or Ctrl-C that leaves no process behind; then the
front-end's placement against a scripted coordinator."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from helpers import (
    all_gone,
    complete_all,
    descendants,
    finished_by_engine,
    offline_greedy_texts,
    output,
    process_names,
    serve_all,
    stopping,
)

from dpserve import SamplingParams
from dpserve.frontend.engine_client import AsyncEngineClient
from dpserve.launch.addresses import AddressAllocator
from dpserve.protocol import CoordinatorUpdate, EngineCoreRequest

pytestmark = pytest.mark.procs

PROMPTS = ["Hello world", "Once upon a time", "def add(x, y):", "The quick brown fox",
           "1 2 3 4"]


DP_ARGS = ("--data-parallel-size", "2", "--threads-per-engine", "1", "--max-model-len", "256")


@pytest.fixture(scope="module")
def servers(tiny_llama):
    """Three servers started at once (their start-ups overlap): one the tests share,
    one for each signal test (which stops it). Each leads a process group of its own,
    as a shell's foreground job."""
    with serve_all(*[[str(tiny_llama), *DP_ARGS]] * 3, new_session=True) as servers:
        yield dict(zip(("shared", "SIGTERM", "Ctrl-C"), servers))


@pytest.fixture(scope="module")
def dp_server(servers, tiny_llama):
    proc, url = servers["shared"]
    return proc, url, str(tiny_llama), descendants(proc.pid)


def test_load_is_spread_over_both_engines(dp_server):
    _, url, model, _ = dp_server
    before = finished_by_engine(url)
    prompts = [f"Once upon a time {i}" for i in range(200)]
    asyncio.run(complete_all(url, model, prompts, max_tokens=4))
    after = finished_by_engine(url)
    served = {e: after.get(e, 0) - before.get(e, 0) for e in (0, 1)}
    assert sum(served.values()) == 200
    assert all(n > 200 / 3 for n in served.values()), served


def test_each_engine_is_bound_to_a_core_of_its_own(dp_server):
    """--cpu-bind auto: two engines of one thread each, on a machine of two cores:
    engine r on the r-th core (unbound elsewhere: their threads leave cores free,
    or there is one core)."""
    _, _, _, children = dp_server
    allowed = sorted(os.sched_getaffinity(0))
    engines = {p.name(): p.cpu_affinity() for p in children
               if p.name().startswith("dpserve::EngineCore_")}
    two_cores = len(allowed) == 2
    assert engines == {f"dpserve::EngineCore_{r}": [allowed[r]] if two_cores else allowed
                       for r in (0, 1)}


def test_greedy_results_equal_one_offline_engine(dp_server):
    _, url, model, _ = dp_server
    expected = offline_greedy_texts(model, PROMPTS, max_tokens=8)
    for rank in (None, 0, 1):
        got = asyncio.run(complete_all(url, model, PROMPTS, max_tokens=8, rank=rank))
        assert got == expected, f"rank {rank}"


def test_rank_header_pins_the_engine(dp_server):
    _, url, model, _ = dp_server
    before = finished_by_engine(url)
    asyncio.run(complete_all(url, model, [f"pinned {i}" for i in range(12)], max_tokens=2,
                              rank=1))
    after = finished_by_engine(url)
    assert after.get(1, 0) - before.get(1, 0) == 12
    assert after.get(0, 0) == before.get(0, 0)


@pytest.mark.parametrize("value", ["2", "-1", "one"])
def test_bad_rank_header_is_a_400(dp_server, value):
    _, url, model, _ = dp_server
    for route, body in (("/v1/completions", {"prompt": "Hi"}),
                        ("/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "Hi"}]})):
        resp = httpx.post(url + route, headers={"X-data-parallel-rank": value}, timeout=10,
                          json={"model": model, "max_tokens": 2, "stream": True, **body})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert "rank" in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_a_signal_stops_every_process(servers, how):
    # A server of its own (stopping the shared one would break the tests after it).
    # Ctrl-C: a terminal sends SIGINT to the whole foreground process group, so the
    # server runs as a group leader and the group gets a real SIGINT.
    with stopping(servers[how]) as (proc, url):
        children = descendants(proc.pid)
        assert {"EngineCore_0", "EngineCore_1", "DPCoordinator"} <= process_names(children)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        if how == "SIGTERM":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0, output(proc)[-3000:]  # drained (nothing in flight)
        assert all_gone(children, timeout=10), [p for p in children if p.is_running()]
        assert "Traceback" not in output(proc), output(proc)[-3000:]


def test_client_places_by_the_coordinators_counts():
    """The front-end's choice, against a scripted coordinator publish socket."""

    async def run() -> None:
        alloc = AddressAllocator()
        ctx = zmq.asyncio.Context()
        front = ctx.socket(zmq.XPUB)
        front.setsockopt(zmq.XPUB_VERBOSE, 1)  # as the coordinator: every subscription
        front_address = alloc.new_address("coord-front")
        front.bind(front_address)
        addrs = alloc.engine_addresses(num_clients=1)
        clients = [AsyncEngineClient(addrs.inputs[0], addrs.outputs[0], engine_ranks=(0, 1),
                                     client_index=0, coordinator_address=front_address)]
        other = alloc.engine_addresses(num_clients=1)
        clients.append(AsyncEngineClient(other.inputs[0], other.outputs[0],
                                         engine_ranks=(0, 1), client_index=1,
                                         coordinator_address=front_address))
        try:
            for _ in clients:
                assert await asyncio.wait_for(front.recv(), 5) == b"\x01"  # subscribed

            def choose(client: AsyncEngineClient, rank: int | None = None) -> int:
                request = EngineCoreRequest("r", [1], SamplingParams(),
                                            data_parallel_rank=rank)
                return client.table.choose(request).rank

            async def publish(counts: list[list[int]]) -> None:
                await front.send(msgspec.msgpack.encode(CoordinatorUpdate(counts, 0, False)))
                for _ in range(1000):  # 10 s
                    await asyncio.sleep(0.01)
                    if all([[e.waiting, e.running] for e in c.engines.values()] == counts
                           for c in clients):
                        return
                raise AssertionError("the clients did not take the publish")

            # No figures yet: ties go to the client's own index.
            assert [choose(c) for c in clients] == [0, 1]
            await publish([[2, 0], [0, 3]])  # scores 8 and 3
            assert [choose(c) for c in clients] == [1, 1]
            clients[0].engines[1].sent_since_publish = 2  # sent since: 4*2 + 3 = 11 > 8
            assert choose(clients[0]) == 0
            await publish([[2, 0], [0, 3]])  # a publish resets what was sent since
            assert clients[0].engines[1].sent_since_publish == 0 and choose(clients[0]) == 1
            assert choose(clients[0], rank=0) == 0  # a pinned rank wins
            with pytest.raises(ValueError, match="out of range"):
                choose(clients[0], rank=2)
            # Round-robin ignores the counts: in turn, from the client's own index.
            for c in clients:
                c.router.policy = "round-robin"
            assert [choose(clients[1]) for _ in range(4)] == [1, 0, 1, 0]
            assert [choose(clients[0]) for _ in range(3)] == [0, 1, 0]
        finally:
            for c in clients:
                await c.aclose()
            ctx.destroy(linger=0)
            alloc.cleanup()

    asyncio.run(run())


def test_a_request_sent_to_a_rank_just_gone_is_placed_on_another():
    """Scripted engines (real DEALER sockets) register with a real front-end client;
    rank 1's socket closes (the fault: its process died, no news yet). The router
    still picks rank 1; the send finds it unreachable, marks it dead and the request
    goes to rank 0 instead of failing; a request pinned to rank 1 gets a 503-class
    error naming it."""
    from dpserve.frontend.errors import EngineUnavailableError
    from dpserve.protocol import RequestType, engine_identity

    async def run() -> None:
        alloc = AddressAllocator()
        ctx = zmq.asyncio.Context()
        addrs = alloc.engine_addresses(num_clients=1)
        client = AsyncEngineClient(addrs.inputs[0], addrs.outputs[0], engine_ranks=(0, 1))
        monitor = client._sockets.input.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        engines = []
        try:
            for rank in (0, 1):
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.IDENTITY, engine_identity(rank))
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(addrs.inputs[0])
                await dealer.send(b"")  # registration
                engines.append(dealer)
            def both() -> bool:
                return all(e.registered for e in client.engines.values())

            await client._sockets.wait_for(both, asyncio.Event(), 5)
            assert both()
            await client.add_request(EngineCoreRequest("busy", [1], SamplingParams(),
                                                       data_parallel_rank=0))
            assert (await asyncio.wait_for(engines[0].recv_multipart(), 5))[0] == \
                RequestType.ADD.value
            request = EngineCoreRequest("r", [1, 2, 3], SamplingParams())
            assert client.table.choose(request).rank == 1  # the premise: rank 1 is next
            engines[1].close()  # the fault
            assert (await asyncio.wait_for(monitor.recv_multipart(), 5))  # seen as gone
            await client.add_request(request)
            frames = await asyncio.wait_for(engines[0].recv_multipart(), 5)
            assert frames[0] == RequestType.ADD.value
            assert client.book.flights["r"].rank == 0
            assert not client.engines[1].serving  # the send found it gone
            assert "unreachable" in client.engines[1].status.reason
            with pytest.raises(EngineUnavailableError, match="data_parallel_rank 1 is dead"):
                await client.add_request(EngineCoreRequest("p", [1], SamplingParams(),
                                                           data_parallel_rank=1))
        finally:
            monitor.close(linger=0)
            await client.aclose()
            for dealer in engines:
                dealer.close(linger=0)
            ctx.destroy(linger=0)
            alloc.cleanup()

    asyncio.run(run())
