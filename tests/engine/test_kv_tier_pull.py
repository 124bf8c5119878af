"""KV blocks pulled between two hosts' stores (`dpserve.kv_tier.pull`), over real
store processes on two loopback "hosts" (127.0.0.1 is the source, 127.0.0.2 the
destination; Linux routes all of 127/8 to loopback), with and without the
data-plane secret.

A pull copies exactly the source's bytes, block by block, and stops at the first
block the source lacks; a source SIGKILLed or SIGSTOPped in the middle of a pull,
or a stopped destination, ends it by its timeout with no pin or reservation left
on either store; a caller or a store without the secret gets nothing; another
layout is refused. Then the pull's point: an engine on the other host loads the
pulled blocks and generates the same greedy tokens; and a front-end of a head +
headless server knows each rank's store address from its heartbeats.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import signal
import time
from collections.abc import Iterator

import msgspec
import psutil
import pytest
import zmq
from helpers import descendants, dp_args, free_port, start_background, stop, wait_until

from dpserve.block_hash import hash_block, root_hash
from dpserve.config import EngineArgs
from dpserve.engine.core import EngineCore
from dpserve.frontend.engine_client import AsyncEngineClient
from dpserve.kv_tier.arena import leftover_arenas, map_arena
from dpserve.kv_tier.client import KVTierClient
from dpserve.kv_tier.layout import TierLayout
from dpserve.kv_tier.messages import Call, Hello, Reply
from dpserve.kv_tier.pull import pull
from dpserve.kv_tier.transfer import HEADROOM_BYTES, chunk_blocks
from dpserve.launch.addresses import AddressAllocator
from dpserve.launch.host import launch_engines
from dpserve.launch.kv_store import KVStore
from dpserve.protocol import EngineCoreRequest
from dpserve.sampling_params import SamplingParams
from dpserve.security import MAX_FRAME_BYTES, secure

pytestmark = pytest.mark.procs

LAYOUT = TierLayout.for_model(model="tiny", dtype="float32", element_bytes=4, block_size=4,
                              num_layers=2, kv_heads_per_worker=2, head_dim=8, tp_size=2)
OTHER = TierLayout.for_model(model="other", dtype="float32", element_bytes=4, block_size=4,
                             num_layers=2, kv_heads_per_worker=2, head_dim=8, tp_size=2)
SLOTS = 64
SECRET = "the right secret, long enough to be accepted"
WRONG = "a wrong secret, long enough to be accepted too"
HANG_S = 30.0  # a pull that has not returned after this long has hung


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def block(i: int, size: int = LAYOUT.slot_bytes) -> bytes:
    """Block i's bytes: distinct in every block and position."""
    return (i.to_bytes(4, "little") + bytes(range(256)) * 2)[: size].ljust(size, bytes([i]))


@dataclasses.dataclass
class Host:
    """A store and its tcp:// endpoint, as a launcher on that host starts it."""

    kv: KVStore
    allocator: AddressAllocator

    @property
    def tcp(self) -> str:
        assert self.kv.remote_address is not None
        return self.kv.remote_address


@pytest.fixture
def hosts(request) -> Iterator[tuple[Host, Host]]:
    """(source on 127.0.0.1, destination on 127.0.0.2); the param: (source secret,
    destination secret), default none."""
    secrets = getattr(request, "param", (None, None))
    started = []
    try:
        for ip, secret, slots in (("127.0.0.1", secrets[0], SLOTS),
                                  ("127.0.0.2", secrets[1], SLOTS)):
            allocator = AddressAllocator()
            kv = KVStore(slots * LAYOUT.slot_bytes, allocator, secret=secret, remote_host=ip)
            started.append(Host(kv, allocator))
            kv.start()
        yield started[0], started[1]
    finally:
        for host in started:
            host.kv.close()
            host.allocator.cleanup()
    assert leftover_arenas(os.getpid()) == []


def client(host: Host, name: str, layout: TierLayout = LAYOUT) -> KVTierClient:
    return KVTierClient(host.kv.address, layout, name=name, secret=host.kv.secret,
                        timeout_s=2.0)


def fill(host: Host, blocks: dict[int, bytes], layout: TierLayout = LAYOUT) -> None:
    """Write and commit `blocks` (i -> bytes of h(i)) into `host`'s store."""
    writer = client(host, f"writer{time.monotonic_ns()}", layout)
    try:
        granted = writer.reserve([h(i) for i in blocks])
        assert len(granted) == len(blocks)
        arena = map_arena(writer.arena_name, writer.arena_bytes)
        for i, data in blocks.items():
            start = granted[h(i)] * layout.slot_bytes
            arena[start:start + layout.slot_bytes] = data
        writer.commit(list(granted))
        arena.close()
    finally:
        writer.close()


def held_bytes(host: Host, hashes: list[bytes], layout: TierLayout = LAYOUT) -> list[bytes]:
    """The bytes of the leading `hashes` the store holds (pinned while read)."""
    reader = client(host, f"reader{time.monotonic_ns()}", layout)
    try:
        slots = reader.lookup(hashes)
        arena = map_arena(reader.arena_name, reader.arena_bytes)
        size = layout.slot_bytes
        data = [arena[s * size:(s + 1) * size] for s in slots]
        reader.release(slots)
        arena.close()
        return data
    finally:
        reader.close()


def stats(host: Host, layout: TierLayout = LAYOUT) -> dict:
    probe = client(host, f"probe{time.monotonic_ns()}", layout)
    try:
        return probe.stats()
    finally:
        probe.close()


def run_pull(dst: Host, src: Host, hashes: list[bytes], *, secret: str | None = None,
             timeout: float = 10.0) -> int:
    return asyncio.run(asyncio.wait_for(
        pull(dst.tcp, src.tcp, hashes, secret=secret, timeout=timeout), HANG_S))


def assert_nothing_held(host: Host, layout: TierLayout = LAYOUT) -> None:
    s = stats(host, layout)
    assert (s["pinned"], s["writing"], s["pulls"]) == (0, 0, 0), s


# ---- the pull -------------------------------------------------------------------------

@pytest.mark.parametrize("hosts", [(None, None), (SECRET, SECRET)], indirect=True,
                         ids=["plain", "curve"])
def test_a_pull_copies_the_bytes_and_stops_where_the_source_ends(hosts) -> None:
    """The source holds blocks 0..29 but 21; the destination already holds 0 and 25.
    The destination reserves 1..24 (25 ends its run), fetches them in chunks of 8,
    gets 1..20 (the chunk of 17..24 comes back short), frees 21..24's slots."""
    src, dst = hosts
    fill(src, {i: block(i) for i in range(30) if i != 21})
    fill(dst, {0: block(0), 25: block(25)})
    hashes = [h(i) for i in range(30)]
    assert held_bytes(dst, hashes) == [block(0)]  # the premise: one leading block

    assert run_pull(dst, src, hashes, secret=src.kv.secret) == 21
    assert held_bytes(dst, hashes) == held_bytes(src, hashes) == [block(i) for i in range(21)]
    assert held_bytes(dst, [h(21)]) == [] and held_bytes(dst, [h(25)]) == [block(25)]
    dst_stats, src_stats = stats(dst), stats(src)
    assert (dst_stats["pulled"], src_stats["sent"]) == (20, 20)
    assert dst_stats["ready"] == 22 and src_stats["ready"] == 29
    assert_nothing_held(dst)
    assert_nothing_held(src)
    assert run_pull(dst, src, hashes, secret=src.kv.secret) == 21  # nothing new to fetch
    assert stats(dst)["pulled"] == 20


def test_blocks_bigger_than_a_chunk_still_fit_the_message_cap() -> None:
    """Blocks of 20 MiB: 3 a message (64 MiB is the cap), 4 blocks in 2 messages."""
    big = TierLayout(key="big", shard_bytes=20 << 20, num_shards=1)
    per = chunk_blocks(big.slot_bytes)
    assert per == 3 and per * big.slot_bytes + HEADROOM_BYTES <= MAX_FRAME_BYTES
    assert chunk_blocks(MAX_FRAME_BYTES) == 0  # such a block is refused, never sent
    hosts = []
    try:
        for ip in ("127.0.0.1", "127.0.0.2"):
            allocator = AddressAllocator()
            hosts.append(Host(KVStore(4 * big.slot_bytes, allocator, remote_host=ip),
                              allocator))
            hosts[-1].kv.start()
        src, dst = hosts
        data = {i: block(i, big.slot_bytes) for i in range(4)}
        fill(src, data, big)
        stats(dst, big)  # its first client fixes the layout
        hashes = [h(i) for i in range(4)]
        assert run_pull(dst, src, hashes) == 4
        assert held_bytes(dst, hashes, big) == list(data.values())
    finally:
        for host in hosts:
            host.kv.close()
            host.allocator.cleanup()


# ---- faults ---------------------------------------------------------------------------

async def _pull_with_a_fault(dst: Host, src: Host, hashes: list[bytes], fault: int,
                             timeout: float) -> int:
    """Start the pull with the source stopped; once the destination holds its
    reservations (the pull is in flight), deliver `fault` to the source."""
    os.kill(src.kv.proc.pid, signal.SIGSTOP)
    task = asyncio.create_task(pull(dst.tcp, src.tcp, hashes, secret=None, timeout=timeout))
    await asyncio.to_thread(wait_until, lambda: stats(dst)["writing"] > 0, 10,
                            "the destination's reservations")
    assert stats(dst)["pulls"] == 1 and not task.done()
    os.kill(src.kv.proc.pid, fault)
    return await asyncio.wait_for(task, HANG_S)


def test_a_killed_source_ends_the_pull_by_its_timeout_leaving_nothing_held(hosts) -> None:
    src, dst = hosts
    fill(src, {i: block(i) for i in range(20)})
    stats(dst)
    hashes = [h(i) for i in range(20)]
    assert asyncio.run(_pull_with_a_fault(dst, src, hashes, signal.SIGKILL, 3.0)) == 0
    src.kv.proc.join(5)
    assert src.kv.proc.exitcode == -signal.SIGKILL
    assert held_bytes(dst, hashes) == []
    assert_nothing_held(dst)
    assert stats(dst)["pulled"] == 0


def test_a_stopped_source_or_destination_ends_the_pull_leaving_nothing_held(hosts) -> None:
    src, dst = hosts
    fill(src, {i: block(i) for i in range(20)})
    stats(dst)
    hashes = [h(i) for i in range(20)]
    try:
        assert asyncio.run(_pull_with_a_fault(dst, src, hashes, signal.SIGSTOP, 2.0)) == 0
        assert_nothing_held(dst)
        assert held_bytes(dst, hashes) == []
    finally:
        os.kill(src.kv.proc.pid, signal.SIGCONT)
    # Continued, the source answers what it got meanwhile (to nobody): no pin stays.
    wait_until(lambda: stats(src)["pinned"] == 0, 10, "the source's pins gone")
    assert run_pull(dst, src, hashes) == 20  # and it serves the next pull
    assert held_bytes(dst, hashes) == [block(i) for i in range(20)]

    # A stopped destination: the caller's wait ends by its timeout (the pull never
    # reached it: no handshake); continued, it holds nothing for it and pulls again.
    more = [h(i) for i in range(20, 30)]
    fill(src, {i: block(i) for i in range(20, 30)})
    os.kill(dst.kv.proc.pid, signal.SIGSTOP)
    try:
        assert run_pull(dst, src, hashes + more, timeout=1.0) == 0
    finally:
        os.kill(dst.kv.proc.pid, signal.SIGCONT)
    assert_nothing_held(dst)
    assert run_pull(dst, src, hashes + more) == 30
    assert_nothing_held(dst)
    assert_nothing_held(src)


# ---- refusals -------------------------------------------------------------------------

@pytest.mark.parametrize("hosts", [(SECRET, SECRET)], indirect=True)
def test_without_the_secret_nothing_is_pulled(hosts) -> None:
    src, dst = hosts
    fill(src, {i: block(i) for i in range(4)})
    stats(dst)
    hashes = [h(i) for i in range(4)]
    assert run_pull(dst, src, hashes, secret=WRONG, timeout=1.0) == 0
    assert run_pull(dst, src, hashes, secret=None, timeout=1.0) == 0
    assert (stats(dst)["pulls"], stats(dst)["pulled"], stats(src)["sent"]) == (0, 0, 0)
    assert held_bytes(dst, hashes) == []
    assert run_pull(dst, src, hashes, secret=SECRET) == 4  # the premise: it can pull


@pytest.mark.parametrize("hosts", [(WRONG, SECRET)], indirect=True)
def test_a_store_cannot_fetch_from_a_store_of_another_secret(hosts) -> None:
    src, dst = hosts
    fill(src, {i: block(i) for i in range(4)})
    stats(dst)
    assert run_pull(dst, src, [h(i) for i in range(4)], secret=SECRET, timeout=1.5) == 0
    assert stats(src)["sent"] == 0
    assert_nothing_held(dst)


def test_another_layout_is_refused(hosts, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="dpserve.kv_tier.pull")
    src, dst = hosts
    fill(src, {i: block(i) for i in range(4)})
    hashes = [h(i) for i in range(4)]
    assert run_pull(dst, src, hashes) == 0  # no engine connected: no layout yet
    assert "holds no blocks yet" in caplog.text
    stats(dst, OTHER)  # the destination's engines run another model
    assert run_pull(dst, src, hashes) == 0
    assert "layout mismatch" in caplog.text and "'model=other" in caplog.text
    assert_nothing_held(dst, OTHER)
    assert (stats(dst, OTHER)["pulled"], stats(src)["sent"]) == (0, 0)


def test_the_tcp_endpoint_answers_pulls_only(hosts) -> None:
    """Another host cannot say hello (an arena it cannot map) nor reserve or commit."""
    src, _ = hosts
    with zmq.Context() as ctx:
        sock = secure(ctx.socket(zmq.DEALER), "client", None)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(src.tcp)
        sock.send(msgspec.msgpack.encode(Call(1, Hello(LAYOUT, "intruder", 1))))
        assert sock.poll(5000)
        reply = msgspec.msgpack.decode(sock.recv(), type=Reply)
        sock.close()
    assert reply.hello is None and "not answered on the tcp:// endpoint" in reply.error
    assert stats(src)["clients"] == 1  # the probe's own


# ---- engines on two hosts -------------------------------------------------------------

BS = 4
PROMPT = [(7 * i + 3) % 300 + 20 for i in range(43)]  # 10 full blocks and 3 tokens
ARENA_BYTES = 4 << 20


def make_core(model, host: Host | None, rank: int) -> EngineCore:
    config = EngineArgs(model=str(model), dtype="float32", block_size=BS, num_kv_blocks=64,
                        max_num_batched_tokens=64, max_num_seqs=4).create_config()
    if host is not None:  # as the host's launcher sets it
        config = dataclasses.replace(config, cache=dataclasses.replace(
            config.cache, kv_offload_bytes=ARENA_BYTES, kv_tier_address=host.kv.address))
    return EngineCore(config, dp_rank=rank)


def generate(core: EngineCore, prompt: list[int]) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    core.add_request(EngineCoreRequest("r", list(prompt), params))
    tokens: list[int] = []
    deadline = time.monotonic() + 120
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "generate did not finish"
        tokens += [t for out in core.step() for t in out.new_token_ids]
    return tokens


def prompt_hashes(prompt: list[int], block_size: int = BS) -> list[bytes]:
    """The prefix cache's chain over the prompt's full blocks (unsalted)."""
    hashes: list[bytes] = []
    for i in range(len(prompt) // block_size):
        hashes.append(hash_block(hashes[-1] if hashes else root_hash(None),
                                 prompt[i * block_size:(i + 1) * block_size]))
    return hashes


def test_an_engine_on_another_host_continues_from_pulled_blocks(tiny_llama) -> None:
    alone = make_core(tiny_llama, None, 0)
    try:
        expected = generate(alone, PROMPT)
    finally:
        alone.shutdown()
    hosts: list[Host] = []
    cores: list[EngineCore] = []
    try:
        for ip in ("127.0.0.1", "127.0.0.2"):
            allocator = AddressAllocator()
            hosts.append(Host(KVStore(ARENA_BYTES, allocator, remote_host=ip), allocator))
            hosts[-1].kv.start()
        first, second = hosts
        cores = [make_core(tiny_llama, first, 0), make_core(tiny_llama, second, 1)]
        assert generate(cores[0], PROMPT) == expected
        tier = cores[1].scheduler.tier.connector.client  # the second engine's, of its store
        assert tier.stats()["ready"] == 0
        hashes = prompt_hashes(PROMPT)
        assert len(hashes) == 10
        assert run_pull(second, first, hashes) == 10
        assert (tier.stats()["pulled"], tier.stats()["ready"]) == (10, 10)
        assert generate(cores[1], PROMPT) == expected
        got = cores[1].get_stats()
        assert got.kv_tier_hits == 40 and got.kv_tier_loaded_bytes > 0  # 10 blocks' tokens
    finally:
        for core in cores:
            core.shutdown()
        for host in hosts:
            host.kv.close()
            host.allocator.cleanup()


# ---- a front-end finds each rank's store ----------------------------------------------

def _listening_ports(procs: list[psutil.Process]) -> set[tuple[str, int]]:
    out = set()
    for p in procs:
        try:
            out |= {(c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="tcp")
                    if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.slow
def test_a_front_end_knows_each_ranks_store_on_a_head_and_headless_host(tiny_llama) -> None:
    """A head (rank 0, this process's front-end) and a headless host (rank 1), each with
    its store: the front-end finds both stores' tcp:// addresses from the heartbeats,
    each is where that host's store listens, and a pull between them works."""
    model, rpc, tier = str(tiny_llama), free_port(), ("--kv-offload-memory", "16MiB")
    headless, log = start_background(model, "--headless", "--data-parallel-size-local", "1",
                                     "--data-parallel-start-rank", "1", *dp_args(2, rpc),
                                     *tier)
    try:
        asyncio.run(_front_end_sees_the_stores(model, rpc, headless))
    finally:
        stop(headless, 15)
        log.close()


async def _front_end_sees_the_stores(model: str, rpc: int, headless) -> None:
    config = EngineArgs(model=model, data_parallel_size=2, data_parallel_size_local=1,
                        data_parallel_address="127.0.0.1", data_parallel_rpc_port=rpc,
                        threads_per_engine=1, max_model_len=256, num_kv_blocks=64,
                        kv_offload_memory="16MiB").create_config()
    launch = await asyncio.to_thread(launch_engines, config, 1, 120.0)
    client = None
    try:
        client = AsyncEngineClient(launch.input_binds(0), launch.output_binds(0),
                                   engine_ranks=launch.ranks,
                                   coordinator_address=launch.coordinator_address)
        deadline = time.monotonic() + 30
        while None in (client.table.store_address_of(0), client.table.store_address_of(1)):
            assert time.monotonic() < deadline, "no store address in the heartbeats"
            await asyncio.sleep(0.1)
        head, other = client.table.store_address_of(0), client.table.store_address_of(1)
        assert head == launch.kv_store.remote_address and other != head
        remote_stores = [p for p in descendants(headless.pid) if p.name() == "dpserve::KVStore"]
        host, port = other.removeprefix("tcp://").rsplit(":", 1)
        assert (host, int(port)) in _listening_ports(remote_stores)
        # Rank 0 computes a prompt; the headless host's store pulls its blocks.
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        await client.add_request(EngineCoreRequest("r", PROMPT, params, data_parallel_rank=0))
        while not any(o.finished for o in (await asyncio.wait_for(client.get_output(),
                                                                   60)).outputs):
            pass
        hashes = prompt_hashes(PROMPT, config.cache.block_size)
        assert await asyncio.wait_for(pull(other, head, hashes, secret=None, timeout=10),
                                      HANG_S) == len(hashes) > 0
    finally:
        if client is not None:
            await client.aclose()
        launch.close()

