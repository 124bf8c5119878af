"""The engine's OutputSender (dpserve.engine.output_sender) over real ZMQ sockets
(inproc PUSH -> PULL, small high-water marks): a front-end that reads gets every
message in order while another does not read; the one that does not read is
dropped when its backlog passes the byte cap or its oldest message waits the
stall timeout (a test clock), its backlog discarded; once the busy loop says its
requests are aborted and it reads again, it gets one notice ending (ABORT) every
request that finished meanwhile or in the discarded backlog, and is served as
before; until then, it gets nothing."""

from __future__ import annotations

import itertools
import queue
import threading

import msgspec
import pytest
import zmq

from dpserve.engine.output_sender import OutputSender
from dpserve.protocol import ENGINE_CORE_DEAD, EngineCoreOutput, EngineCoreOutputs, FinishReason

HWM = 4  # messages each side of an inproc pipe holds
DECODER = msgspec.msgpack.Decoder(EngineCoreOutputs)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pair():
    """(sender with two clients, [PULL of client 0, PULL of client 1], drops, clock)."""
    ctx = zmq.Context()
    names = itertools.count()
    pulls, pushes = [], []
    for _ in range(2):
        address = f"inproc://outputs-{next(names)}"
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, HWM)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(address)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, HWM)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(address)
        pulls.append(pull)
        pushes.append(push)
    news: list[tuple[int, str | None]] = []
    clock = Clock()
    sender = OutputSender(pushes, 3, max_backlog_bytes=10_000, stall_timeout=2.0,
                          on_change=lambda client, why: news.append((client, why)),
                          clock=clock)
    yield sender, pulls, news, clock
    ctx.destroy(linger=0)


def tokens(request_id: str, token: int, finished: bool = False) -> EngineCoreOutputs:
    return EngineCoreOutputs(engine_index=3, outputs=[EngineCoreOutput(
        request_id, [token], finish_reason=FinishReason.LENGTH if finished else None)])


def read_all(pull: zmq.Socket) -> list[EngineCoreOutputs]:
    got = []
    while pull.poll(200):
        got.append(DECODER.decode(pull.recv()))
    return got


def fill(sender: OutputSender, client: int, request_id: str, count: int,
         finish_last: bool = False) -> None:
    for i in range(count):
        sender.put(client, tokens(request_id, i, finish_last and i == count - 1))


def test_a_reader_gets_everything_in_order_while_the_other_client_reads_nothing(pair):
    sender, pulls, news, _ = pair
    got: list[int] = []

    def read_ready() -> None:
        while pulls[0].poll(0):
            got.extend(DECODER.decode(pulls[0].recv()).outputs[0].new_token_ids)

    for i in range(200):  # far past what client 1's pipe holds
        sender.put(0, tokens("a", i))
        sender.put(1, tokens("b", i))
        sender.pump()
        read_ready()
    assert got == list(range(200)), "client 0 reads: it got every message, in order"
    assert sender.backlog_sizes()[0] == 0
    assert sender.backlog_sizes()[1] > 150, "client 1 does not read: its outputs wait"
    assert news == []  # under the cap, within the stall timeout


def test_backlog_over_its_byte_cap_drops_the_client(pair):
    sender, pulls, news, _ = pair
    size = len(msgspec.msgpack.encode(tokens("b", 0)))
    fill(sender, 1, "b", 2 * HWM + 10_000 // size + 5)
    assert news == [(1, news[0][1])] and "--engine-output-backlog" in news[0][1], news
    assert "10000 bytes" in news[0][1]
    assert sender.backlog_sizes()[1] == 0, "a dropped client's backlog is discarded"
    assert sender.num_dropped == 1
    sender.put(0, tokens("a", 1))
    assert [o.outputs[0].request_id for o in read_all(pulls[0])] == ["a"]


def test_stall_timeout_drops_the_client_only_once_its_oldest_output_waited_that_long(pair):
    sender, _, news, clock = pair
    fill(sender, 1, "b", 3 * HWM)
    assert sender.backlog_sizes()[1] > 0
    clock.now += 1.9
    sender.pump()
    assert news == []
    clock.now += 0.2
    sender.pump()
    assert len(news) == 1 and news[0][0] == 1
    assert "--engine-output-stall-timeout 2" in news[0][1] and "2.1 s" in news[0][1]


def test_a_dropped_client_that_reads_again_gets_one_notice_then_its_outputs(pair):
    sender, pulls, news, clock = pair
    # "done" finishes inside the backlog that will be discarded; "cut" runs on.
    fill(sender, 1, "cut", 2 * HWM)
    sender.put(1, tokens("done", 7, finished=True))
    fill(sender, 1, "cut", 3)
    assert sender.backlog_sizes()[1] > 3
    clock.now += 2.0
    sender.pump()
    assert [n[0] for n in news] == [1]
    # Dropped: outputs are discarded, but a request that finishes (here: aborted by
    # the busy loop) is remembered for the notice.
    sender.put(1, tokens("cut", 99))
    got = read_all(pulls[1])  # the client reads again, but the busy loop has not
    sender.pump()             # said yet that every request of it is aborted: no notice
    assert news == [(1, news[0][1])]
    sender.put(1, EngineCoreOutputs(engine_index=3, outputs=[
        EngineCoreOutput("cut", [], finish_reason=FinishReason.ABORT)]))
    sender.put(1, None)  # the busy loop: all aborted
    sender.pump()  # the notice goes out
    got += read_all(pulls[1])
    assert news[1:] == [(1, None)]
    *stale, notice = got
    assert all(o.outputs[0].request_id == "cut" and not o.outputs[0].finished for o in stale)
    assert len(stale) <= 2 * HWM, "only what ZMQ took before the drop"
    assert sorted((o.request_id, o.finish_reason, o.new_token_ids) for o in notice.outputs) \
        == [("cut", FinishReason.ABORT, []), ("done", FinishReason.ABORT, [])]
    assert notice.engine_index == 3
    sender.put(1, tokens("next", 1))  # served as before
    assert [o.outputs[0].request_id for o in read_all(pulls[1])] == ["next"]


def test_a_dropped_client_that_never_reads_again_gets_nothing_and_stays_dropped(pair):
    sender, pulls, news, clock = pair
    fill(sender, 1, "b", 3 * HWM, finish_last=True)
    clock.now += 2.0
    sender.pump()
    sender.put(1, None)
    for _ in range(5):
        sender.put(1, tokens("b2", 1, finished=True))
        sender.pump()
    assert [n[0] for n in news] == [1] and sender.clients[1].dropped
    assert sender.clients[1].notice == ["b"] + ["b2"] * 5
    sender.put(0, tokens("a", 1))  # the other client is served all along
    assert [o.outputs[0].request_id for o in read_all(pulls[0])] == ["a"]


def test_run_sends_in_order_and_stops_on_none_or_engine_dead(pair):
    sender, pulls, _, _ = pair
    items: queue.Queue = queue.Queue()
    thread = threading.Thread(target=sender.run, args=(items, b"\x03\x00"))
    thread.start()
    for i in range(5):
        items.put((0, tokens("a", i)))
    items.put(ENGINE_CORE_DEAD)
    thread.join(timeout=10)
    assert not thread.is_alive()
    frames = []
    while pulls[0].poll(200):
        frames.append(pulls[0].recv_multipart())
    assert [DECODER.decode(f[0]).outputs[0].new_token_ids for f in frames[:-1]] == \
        [[i] for i in range(5)]
    assert frames[-1] == [ENGINE_CORE_DEAD, b"\x03\x00"]
    assert pulls[1].poll(200) and pulls[1].recv_multipart() == [ENGINE_CORE_DEAD, b"\x03\x00"]
