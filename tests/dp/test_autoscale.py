"""The coordinator's bookkeeping of run-time scaling, as pure logic: one change at a
time (`ScaleBook`) and the autoscaler's windows, hysteresis and cooldown."""

from __future__ import annotations

from dpserve.config import AutoscaleConfig
from dpserve.launch.coordinator.autoscale import ScaleBook
from dpserve.protocol import RankState, RankStatus, ScalePhase, ScaleRequest, ScaleResult

SERVING = RankStatus(RankState.SERVING)
CONFIG = AutoscaleConfig(1, 3, up_queue=2.0, up_window_s=5.0, down_load=0.5,
                         down_window_s=10.0, cooldown_s=20.0)


def test_one_change_at_a_time_and_its_answers():
    book = ScaleBook(size_max=3)
    assert book.on_request(ScaleRequest("a", 2), size=1, now=0.0) is None  # pending
    assert book.busy and book.status.phase is ScalePhase.PENDING
    busy = book.on_request(ScaleRequest("b", 3), size=1, now=1.0)
    assert busy.phase is ScalePhase.REJECTED and "from 1 to 2" in busy.message
    for bad in (0, 4):
        answer = book.on_request(ScaleRequest("c", bad), size=1, now=1.0)
        assert answer.phase is ScalePhase.FAILED and "[1, 3]" in answer.message
    book.on_request(ScaleResult("other", True), size=2, now=2.0)  # not ours: dropped
    assert book.busy
    book.on_request(ScaleResult("a", True), size=2, now=2.0)
    assert not book.busy and book.status.phase is ScalePhase.DONE
    same = book.on_request(ScaleRequest("d", 2), size=2, now=3.0)
    assert same.phase is ScalePhase.DONE and not book.busy
    off = ScaleBook(size_max=None).on_request(ScaleRequest("e", 2), size=1, now=0.0)
    assert off.phase is ScalePhase.FAILED


def test_autoscale_up_after_the_window_then_cooldown_then_down():
    book = ScaleBook(size_max=3, autoscale=CONFIG)
    high = [[5, 2]]  # 5 waiting on the one rank
    assert not book.autoscale_due(high, [SERVING], now=0.0)
    assert not book.autoscale_due(high, [SERVING], now=4.9)  # window not over yet
    assert book.autoscale_due(high, [SERVING], now=5.0)
    assert (book.status.old_size, book.status.new_size) == (1, 2)
    assert "mean waiting requests per serving rank 5.00 > 2" in book.status.message
    assert not book.autoscale_due(high, [SERVING], now=30.0)  # a change runs
    book.on_request(ScaleResult(book.status.scale_id, True), size=2, now=31.0)
    idle = [[0, 0], [0, 0]]
    two = [SERVING, SERVING]
    assert not book.autoscale_due(idle, two, now=40.0)  # cooldown until 51
    assert not book.autoscale_due(idle, two, now=52.0)  # the down window starts
    assert not book.autoscale_due(idle, two, now=61.9)
    assert book.autoscale_due(idle, two, now=62.0)
    assert (book.status.old_size, book.status.new_size) == (2, 1)
    assert book.decisions() == [1, 1]


def test_autoscale_up_on_a_slow_first_token_even_with_a_short_queue():
    config = AutoscaleConfig(1, 3, up_queue=2.0, up_window_s=5.0, down_load=0.5,
                             down_window_s=10.0, cooldown_s=20.0, up_ttft_s=1.5)
    book = ScaleBook(size_max=3, autoscale=config)
    short = [[1, 4]]  # 1 waiting: the queue alone says nothing
    assert not book.autoscale_due(short, [SERVING], now=0.0, ttft=[0.4])
    assert not book.autoscale_due(short, [SERVING], now=10.0, ttft=[2.5])  # window opens
    assert not book.autoscale_due(short, [SERVING], now=14.0, ttft=[2.5])
    assert book.autoscale_due(short, [SERVING], now=15.0, ttft=[2.5])
    assert "mean time to first token 2.50 s > 1.5 s for 5 s" in book.status.message
    # Without a TTFT target the same figures decide nothing.
    plain = ScaleBook(size_max=3, autoscale=CONFIG)
    assert not any(plain.autoscale_due(short, [SERVING], now=float(t), ttft=[9.0])
                   for t in range(0, 60, 5))


def test_autoscale_hysteresis_between_the_thresholds_and_the_bounds():
    book = ScaleBook(size_max=3, autoscale=CONFIG)
    middle = [[1, 1], [1, 1]]  # waiting 1 <= 2 per rank, load 2 >= 0.5: neither
    two = [SERVING, SERVING]
    for t in range(0, 100, 5):
        assert not book.autoscale_due(middle, two, now=float(t))
    # A dip in the window starts it again.
    high = [[6, 1], [6, 1]]
    assert not book.autoscale_due(high, two, now=100.0)
    assert not book.autoscale_due(middle, two, now=103.0)
    assert not book.autoscale_due(high, two, now=104.0)
    assert not book.autoscale_due(high, two, now=108.0)
    assert book.autoscale_due(high, two, now=109.0)
    # At MAX (3) there is no step up; at MIN (1) no step down.
    at_max = ScaleBook(size_max=3, autoscale=CONFIG)
    three = [SERVING] * 3
    assert not any(at_max.autoscale_due([[9, 1]] * 3, three, now=float(t))
                   for t in range(0, 60, 5))
    at_min = ScaleBook(size_max=3, autoscale=CONFIG)
    assert not any(at_min.autoscale_due([[0, 0]], [SERVING], now=float(t))
                   for t in range(0, 60, 5))
    assert at_max.decisions() == [0, 0] and at_min.decisions() == [0, 0]
