"""Cache-aware routers sharing what they placed (`--api-server-count N`): the engine
client's side, over real sockets (placement only, no engines).

* With one API server (`share_prefixes=False`) nothing but the subscription goes to
  the coordinator, however many prompts are placed; with several, the placements
  go out batched as `PrefixFacts` (the receiving end is a named fake coordinator: an
  XPUB bound in this test).
* Two clients (client indexes 0 and 1) through a real DP coordinator: a prefix that
  client 0 placed is placed on the same rank by client 1, which on its own would
  have chosen another (new prefixes start from each client's own index).
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
from fakes import BS, engines, prompt, request
from helpers import ScriptedEngines

from dpserve.frontend.engine_client import AsyncEngineClient
from dpserve.frontend.prefix_record import PrefixOutbox
from dpserve.frontend.routing import Router
from dpserve.launch.addresses import AddressAllocator
from dpserve.protocol import PrefixFacts

pytestmark = [pytest.mark.timeout(120)]


def test_the_outbox_batches_refreshes_and_drops_the_oldest_beyond_its_cap():
    woken = []
    outbox = PrefixOutbox(capacity=4, on_pending=lambda: woken.append(1))
    outbox.note(0, [b"a", b"b"])
    outbox.note(1, [b"c"])
    outbox.note(0, [b"a"])  # a repeat refreshes it
    assert woken == [1]  # once, when it stopped being empty
    assert outbox.take(3) == PrefixFacts(3, [0, 1, 0], [[b"b"], [b"c"], [b"a"]])
    assert outbox.take(3) is None
    outbox.note(1, [b"1", b"2", b"3", b"4", b"5", b"6"])
    assert outbox.take(3) == PrefixFacts(3, [1], [[b"3", b"4", b"5", b"6"]])
    assert outbox.dropped == 2 and woken == [1, 1]


def test_a_router_learns_other_api_servers_placements_not_its_own():
    live = engines(2)
    router = Router("cache-aware", client_index=1, block_size=BS)
    chain = router.tracker.hashes(prompt(1, 0))
    router.learn(PrefixFacts(1, [0], [chain]), live)  # its own, relayed back: skipped
    assert router.learnt == 0 and router.tracker.size(0) == 0
    router.learn(PrefixFacts(0, [0, 5], [chain, chain]), live)  # rank 5: not here
    assert router.learnt == len(chain)
    # Without the facts it would start the prefix from its own index, rank 1.
    assert router.choose(live, request(prompt(1, 1)), balanced=True).rank == 0
    plain = Router("least-loaded", client_index=1, block_size=BS)
    plain.learn(PrefixFacts(0, [0], [chain]), live)  # count-only: keeps no record
    assert plain.learnt == 0


def _recv(sock: zmq.Socket, timeout: float) -> bytes | None:
    return sock.recv() if sock.poll(int(timeout * 1000)) else None


@pytest.mark.parametrize("share", [False, True])
def test_only_several_api_servers_send_their_placements(ctx, share):
    """The fake coordinator: an XPUB that only records what comes in."""
    alloc = AddressAllocator()
    fake = ctx.socket(zmq.XPUB)
    fake.setsockopt(zmq.LINGER, 0)
    address = f"tcp://127.0.0.1:{fake.bind_to_random_port('tcp://127.0.0.1')}"

    async def run() -> list[bytes]:
        addrs = alloc.engine_addresses(num_clients=1)
        client = AsyncEngineClient(addrs.inputs[0], addrs.outputs[0], engine_ranks=(0, 1),
                                   load_balance="cache-aware", block_size=BS,
                                   coordinator_address=address, share_prefixes=share)
        try:
            got = []
            first = await asyncio.to_thread(_recv, fake, 10.0)
            assert first == b"\x01"  # the subscription
            for session in range(3):
                client.table.choose(request(prompt(session, 0)))
            while (body := await asyncio.to_thread(_recv, fake, 1.0)) is not None:
                got.append(body)
            return got
        finally:
            await client.aclose()
            alloc.cleanup()

    got = asyncio.run(run())
    if not share:
        assert got == []
        return
    facts = [msgspec.msgpack.decode(body, type=PrefixFacts) for body in got]
    placed = [(rank, h) for f in facts for rank, run in zip(f.ranks, f.blocks) for h in run]
    assert len(placed) == 3 * 6 and len(facts) <= 3  # every block; batched
    assert {rank for rank, _ in placed} == {0, 1}  # new prefixes spread


async def _until(check, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        await asyncio.sleep(0.01)


@pytest.mark.procs
def test_a_prefix_placed_through_one_client_is_placed_alike_by_another(make_coordinator,
                                                                       ctx):
    coord = make_coordinator(2)
    ScriptedEngines(ctx, coord, 2).wait_ready()
    alloc = AddressAllocator()

    async def run() -> tuple[int, int, int]:
        """(client 0's rank, client 1's for a follow-up, client 1's without the facts)"""
        addrs = alloc.engine_addresses(num_clients=2)
        clients = [AsyncEngineClient(addrs.inputs[i], addrs.outputs[i], engine_ranks=(0, 1),
                                     client_index=i, load_balance="cache-aware",
                                     block_size=BS, share_prefixes=True,
                                     coordinator_address=coord.front_publish_address)
                   for i in range(2)]
        try:
            await _until(lambda: all(c.news.info_updates for c in clients), "subscribed")
            first = clients[0].table.choose(request(prompt(7, 0))).rank
            await _until(lambda: clients[1].router.learnt, "client 1 heard of the prefix")
            follow_up = clients[1].table.choose(request(prompt(7, 1))).rank
            unshared = Router("cache-aware", client_index=1, block_size=BS)
            alone = unshared.choose(list(clients[1].engines.values()), request(prompt(7, 1)),
                                    balanced=True).rank
            return first, follow_up, alone
        finally:
            for client in clients:
                await client.aclose()
            alloc.cleanup()

    first, follow_up, alone = asyncio.run(run())
    assert (first, follow_up) == (0, 0)
    assert alone == 1  # premise: on its own, client 1 would start it on rank 1
