"""Pure logic of the /engines figures: `TokenRate` and the coordinator's `RankInfoTable`."""

from __future__ import annotations

from dpserve.protocol import EngineInfo, EngineReport
from dpserve.rank_info import RankInfoTable, TokenRate


def test_token_rate_over_its_window():
    rate = TokenRate(window_s=5.0)
    assert rate.rate(0.0) == 0.0  # no samples
    for t in range(11):  # 100 tokens a second for 10 s
        rate.add(100 * t, now=float(t))
    assert rate.rate(10.0) == 100.0
    rate.add(1000, now=11.0)  # idle from here on
    assert 0 < rate.rate(11.0) < 100.0
    for t in range(12, 18):
        rate.add(1000, now=float(t))
    assert rate.rate(17.0) == 0.0  # nothing new within the window
    rate.add(5, now=18.0)  # a new process counts from 0: start over
    assert rate.rate(18.0) == 0.0
    rate.add(55, now=19.0)
    assert rate.rate(19.0) == 50.0
    assert rate.rate(40.0) == 0.0  # the counts stopped coming


def test_rank_info_table_drops_old_incarnations_and_tracks_changes():
    table = RankInfoTable(2)
    beat = dict(heartbeat=True, kv_cache_usage=0.5, pid=7, host="h")
    table.on_heartbeat(EngineReport(1, generated_tokens=0, incarnation=1, **beat), 0.0)
    table.on_heartbeat(EngineReport(1, generated_tokens=40, incarnation=1, **beat), 1.0)
    assert table.changed and table.info[1].tokens_per_s == 40.0
    assert table.take()[1] == EngineInfo(kv_cache_usage=0.5, tokens_per_s=40.0, pid=7, host="h")
    assert not table.changed
    # A beat of the process rank 1 had before: dropped.
    table.on_heartbeat(EngineReport(1, generated_tokens=999, incarnation=0, pid=3), 2.0)
    assert table.info[1].pid == 7 and not table.changed
    assert table.cordon(0, True) and not table.cordon(0, True) and table.info[0].cordoned
    table.resize(3)
    assert len(table.take()) == 3 and table.info[0].cordoned
