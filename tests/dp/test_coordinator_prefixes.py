"""The DP coordinator's relay of API servers' prefix facts (`PrefixFacts`), driven by
scripted engines and fake front-ends (XSUB sockets in this process) over a real
coordinator process: facts go to every front-end at once; a garbage, oversized or
out-of-range message is dropped and the relay goes on. Every receive has a timeout."""

from __future__ import annotations

import msgspec
import pytest
from helpers import FakeFrontend, ScriptedEngines

from dpserve.launch.coordinator.prefix_relay import MAX_FACTS_BYTES, is_prefix_facts
from dpserve.protocol import (
    MAX_PREFIX_FACTS,
    CoordinatorUpdate,
    PrefixFacts,
    WakeEngines,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.procs]


def hashes(n: int, seed: int = 0) -> list[bytes]:
    return [bytes([seed]) + i.to_bytes(31, "little") for i in range(n)]


@pytest.fixture
def two_frontends(make_coordinator, ctx):
    coord = make_coordinator(2)
    ScriptedEngines(ctx, coord, 2).wait_ready()
    frontends = [FakeFrontend(ctx, coord), FakeFrontend(ctx, coord)]
    for frontend in frontends:
        frontend.recv()  # a new subscriber gets the state at once
    return coord, frontends


def with_facts(update: CoordinatorUpdate) -> bool:
    return update.prefixes is not None


def test_facts_reach_every_front_end_with_the_wave_news(two_frontends):
    _, (first, second) = two_frontends
    facts = PrefixFacts(0, [1, 0], [hashes(3), hashes(2, seed=1)])
    first.send(facts)
    for frontend in (first, second):
        update = frontend.wait_for(with_facts)
        assert update.prefixes == facts
        assert (update.counts, update.wave, update.running) == (None, 0, False)


def test_bad_messages_are_dropped_and_the_relay_goes_on(two_frontends):
    coord, (first, second) = two_frontends
    tag = msgspec.msgpack.encode(PrefixFacts(0, [], []))[:10]
    assert is_prefix_facts(tag)
    oversized = PrefixFacts(0, [0], [hashes(MAX_PREFIX_FACTS + 1)])  # over the count cap
    huge = PrefixFacts(0, [0], [[b"x" * (MAX_FACTS_BYTES + 1)]])  # over the size cap
    bad = [tag + b"\xff\xc1 garbage",  # the tag, then no msgpack
           msgspec.msgpack.encode(oversized), msgspec.msgpack.encode(huge),
           msgspec.msgpack.encode(PrefixFacts(0, [2], [hashes(1)])),  # no rank 2
           msgspec.msgpack.encode(PrefixFacts(0, [0, 1], [hashes(1)])),  # runs != ranks
           msgspec.msgpack.encode(PrefixFacts(0, [0], [[b"y" * 65]]))]  # not a hash
    for body in bad:
        first.sock.send(body)
    good = PrefixFacts(1, [0], [hashes(MAX_PREFIX_FACTS)])  # at the cap: relayed
    second.send(good)
    # The first facts anyone hears of are the good ones: the bad were all dropped.
    assert first.wait_for(with_facts).prefixes == good
    assert second.wait_for(with_facts).prefixes == good
    # The coordinator still does its other work.
    first.send(WakeEngines(wave=0))
    assert second.wait_for(lambda u: u.counts is None and u.prefixes is None).running
    assert coord.proc is not None and coord.proc.is_alive()
