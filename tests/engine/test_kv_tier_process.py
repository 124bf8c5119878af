"""The KV store as a process (`dpserve::KVStore`) and its client, over real sockets.

Started through the launcher's handle (`dpserve.launch.kv_store.KVStore`):
round trips through the arena that two clients map; a SIGKILLed store makes
every call a miss (nothing raises, nothing hangs) until the launcher's restart
(a new generation, a new arena, the dead one's unlinked) and the client's
hello after its back-off; SIGTERM and the launcher's death leave no arena and
no process; a client process that dies holding pins loses them; another
layout is refused; with a secret, a client without it gets nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch
from helpers import wait_until

from dpserve.kv_tier.arena import attach_arena, leftover_arenas
from dpserve.kv_tier.client import KVTierClient
from dpserve.kv_tier.layout import TierLayout
from dpserve.launch.addresses import AddressAllocator
from dpserve.launch.kv_store import KVStore

pytestmark = pytest.mark.procs

LAYOUT = TierLayout.for_model(model="tiny", dtype="float32", element_bytes=4, block_size=4,
                              num_layers=2, kv_heads_per_worker=2, head_dim=8, tp_size=2)
SLOTS = 16
SECRET = "s" * 40


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


@pytest.fixture
def store():
    allocator = AddressAllocator()
    kv = KVStore(SLOTS * LAYOUT.slot_bytes, allocator)
    try:
        kv.start()
        yield kv
    finally:
        kv.close()
        allocator.cleanup()
    assert leftover_arenas(os.getpid()) == []


def client_of(kv: KVStore, name: str, timeout_s: float = 1.0, **kw) -> KVTierClient:
    return KVTierClient(kv.address, LAYOUT, name=name, timeout_s=timeout_s, **kw)


def test_two_clients_share_blocks_through_the_arena(store: KVStore) -> None:
    a, b = client_of(store, "dp0"), client_of(store, "dp1")
    try:
        assert a.arena_name == b.arena_name == store.arena_name
        assert (a.num_slots, a.generation) == (SLOTS, 0)
        arena_a = attach_arena(a.arena_name, a.arena_bytes)
        arena_b = attach_arena(b.arena_name, b.arena_bytes)
        granted = a.reserve([h(1), h(2)])
        assert len(granted) == 2
        for i, slot in ((1, granted[h(1)]), (2, granted[h(2)])):
            start = slot * LAYOUT.slot_bytes
            arena_a[start:start + LAYOUT.slot_bytes] = i
        assert b.lookup([h(1), h(2)]) == []  # written, not committed: invisible
        a.commit([h(1), h(2)])
        slots = b.lookup([h(1), h(2), h(3)])
        assert slots == [granted[h(1)], granted[h(2)]]
        for i, slot in zip((1, 2), slots, strict=True):
            start = slot * LAYOUT.slot_bytes
            assert torch.all(arena_b[start:start + LAYOUT.slot_bytes] == i)
        assert b.stats()["pinned"] == 2
        b.release(slots)
        stats = b.stats()
        assert (stats["up"], stats["pinned"], stats["ready"], stats["hits"]) == (True, 0, 2, 2)
    finally:
        a.close()
        b.close()


def test_a_killed_store_is_a_miss_until_restarted_then_a_new_generation(
        store: KVStore, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dpserve.kv_tier.client")
    client = client_of(store, "dp0")
    try:
        granted = client.reserve([h(1)])
        client.commit(list(granted))
        pinned = client.lookup([h(1)])
        assert pinned == [granted[h(1)]]
        old_arena = client.arena_name
        mapping = attach_arena(old_arena, client.arena_bytes)
        store.proc.kill()
        store.proc.join(5)
        assert leftover_arenas(os.getpid()) == [old_arena]  # SIGKILL: the store could not
        assert client.lookup([h(1)]) == []  # a miss, no exception
        assert client.arena_name is None and client.stats()["up"] is False
        assert client.reserve([h(2)]) == {}
        client.release(pinned)  # no-ops while down
        client.commit([h(2)])
        mapping[:4] = 7  # the dead store's mapping stays valid
        store.restart()
        assert leftover_arenas(os.getpid()) == [store.arena_name] != [old_arena]
        wait_until(lambda: client.reserve([h(3)]), 10, "the client's hello to the new store")
        assert (client.generation, client.arena_name) == (1, store.arena_name)
        assert client.lookup([h(1)]) == []  # the new arena starts empty
        assert client.stats()["writing"] == 1
        transitions = [r.getMessage().split(" is ")[1][:4] for r in caplog.records
                       if " is up" in r.getMessage() or " is down" in r.getMessage()]
        assert transitions == ["up: ", "down", "up: "]  # one line per transition
    finally:
        client.close()


def test_a_store_that_does_not_answer_is_a_miss_by_the_timeout(store: KVStore) -> None:
    """SIGSTOP: the store lives but says nothing. Each call ends at its timeout as a
    miss; after SIGCONT the client says hello again (same generation) and what it had
    pinned before is no longer pinned."""
    client = client_of(store, "dp0", timeout_s=0.3)
    try:
        client.commit(list(client.reserve([h(1)])))
        pinned = client.lookup([h(1)])
        os.kill(store.proc.pid, signal.SIGSTOP)
        try:
            assert client.lookup([h(1)]) == []
            assert client.arena_name is None
        finally:
            os.kill(store.proc.pid, signal.SIGCONT)
        wait_until(lambda: client.stats()["up"], 10,
                   "the client's hello after SIGCONT")
        assert client.generation == 0 and client.arena_name == store.arena_name
        client.release(pinned)  # from before the hello: ignored, nothing to unpin
        stats = client.stats()
        assert (stats["pinned"], stats["ready"]) == (0, 1)
        assert client.lookup([h(1)]) == pinned
    finally:
        client.close()


def test_sigterm_unlinks_the_arena_and_exits_0(store: KVStore) -> None:
    client = client_of(store, "dp0")
    client.close()
    assert leftover_arenas(os.getpid()) == [store.arena_name]
    store.proc.terminate()
    store.proc.join(10)
    assert store.proc.exitcode == 0
    assert leftover_arenas(os.getpid()) == []


def test_a_client_process_that_dies_loses_its_pins(store: KVStore) -> None:
    owner = client_of(store, "owner")
    try:
        granted = owner.reserve([h(1)])
        owner.commit(list(granted))
        script = textwrap.dedent(f"""
            from dpserve.kv_tier.client import KVTierClient
            from dpserve.kv_tier.layout import TierLayout
            layout = TierLayout({LAYOUT.key!r}, {LAYOUT.shard_bytes}, {LAYOUT.num_shards})
            client = KVTierClient({store.address!r}, layout, name="dp1")
            print(client.lookup([{h(1)!r}]), flush=True)
            input()
        """)
        proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == str([granted[h(1)]])
            assert owner.stats()["pinned"] == 1
            proc.kill()
        finally:
            proc.kill()
            proc.wait(10)
        wait_until(lambda: owner.stats()["pinned"] == 0, 10, "the dead client's pins dropped")
        assert owner.stats()["clients"] == 1
    finally:
        owner.close()


def test_another_layout_is_refused_and_the_first_client_goes_on(store: KVStore) -> None:
    first = client_of(store, "dp0")
    other = KVTierClient(store.address, TierLayout("another model", 512, 1), name="dp1")
    try:
        assert first.arena_name is not None
        assert other.arena_name is None and other.lookup([h(1)]) == []
        assert first.reserve([h(1)]) != {}
    finally:
        first.close()
        other.close()


def test_with_a_secret_only_clients_that_know_it_are_answered() -> None:
    allocator = AddressAllocator()
    kv = KVStore(SLOTS * LAYOUT.slot_bytes, allocator, secret=SECRET)
    try:
        kv.start()
        knows = client_of(kv, "dp0", secret=SECRET)
        stranger = KVTierClient(kv.address, LAYOUT, name="dp1", timeout_s=0.5)
        assert knows.arena_name == kv.arena_name
        assert stranger.arena_name is None and stranger.reserve([h(1)]) == {}
        knows.close()
        stranger.close()
    finally:
        kv.close()
        allocator.cleanup()


def test_the_store_stops_when_its_launcher_dies() -> None:
    script = textwrap.dedent("""
        from dpserve.launch.addresses import AddressAllocator
        from dpserve.launch.kv_store import KVStore
        kv = KVStore(1 << 20, AddressAllocator())
        kv.start()
        print(kv.proc.pid, kv.arena_name, flush=True)
        input()
    """)
    launcher = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    try:
        pid, arena = launcher.stdout.readline().split()
        store = psutil.Process(int(pid))
        assert store.name() == "dpserve::KVStore"
        assert leftover_arenas(launcher.pid) == [arena]
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        psutil.wait_procs([store], timeout=15)
        assert not store.is_running()
        assert leftover_arenas(launcher.pid) == []
    finally:
        launcher.kill()
        launcher.wait(10)
