"""The tenants' ledger and limits file, IO-free (dpserve/tenancy), and the
coordinator's tenant desk over real ZMQ sockets (dpserve/launch/coordinator/tenants.py):
each limit admits up to its value and refuses past it with which limit, what is
left and when to retry; a finish gives back what a request did not use; a sync
or a silent API server drops what the coordinator would otherwise hold forever;
a bad limits file is a one-line error naming --tenant-limits and the entry."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import zmq

from dpserve.errors import ConfigError
from dpserve.launch.coordinator.tenants import TenantDesk
from dpserve.tenancy.ledger import Ledger, Refusal
from dpserve.tenancy.limits import TenantLimit, TenantLimits, load_tenant_limits
from dpserve.tenancy.messages import (
    SESSION_TIMEOUT_S,
    TenantAdmit,
    TenantFinished,
    TenantStarted,
    TenantSync,
    TenantVerdict,
)

LIMITS = TenantLimits({"a": TenantLimit(max_requests_in_flight=2),
                       "q": TenantLimit(max_queued_tokens=10),
                       "t": TenantLimit(tokens_per_minute=100)},
                      default=TenantLimit(max_requests_in_flight=1))


def test_in_flight_limit_admits_up_to_it_and_frees_at_finish():
    ledger = Ledger(LIMITS)
    assert ledger.admit("r1", "a", 5, 5, now=0.0) is None
    assert ledger.admit("r2", "a", 5, 5, now=0.0) is None
    refusal = ledger.admit("r3", "a", 5, 5, now=0.0)
    assert refusal is not None and refusal.limit == "max_requests_in_flight"
    assert (refusal.value, refusal.remaining, refusal.retry_after_s) == (2, 0, 1)
    assert ledger.usage("a", 0.0).in_flight == 2  # the refused one left no trace
    ledger.finished("r1", 5)
    assert ledger.admit("r3", "a", 5, 5, now=0.0) is None


def test_other_tenants_are_counted_apart_and_default_applies_to_the_unnamed():
    ledger = Ledger(LIMITS)
    assert ledger.admit("x1", "nobody", 1, 1, now=0.0) is None
    assert ledger.admit("x2", "nobody", 1, 1, now=0.0).limit == "max_requests_in_flight"
    assert ledger.admit("y1", "somebody", 1, 1, now=0.0) is None  # its own default share
    assert ledger.admit("a1", "a", 1, 1, now=0.0) is None
    unlimited = Ledger(TenantLimits({"a": TenantLimit(max_requests_in_flight=1)}))
    for i in range(50):  # no default entry: others have no limit
        assert unlimited.admit(i, "free", 1000, 1000, now=0.0) is None


def test_queued_tokens_leave_at_the_first_token():
    ledger = Ledger(LIMITS)
    assert ledger.admit("r1", "q", 6, 100, now=0.0) is None
    refusal = ledger.admit("r2", "q", 6, 100, now=0.0)
    assert refusal.limit == "max_queued_tokens" and (refusal.remaining, refusal.cost) == (4, 6)
    ledger.started("r1")
    assert ledger.usage("q", 0.0).queued_tokens == 0
    assert ledger.admit("r2", "q", 6, 100, now=0.0) is None
    ledger.finished("r2", 3)  # never started: its prompt leaves the queue too
    assert ledger.usage("q", 0.0) == ledger.usage("q", 0.0).__class__(1, 0, 106 + 9)


def test_tokens_per_minute_reserves_max_tokens_and_corrects_at_finish():
    ledger = Ledger(LIMITS)
    assert ledger.admit("r1", "t", 10, 50, now=0.0) is None  # 60 reserved
    refusal = ledger.admit("r2", "t", 10, 50, now=10.0)
    assert refusal.limit == "tokens_per_minute"
    assert (refusal.value, refusal.remaining, refusal.cost) == (100, 40, 60)
    assert refusal.retry_after_s == 50  # r1 leaves the window at t=60
    assert refusal.reset_s == 50
    ledger.finished("r1", 5)  # used 15 of its 60
    assert ledger.usage("t", 10.0).window_tokens == 15
    assert ledger.admit("r2", "t", 10, 50, now=10.0) is None  # 75 of 100
    assert ledger.admit("r3", "t", 10, 20, now=20.0).limit == "tokens_per_minute"
    assert ledger.admit("r3", "t", 10, 20, now=60.0) is None  # r1 (t=0) left the window


def test_a_request_over_the_whole_limit_is_refused_with_the_window_as_retry():
    refusal = Ledger(LIMITS).admit("big", "t", 90, 20, now=0.0)
    assert refusal.limit == "tokens_per_minute" and refusal.cost == 110
    assert refusal.retry_after_s == 60


def test_every_figure_returns_to_zero_and_unknown_keys_do_nothing():
    ledger = Ledger(LIMITS)
    for i in range(2):
        assert ledger.admit(i, "a", 3, 3, now=0.0) is None
    ledger.started(0)
    ledger.finished(0, 3)
    ledger.drop([1])
    ledger.started("unknown")
    ledger.finished("unknown", 4)
    usage = ledger.usage("a", 100.0)  # past the window
    assert (usage.in_flight, usage.queued_tokens, usage.window_tokens) == (0, 0, 0)
    assert ledger.keys() == []
    with pytest.raises(ValueError):
        ledger.admit("k", "a", 1, 1, now=0.0)
        ledger.admit("k", "a", 1, 1, now=0.0)


# ---- the limits file ----------------------------------------------------------------


def _load(tmp_path, text: str) -> TenantLimits:
    path = tmp_path / "limits.json"
    path.write_text(text)
    return load_tenant_limits(str(path))


def test_limits_file_reads_named_tenants_and_default(tmp_path):
    limits = _load(tmp_path, json.dumps({
        "default": {"max_requests_in_flight": 4},
        "alice": {"tokens_per_minute": 1000, "max_queued_tokens": None}}))
    assert limits.of("alice") == TenantLimit(tokens_per_minute=1000)  # no inheritance
    assert limits.of("bob") == TenantLimit(max_requests_in_flight=4)
    assert limits.names == {"alice", "default"}


@pytest.mark.parametrize("text, words", [
    ("{", ["not valid JSON"]),
    ("[1]", ["JSON object"]),
    ('{"a b": {}}', ["'a b'", "tenant name"]),
    ('{"alice": 3}', ["'alice'", "object of limits"]),
    ('{"alice": {"tpm": 3}}', ["'alice'", "unknown limit 'tpm'"]),
    ('{"alice": {"tokens_per_minute": 0}}', ["'alice'", "tokens_per_minute", "got 0"]),
    ('{"alice": {"max_requests_in_flight": true}}', ["max_requests_in_flight", "got true"]),
])
def test_a_bad_limits_file_is_one_line_naming_the_option_and_entry(tmp_path, text, words):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, text)
    message = str(e.value)
    assert "\n" not in message and message.startswith("--tenant-limits ")
    assert all(w in message for w in words), message


def test_a_missing_limits_file_names_the_option(tmp_path):
    with pytest.raises(ConfigError, match="--tenant-limits .*No such file"):
        load_tenant_limits(str(tmp_path / "nope.json"))


# ---- the coordinator's desk, over real sockets -------------------------------------


class _Dealer:
    """An API server's side of the desk, as a plain DEALER (identity = its session)."""

    def __init__(self, ctx: zmq.Context, address: str, identity: bytes) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.seq = 0

    def send(self, message) -> None:
        self.sock.send(msgspec.msgpack.encode(message))

    def admit(self, desk: TenantDesk, request_id: str, tenant: str) -> TenantVerdict:
        self.seq += 1
        self.send(TenantAdmit(self.seq, request_id, tenant, 4, 4))
        return self.verdict(desk)

    def verdict(self, desk: TenantDesk) -> TenantVerdict:
        deadline = time.monotonic() + 10
        while not self.sock.poll(10):
            assert time.monotonic() < deadline, "no verdict from the desk"
            if desk.socket.poll(0):
                desk.on_frames()
        return msgspec.msgpack.decode(self.sock.recv(), type=TenantVerdict)

    def flush(self, desk: TenantDesk, until) -> None:
        """Let the desk read what was sent, until `until()` holds (bounded)."""
        deadline = time.monotonic() + 10
        while not until():
            assert time.monotonic() < deadline, "the desk did not take the message"
            if desk.socket.poll(10):
                desk.on_frames()


@pytest.fixture
def desk(tmp_path):
    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/tenants"
    desk = TenantDesk(ctx, address, TenantLimits({"a": TenantLimit(max_requests_in_flight=1)}),
                      None)
    yield desk, ctx, address
    ctx.destroy(linger=0)


def test_desk_shares_one_ledger_between_api_servers(desk):
    desk, ctx, address = desk
    one, two = _Dealer(ctx, address, b"server-1"), _Dealer(ctx, address, b"server-2")
    assert one.admit(desk, "r1", "a").refusal is None
    refused = two.admit(desk, "r1", "a")  # same id, another server: another request
    assert refused.refusal is not None and refused.refusal.limit == "max_requests_in_flight"
    one.send(TenantStarted("r1"))
    one.send(TenantFinished("r1", 4))
    one.flush(desk, lambda: desk.ledger.usage("a", time.monotonic()).in_flight == 0)
    assert two.admit(desk, "r2", "a").refusal is None


def test_desk_sync_drops_what_an_api_server_no_longer_holds(desk):
    desk, ctx, address = desk
    one = _Dealer(ctx, address, b"server-1")
    assert one.admit(desk, "lost", "a").refusal is None  # its finish is never sent
    one.send(TenantSync([]))
    one.flush(desk, lambda: not desk.ledger.keys())
    assert one.admit(desk, "next", "a").refusal is None
    one.send(TenantSync(["next"]))  # still held: kept
    one.flush(desk, lambda: desk.socket.poll(0) == 0)
    assert desk.ledger.keys() == [(b"server-1", "next")]


def test_desk_forgets_a_silent_api_server(desk):
    desk, ctx, address = desk
    dead, alive = _Dealer(ctx, address, b"dead"), _Dealer(ctx, address, b"alive")
    assert dead.admit(desk, "r1", "a").refusal is None
    assert alive.admit(desk, "r2", "a").refusal is not None
    desk.expire(time.monotonic() + SESSION_TIMEOUT_S + 1)  # "dead" said nothing since
    assert alive.admit(desk, "r2", "a").refusal is None


# ---- the 429 -------------------------------------------------------------------------


def test_the_429_names_the_limit_and_carries_the_headers_that_apply():
    from dpserve.server.tenants import refusal_error

    flight = refusal_error("alice", Refusal("max_requests_in_flight", 2, 0, 1, 1, 0))
    assert (flight.status_code, flight.type, flight.code, flight.param) == (
        429, "rate_limit_error", "max_requests_in_flight", None)
    assert "'alice'" in flight.message and "--tenant-limits" in flight.message
    assert flight.headers == {
        "Retry-After": "1", "RateLimit-Limit": "2", "RateLimit-Remaining": "0",
        "RateLimit-Reset": "1", "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1s"}
    tokens = refusal_error("bob", Refusal("tokens_per_minute", 100, 40, 60, 12, 30))
    assert tokens.param is None  # it fits once the window moves: worth retrying
    assert {k: v for k, v in tokens.headers.items() if k.startswith("x-")} == {
        "x-ratelimit-limit-tokens": "100", "x-ratelimit-remaining-tokens": "40",
        "x-ratelimit-reset-tokens": "30s"}
    assert tokens.headers["Retry-After"] == "12" and tokens.headers["RateLimit-Reset"] == "30"
    queued = refusal_error("q", Refusal("max_queued_tokens", 10, 4, 6, 1, 0))
    assert not any(k.startswith("x-") for k in queued.headers)
    # Alone over the limit: it never fits; the field to shrink is named.
    alone = refusal_error("bob", Refusal("tokens_per_minute", 100, 100, 130, 60, 0))
    assert alone.param == "max_tokens" and "never fit" in alone.message
    assert refusal_error("q", Refusal("max_queued_tokens", 10, 10, 11, 1, 0)).param == "prompt"
