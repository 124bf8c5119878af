"""`dpserve top`: the figures it computes from two /metrics answers (pure), and the
command against real servers on the tiny model: `--once` on a DP=2 server (a row
per rank with its state and cordon, request and token counts that match what was
sent and the server's own counters), on a server with an API key (without it: exit
1 and one line; with it: the table), on a dead URL (exit 1 naming it); the live
view under a real pseudo-terminal (redraws, `q` and Ctrl-C end it with exit 0 and
the terminal's settings restored; a dead server: a "reconnecting" line)."""

from __future__ import annotations

import fcntl
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import time

import httpx
import pytest
from helpers import finished_by_engine, free_port, serve

from dpserve.cli import main
from dpserve.entrypoints.top_view import Poll, parse_metrics, rate, render, view_of

DP_ARGS = ("--data-parallel-size", "2", "--threads-per-engine", "1", "--max-model-len", "256")
REQUESTS, MAX_TOKENS = 6, 5
KEY = "top-test-key"

# ---------------------------------------------------------------- pure: figures

def _exposition(gen: float, fin0: float, tenants: bool = False) -> str:
    """/metrics text as the server writes it (prometheus_client's own exposition)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    r = CollectorRegistry()
    Counter("dpserve:generation_tokens", "", ["model_name"], registry=r).labels("tiny").inc(gen)
    Counter("dpserve:prompt_tokens", "", ["model_name"], registry=r).labels("tiny").inc(30)
    done = Counter("dpserve:request_success", "", ["model_name", "finished_reason"], registry=r)
    done.labels("tiny", "length").inc(4)
    done.labels("tiny", "stop").inc(2)
    by_rank = Counter("dpserve:engine_requests_finished", "", ["model_name", "engine"],
                      registry=r)
    by_rank.labels("tiny", "0").inc(fin0)
    by_rank.labels("tiny", "1").inc(2)
    Gauge("dpserve:prefix_cache_hit_rate", "", ["model_name", "engine"],
          registry=r).labels("tiny", "0").set(0.25)
    Gauge("process_start_time_seconds", "", registry=r).set(1000.0)
    if tenants:
        requests = Counter("dpserve:tenant_requests", "", ["model_name", "tenant"], registry=r)
        requests.labels("tiny", "alice").inc(3)
        requests.labels("tiny", "bob\x1b[2J").inc(1)  # control characters in a name
        tokens = Counter("dpserve:tenant_tokens", "", ["model_name", "tenant", "kind"],
                         registry=r)
        tokens.labels("tiny", "alice", "prompt").inc(12)
        tokens.labels("tiny", "alice", "generation").inc(40)
        queued = Histogram("dpserve:tenant_queue_time_seconds", "", ["model_name", "tenant"],
                           registry=r)
        queued.labels("tiny", "alice").observe(0.125)
        queued.labels("tiny", "alice").observe(0.375)
    return generate_latest(r).decode()


_ENGINES = {"data_parallel_size": 2, "engines": [
    {"rank": 0, "state": "serving", "cordoned": False, "waiting": 1, "running": 3,
     "kv_cache_usage": 0.5, "tokens_per_s": 12.5, "role": "both", "restarts": 0},
    {"rank": 1, "state": "dead", "cordoned": True, "waiting": 0, "running": 0,
     "kv_cache_usage": 0.0, "tokens_per_s": 0.0, "role": "both", "restarts": 2}]}


def _poll(at: float, gen: float, fin0: float, tenants: bool = False) -> Poll:
    return Poll(at=at, wall=1000.0 + 3725.0, engines=_ENGINES,
                metrics=parse_metrics(_exposition(gen, fin0, tenants)))


def test_rates_are_counter_differences_over_the_time_between_polls():
    view = view_of("http://x", _poll(10.0, 100.0, 4.0), _poll(12.0, 160.0, 5.0))
    assert view.tokens_per_s == 30.0 and view.prompt_tokens_per_s == 0.0
    assert (view.finished, view.generated, view.prompted) == (6.0, 160.0, 30.0)
    assert (view.model, view.uptime_s, view.data_parallel_size) == ("tiny", 3725.0, 2)
    assert (view.running, view.waiting) == (3, 1)
    r0, r1 = view.ranks
    assert (r0.finished, r0.finished_per_s, r0.prefix_hit_rate, r0.tokens_per_s) == \
        (5.0, 0.5, 0.25, 12.5)
    assert (r1.state, r1.cordoned, r1.finished_per_s, r1.prefix_hit_rate, r1.restarts) == \
        ("dead", True, 0.0, None, 2)
    assert view.tenants is None  # no dpserve:tenant_* series


def test_first_poll_has_no_rates_and_a_counter_that_went_down_restarted():
    first = view_of("http://x", None, _poll(10.0, 100.0, 4.0))
    assert first.tokens_per_s is None and first.ranks[0].finished_per_s is None
    assert rate(100.0, 20.0, 2.0) == 10.0  # restarted from 0: 20 since
    assert rate(1.0, 2.0, 0.0) is None


def test_tenant_series_become_one_row_per_tenant_and_a_column_per_series():
    table = view_of("http://x", None, _poll(1.0, 1.0, 1.0, tenants=True)).tenants
    assert table is not None
    assert table.columns == ["queue_time_seconds", "requests", "tokens{kind=generation}",
                             "tokens{kind=prompt}"]
    rows = dict(table.rows)
    assert rows["alice"] == [0.25, 3.0, 40.0, 12.0]  # the histogram's mean
    # a tenant name's control characters are not sent to the terminal
    assert rows["bob?[2J"] == [None, 1.0, None, None]


def test_plain_snapshot_lists_ranks_and_tenants_in_split_able_columns(capsys):
    from rich.console import Console

    view = view_of("http://x", _poll(10.0, 100.0, 4.0), _poll(12.0, 160.0, 5.0, tenants=True))
    Console(width=200, color_system=None).print(render(view, None, boxed=False))
    lines = capsys.readouterr().out.splitlines()
    assert "\x1b" not in "".join(lines)
    assert "up 1:02:05" in lines[0] and "tokens/s out 30.0" in lines[1]
    assert _row(lines, "0")[:6] == ["0", "serving", "no", "1", "3", "50.0%"]
    assert _row(lines, "1")[:3] == ["1", "dead", "yes"]
    assert _row(lines, "alice") == ["alice", "0.250", "3", "40", "12"]
    assert _row(lines, "bob?[2J") == ["bob?[2J", "-", "1", "-", "-"]


@pytest.mark.parametrize("interval", ["0", "-1", "3601", "nan"])
def test_a_bad_interval_is_one_line_naming_the_option(interval, capsys):
    assert main(["top", "--interval", interval, "--once"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("dpserve: error: --interval must be in (0, 3600]")


def test_a_url_without_a_scheme_is_one_line_naming_the_option(capsys):
    assert main(["top", "--url", "127.0.0.1:8000", "--once"]) == 2
    assert capsys.readouterr().err.strip().startswith("dpserve: error: --url must start")


def _row(lines: list[str], first: str) -> list[str]:
    """The whitespace-split line whose first column is `first` (exactly one)."""
    rows = [line.split() for line in lines if line.split()[:1] == [first]]
    assert len(rows) == 1, f"one row {first!r} in:\n" + "\n".join(lines)
    return rows[0]


# ---------------------------------------------------------------- real servers


def _top(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpserve.cli", "top", *args],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def dp2(tiny_llama):
    with serve(str(tiny_llama), *DP_ARGS, "--enable-admin-api",
               "--allow-unauthenticated-admin") as (_, url):
        yield url, str(tiny_llama)


@pytest.mark.procs
def test_once_shows_each_rank_and_the_requests_sent(dp2):
    url, model = dp2
    with httpx.Client(base_url=url, timeout=60) as client:
        before = finished_by_engine(url)
        for i in range(REQUESTS):
            r = client.post("/v1/completions", json={
                "model": model, "prompt": f"top {i}", "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
        cordoned = client.post("/engines/1/cordon", json={})
        assert cordoned.status_code == 200 and cordoned.json()["cordoned"] is True, \
            cordoned.text
        try:
            done = _top("--url", url, "--once", "--interval", "0.2")
        finally:
            uncordoned = client.post("/engines/1/uncordon", json={})
            assert uncordoned.status_code == 200, uncordoned.text
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    by_engine = finished_by_engine(url)
    rows = {rank: _row(lines, str(rank)) for rank in (0, 1)}
    # rank state cordoned waiting running kv prefix tok/s finished finished/s role restarts
    assert [rows[r][1:5] for r in (0, 1)] == [["serving", "no", "0", "0"],
                                              ["serving", "yes", "0", "0"]]
    # finished per rank: the server's own counter ("-": the rank finished none)
    assert [rows[r][8] for r in (0, 1)] == [
        str(round(by_engine[r])) if r in by_engine else "-" for r in (0, 1)]
    assert sum(by_engine.values()) - sum(before.values()) == REQUESTS
    header = lines[1].split()
    finished = int(header[header.index("finished") + 1])
    generated = int(header[header.index("generated") + 1])
    assert finished == sum(by_engine.values())  # every request this server finished
    assert generated == finished * MAX_TOKENS  # all of them ignore_eos, MAX_TOKENS each
    assert f"model {model}" in lines[0] and "data parallel 2" in lines[0]


@pytest.mark.procs
def test_api_key_server_without_the_key_is_one_line_and_exit_1(tiny_llama):
    no_key = {"DPSERVE_API_KEY": ""}
    with serve(str(tiny_llama), "--max-model-len", "256", "--api-key", KEY) as (_, url):
        refused = _top("--url", url, "--once", "--interval", "0.1", env=no_key)
        shown = _top("--url", url, "--once", "--interval", "0.1",
                     env={"DPSERVE_API_KEY": KEY})
        term = Terminal("--url", url, "--interval", "0.1", env=no_key)  # live: the same
        try:
            assert term.wait() == 1
            assert b"pass the server's key with --api-key" in term.screen
            assert termios.tcgetattr(term.slave) == term.settings
        finally:
            term.close()
    assert refused.returncode == 1 and refused.stdout == ""
    err = refused.stderr.strip()
    assert "\n" not in err and "401" in err and "--api-key" in err, err
    assert shown.returncode == 0, shown.stderr
    assert _row(shown.stdout.splitlines(), "0")[1] == "serving"


@pytest.mark.procs
def test_a_dead_url_is_one_line_naming_it_and_exit_1():
    url = f"http://127.0.0.1:{free_port()}"
    done = _top("--url", url, "--once", "--interval", "0.1")
    assert done.returncode == 1 and done.stdout == ""
    err = done.stderr.strip()
    assert "\n" not in err and f"cannot reach {url}" in err, err


# ---------------------------------------------------------------- live, in a terminal


class Terminal:
    """`dpserve top` (live) on a real pseudo-terminal that is its controlling terminal
    (so Ctrl-C typed there signals it); this side keeps both ends open, so it can
    read the terminal's settings after the process exits."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.master, self.slave = os.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 180, 0, 0))
        self.settings = termios.tcgetattr(self.slave)
        argv = [sys.executable, "-m", "dpserve.cli", "top", *args]
        # The window's size, also where rich looks first (a COLUMNS=80 inherited from
        # a test runner would narrow the table below its column names).
        env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "180", "LINES": "50",
               **(env or {})}
        self.pid = os.fork()
        if self.pid == 0:  # the child: only system calls until exec
            try:
                os.setsid()
                fcntl.ioctl(self.slave, termios.TIOCSCTTY, 0)
                for fd in (0, 1, 2):
                    os.dup2(self.slave, fd)
                os.execve(sys.executable, argv, env)
            finally:
                os._exit(127)
        self.screen = b""
        self.code: int | None = None

    def read_until(self, done, timeout: float = 60.0) -> None:
        """Read what it draws until `done(screen)`; fail past `timeout` or if it exits."""
        deadline = time.monotonic() + timeout
        while not done(self.screen):
            assert self.exited() is None, f"top exited {self.code}: {self.screen[-2000:]!r}"
            assert time.monotonic() < deadline, f"timed out; screen: {self.screen[-2000:]!r}"
            if select.select([self.master], [], [], 0.2)[0]:
                self.screen += os.read(self.master, 1 << 16)

    def exited(self) -> int | None:
        if self.code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.code = os.waitstatus_to_exitcode(status)
        return self.code

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while self.exited() is None:
            assert time.monotonic() < deadline, f"top still runs: {self.screen[-2000:]!r}"
            if select.select([self.master], [], [], 0.1)[0]:
                self.screen += os.read(self.master, 1 << 16)
        return self.code  # type: ignore[return-value]

    def close(self) -> None:
        if self.exited() is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.master)
        os.close(self.slave)


def _draws(marker: bytes, count: int):
    return lambda screen: screen.count(marker) >= count


@pytest.mark.procs
@pytest.mark.parametrize("key", [b"q", b"\x03", None], ids=["q", "ctrl-c", "sigterm"])
def test_live_view_redraws_and_quits_cleanly(dp2, key):
    url, _ = dp2
    term = Terminal("--url", url, "--interval", "0.2")
    try:
        term.read_until(_draws(b"finished/s", 3))  # the rank table, drawn three times
        if key is None:
            os.kill(term.pid, signal.SIGTERM)
        else:
            os.write(term.master, key)
        assert term.wait() == 0
        assert b"serving" in term.screen and url.encode() in term.screen
        assert term.screen.rstrip().endswith(b"\x1b[?1049l")  # alternate screen left
        # cbreak mode undone: the terminal reads lines and echoes again
        assert termios.tcgetattr(term.slave) == term.settings
    finally:
        term.close()


@pytest.mark.procs
def test_live_view_of_a_dead_server_says_reconnecting_until_q():
    url = f"http://127.0.0.1:{free_port()}"
    term = Terminal("--url", url, "--interval", "0.1")
    try:
        term.read_until(_draws(b"reconnecting", 2))
        assert f"cannot reach {url}".encode() in term.screen
        os.write(term.master, b"q")
        assert term.wait() == 0
        assert termios.tcgetattr(term.slave) == term.settings
    finally:
        term.close()
