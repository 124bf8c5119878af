"""Sticky sessions as pure logic (`dpserve.frontend.routing`, `rank_table`): a session's
follow-ups go to its rank under every policy, and move when that rank is hot, cordoned
or dead (to the policy's choice, with a host tier preferably a rank that reaches the
prefix through it), a pin wins, the stored rank of a Responses chain wins over the
router's record, the record is a bounded LRU, and two routers (two API servers, or two
processes) place a new session alike. Then, over real sockets with two named fake
engines, that the session places the request but never reaches an engine; and the
Responses store keeping each response's rank (also in a file made before the column).
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys

import msgspec
import pytest
import zmq
from fakes import FakeEngineState

from dpserve.frontend.engine_client import AsyncEngineClient
from dpserve.frontend.rank_table import RankTable
from dpserve.frontend.routing import (
    LOAD_BALANCE_POLICIES,
    MAX_SESSIONS,
    Router,
    SessionTable,
    rendezvous_rank,
    sendable,
)
from dpserve.launch.addresses import AddressAllocator
from dpserve.protocol import (
    CoordinatorUpdate,
    EngineCoreRequest,
    EngineInfo,
    RequestType,
    Session,
    engine_identity,
)
from dpserve.sampling_params import SamplingParams
from dpserve.server.responses.store import ResponseStore, init_store_file

BS = 4  # block size of these tests


def engines(n: int, hosts: str = "") -> list[FakeEngineState]:
    return [FakeEngineState(r, info=EngineInfo(host=hosts[r] if hosts else ""))
            for r in range(n)]


def key_on(rank: int, ranks: list[int], prefix: str = "x-session-id:s") -> str:
    """A session key whose rendezvous rank over `ranks` is `rank`."""
    return next(k for k in (f"{prefix}{i}" for i in range(10000))
                if rendezvous_rank(k, ranks) == rank)


def turn(key: str | None, n: int = 0, rank: int | None = None, pin: int | None = None,
         tokens: list[int] | None = None) -> EngineCoreRequest:
    """Turn `n` of session `key` (its prompt grows by a block a turn)."""
    prompt = tokens if tokens is not None else [7] * (8 * BS) + [n] * BS * (n + 1)
    return EngineCoreRequest(f"r{n}", prompt, SamplingParams(), data_parallel_rank=pin,
                             session=Session(key, rank) if key is not None else None)


@pytest.mark.parametrize("policy", LOAD_BALANCE_POLICIES)
def test_follow_ups_stick_to_the_sessions_rank_under_every_policy(policy):
    live = engines(3)
    router = Router(policy, block_size=BS)
    key = key_on(2, [0, 1, 2])
    assert router.choose(live, turn(key, 0), balanced=True) is live[2]
    live[2].running = 20  # the busiest, but not hot (+20 <= balance_abs 32)
    for n in range(1, 8):
        assert router.choose(live, turn(key, n), balanced=True) is live[2]
    assert (router.session_routed, router.session_moved) == (8, 0)
    assert router.session_rank(key) == 2
    # A request without a session (another prompt) is the policy's.
    other = router.choose(live, turn(None, tokens=[9] * 20), balanced=True)
    assert other is live[0]  # the least loaded; round-robin: its first turn


@pytest.mark.parametrize("policy", ["least-loaded", "cache-aware"])
def test_a_hot_rank_moves_the_session_and_it_stays_moved(policy):
    live = engines(3)
    router = Router(policy, block_size=BS)
    key = key_on(0, [0, 1, 2])
    assert router.choose(live, turn(key, 0), balanced=True) is live[0]
    live[0].waiting = 10  # load 40: hot (> 32 over the least loaded, and > 1.5 times)
    moved = router.choose(live, turn(key, 1), balanced=True)
    assert moved is not live[0] and router.session_moved == 1
    live[0].waiting = 0  # cool again: the session stays where its prefix is now
    for n in range(2, 6):
        assert router.choose(live, turn(key, n), balanced=True) is moved
    assert router.session_rank(key) == moved.rank


def test_round_robin_moves_a_hot_session_to_its_turns_rank():
    """Blind to load, as for any request: the session moves where the turn says."""
    live = engines(3)
    router = Router("round-robin", block_size=BS)
    key = key_on(1, [0, 1, 2])
    assert router.choose(live, turn(key, 0), balanced=True) is live[1]
    live[1].waiting = 10  # hot
    assert router.choose(live, turn(key, 1), balanced=True) is live[0]  # the first turn
    assert router.choose(live, turn(key, 2), balanced=True) is live[0]  # moved, stays
    assert router.session_moved == 1


def test_cordoned_dead_and_excluded_ranks_move_the_session():
    router = Router("least-loaded", block_size=BS)
    table = RankTable(range(3), router, balanced=True)
    for rank in range(3):
        table.register(rank)
    key = key_on(1, [0, 1, 2])
    assert table.choose(turn(key, 0)).rank == 1
    cordon = CoordinatorUpdate(None, 0, True, engines=[EngineInfo(), EngineInfo(cordoned=True),
                                                       EngineInfo()])
    table.apply_update(cordon)
    moved = table.choose(turn(key, 1)).rank
    assert moved != 1
    table.apply_update(CoordinatorUpdate(None, 0, True, engines=[EngineInfo()] * 3))
    assert table.choose(turn(key, 2)).rank == moved  # uncordoned: it stays moved
    table.mark_dead(moved, "exit code -9")
    again = table.choose(turn(key, 3)).rank
    assert again not in (moved,) and table.choose(turn(key, 4)).rank == again
    # Excluded (a request moving off that rank) is not live either.
    assert table.choose(turn(key, 5), exclude=again).rank not in (again, moved)


def test_a_pin_wins_over_the_session_and_the_session_follows_it():
    router = Router("cache-aware", block_size=BS)
    table = RankTable(range(2), router, balanced=True)
    for rank in range(2):
        table.register(rank)
    key = key_on(0, [0, 1])
    assert table.choose(turn(key, 0)).rank == 0
    assert table.choose(turn(key, 1, pin=1)).rank == 1
    assert table.choose(turn(key, 2)).rank == 1  # its latest prefix is there


def test_the_stored_rank_wins_over_the_record_and_the_hash():
    live = engines(3)
    router = Router("least-loaded", block_size=BS)
    key = key_on(0, [0, 1, 2])
    assert router.choose(live, turn(key, 0), balanced=True) is live[0]
    # Another API server ran the chain's last turn on rank 2 (the Responses store says).
    assert router.choose(live, turn(key, 1, rank=2), balanced=True) is live[2]
    assert router.session_rank(key) == 2
    # A stored rank that is not live (cordoned, scaled away): the policy picks.
    assert router.choose(live[:2], turn(key, 2, rank=2), balanced=True) in live[:2]


def test_a_hot_session_rank_with_a_host_tier_moves_to_a_rank_of_its_host():
    live = engines(3, hosts="aab")  # ranks 0 and 1 share host a's tier; 2 is on b
    router = Router("cache-aware", block_size=BS, kv_tier=True)
    key = key_on(0, [0, 1, 2])
    first = turn(key, 0)
    assert router.choose(live, first, balanced=True) is live[0]
    live[0].waiting = 10  # hot
    follow_up = turn(key, 1, tokens=first.prompt_token_ids + [5] * BS)
    assert router.choose(live, follow_up, balanced=True) is live[1]  # loads it from the tier
    assert router.tier_routed == 1 and router.session_rank(key) == 1


def test_the_record_is_an_lru_bounded_by_max_sessions():
    table = SessionTable(capacity=3)
    for i, key in enumerate("abc"):
        table.record(key, i)
    table.record("a", 5)  # a is the most recent now
    table.record("d", 6)  # b, the least recently placed, goes
    assert [table.get(k) for k in "abcd"] == [5, None, 2, 6] and len(table) == 3
    table.record("user:\ud800" + "x" * 10_000, 1)  # any text (JSON allows a lone surrogate)
    assert table.get("user:\ud800" + "x" * 10_000) == 1
    router = Router("round-robin")
    live = engines(2)
    for i in range(MAX_SESSIONS + 100):
        router.choose(live, turn(f"user:{i}"), balanced=True)
    assert len(router.sessions) == MAX_SESSIONS
    assert router.session_rank("user:0") is None
    assert router.session_rank(f"user:{MAX_SESSIONS + 99}") is not None
    with pytest.raises(ValueError):
        SessionTable(capacity=0)


def test_two_routers_place_new_sessions_alike_and_a_rank_leaving_moves_only_its_own():
    live = engines(4)
    routers = [Router(policy, client_index=i, block_size=BS)
               for i, policy in enumerate(("least-loaded", "cache-aware"))]
    keys = [f"x-session-id:{i}" for i in range(400)]
    placed = [[r.choose(live, turn(k), balanced=True).rank for k in keys] for r in routers]
    assert placed[0] == placed[1]
    assert all(placed[0].count(rank) > 50 for rank in range(4)), "the hash spreads them"
    # Rank 3 cordoned: fresh routers (API servers that never saw these sessions) agree,
    # and only rank 3's sessions move.
    fresh = [Router("least-loaded", client_index=i) for i in range(2)]
    after = [[r.choose(live[:3], turn(k), balanced=True).rank for k in keys] for r in fresh]
    assert after[0] == after[1]
    assert all(b == a for a, b in zip(placed[0], after[0]) if a != 3)
    assert 3 not in after[0]


@pytest.mark.procs
def test_the_hash_is_the_same_in_another_process():
    """Not Python's salted hash(): another interpreter, another PYTHONHASHSEED."""
    keys = [f"user:{i}" for i in range(20)]
    code = ("from dpserve.frontend.routing import rendezvous_rank as h; "
            f"print([h(k, [0, 1, 2, 3, 4]) for k in {keys!r}])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([rendezvous_rank(k, [0, 1, 2, 3, 4]) for k in keys])


def test_sendable_drops_the_session_and_keeps_the_rest():
    req = turn("x-session-id:a", 3, rank=1)
    sent = sendable(req, client_index=2, wave=5)
    assert sent.session is None and (sent.client_index, sent.current_wave) == (2, 5)
    assert sent.prompt_token_ids == req.prompt_token_ids and req.session is not None
    plain = sendable(sent, 2, 5)
    assert plain is sent  # nothing to change: no copy
    assert msgspec.msgpack.encode(sent) == msgspec.msgpack.encode(
        msgspec.structs.replace(req, session=None, client_index=2, current_wave=5))


def test_the_client_places_by_session_and_never_sends_it():
    """AsyncEngineClient over real sockets; two named fake engines (DEALERs that
    register and read what they are sent)."""
    alloc = AddressAllocator()
    addrs = alloc.engine_addresses(num_clients=1)
    ctx = zmq.Context()
    fakes = []
    for rank in range(2):
        fake = ctx.socket(zmq.DEALER)
        fake.setsockopt(zmq.IDENTITY, engine_identity(rank))
        fake.setsockopt(zmq.LINGER, 0)
        fakes.append(fake)
    key = key_on(1, [0, 1])
    decoder = msgspec.msgpack.Decoder(EngineCoreRequest)

    async def scenario() -> None:
        client = AsyncEngineClient(addrs.inputs[0], addrs.outputs[0], engine_ranks=(0, 1),
                                   register_timeout=10)
        try:
            for fake in fakes:
                fake.connect(addrs.inputs[0])
                fake.send(b"")
            for n in range(4):
                await client.add_request(turn(key, n))
                assert client.engine_of(f"r{n}") == 1
                assert client.book.flights[f"r{n}"].request.session is None  # as moved
            got = []
            while len(got) < 4:
                assert fakes[1].poll(10_000), "a request never reached rank 1"
                kind, body = fakes[1].recv_multipart()
                assert kind == RequestType.ADD.value
                got.append(decoder.decode(body))
            assert [r.request_id for r in got] == ["r0", "r1", "r2", "r3"]
            assert all(r.session is None for r in got)
            assert b"x-session-id" not in body
            assert not fakes[0].poll(0)  # nothing went to rank 0
        finally:
            await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        for fake in fakes:
            fake.close()
        ctx.term()
        alloc.cleanup()


def test_the_store_keeps_each_responses_rank_also_in_an_older_file(tmp_path):
    path = str(tmp_path / "responses.sqlite")
    old = sqlite3.connect(path)  # the schema before ranks were kept
    old.execute("CREATE TABLE responses (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT "
                "UNIQUE NOT NULL, previous_id TEXT, status TEXT NOT NULL, cancel_requested "
                "INTEGER NOT NULL DEFAULT 0, response TEXT NOT NULL, input_items TEXT NOT NULL)")
    old.execute("INSERT INTO responses (id, previous_id, status, response, input_items) "
                "VALUES ('resp_old', NULL, 'completed', '{\"id\": \"resp_old\"}', '[]')")
    old.commit()
    old.close()
    init_store_file(path)  # the launcher, before any API server opens it

    async def run() -> None:
        a, b = (ResponseStore(path, 100, 1 << 20) for _ in range(2))  # two API servers
        try:
            assert (await a.get("resp_old")).rank is None
            await a.put({"id": "resp_1", "status": "in_progress"}, [], "resp_old")
            assert (await b.get("resp_1")).rank is None
            assert await a.finish({"id": "resp_1", "status": "completed"}, rank=1)
            chain = await b.conversation("resp_1")
            assert [(r.response["id"], r.rank) for r in chain] == [("resp_old", None),
                                                                   ("resp_1", 1)]
        finally:
            a.close()
            b.close()

    asyncio.run(run())
    # A store opened on an old file without the launcher's step adds the column too.
    older = str(tmp_path / "older.sqlite")
    db = sqlite3.connect(older)
    db.execute("CREATE TABLE responses (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT "
               "UNIQUE NOT NULL, previous_id TEXT, status TEXT NOT NULL, cancel_requested "
               "INTEGER NOT NULL DEFAULT 0, response TEXT NOT NULL, input_items TEXT NOT NULL)")
    db.close()
    store = ResponseStore(older, 10, 1 << 20)
    store.connect()
    store.close()
    columns = [c[1] for c in sqlite3.connect(older).execute("PRAGMA table_info(responses)")]
    assert columns[-1] == "dp_rank"
