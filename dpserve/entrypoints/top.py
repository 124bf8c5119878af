"""`dpserve top [--url URL] [--api-key KEY] [--interval S] [--once]`: a server in the terminal.

Polls GET /engines and GET /metrics every `--interval` seconds (each call with a
timeout, `_TIMEOUT_S`) and shows what `dpserve.entrypoints.top_view` makes of the
last two answers: the server, tokens/s, requests running / waiting / finished; a
row per DP rank; a row per tenant when the server has `dpserve:tenant_*` series.

* Live (the default): a rich `Live` screen (the terminal's alternate screen),
  redrawn after every poll. `q` (stdin a terminal: read in cbreak mode, restored
  on the way out), Ctrl-C or SIGTERM ends it with exit 0. A server that cannot be reached,
  or answers 5xx, leaves the last screen up with a "reconnecting" line; polls go on.
* `--once`: two polls `--interval` apart (so rates exist), one plain-text
  snapshot on stdout, exit 0: for scripts and tests.

Errors (stderr, one line, exit 1): the server cannot be reached (`--once`), a 401
/ 403 (the line says to pass `--api-key`), a 404 (no such route: not a dpserve
server), an answer that is not JSON / Prometheus text. A bad option (`--url`
without http(s)://, `--interval` outside (0, 3600]) is a `ConfigError` naming it
(exit 2) before any request.

Not here: what is shown and how it is computed (`dpserve.entrypoints.top_view`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shutil
import signal
import sys
import termios
import time
import tty
from collections.abc import Iterator
from typing import Any

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from dpserve.entrypoints.top_view import Poll, View, parse_metrics, render, view_of
from dpserve.errors import ConfigError

_TIMEOUT_S = 5.0  # each HTTP call
_MAX_INTERVAL_S = 3600.0
_PLAIN_WIDTH = 200  # --once into a pipe: columns of the text


class TopError(Exception):
    """A poll failed; `fatal`: polling again will not help (a key, a wrong URL)."""

    def __init__(self, message: str, fatal: bool) -> None:
        super().__init__(message)
        self.fatal = fatal


def add_top_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="The server (any of its API servers).")
    parser.add_argument("--api-key", default=None,
                        help="The server's --api-key (default: $DPSERVE_API_KEY).")
    parser.add_argument("--interval", type=float, default=1.0,
                        help="Seconds between polls, in (0, 3600].")
    parser.add_argument("--once", action="store_true",
                        help="Print one snapshot (two polls --interval apart) as plain "
                             "text and exit.")


def run_top(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--url must start with http:// or https://, got {args.url!r}")
    if not 0 < args.interval <= _MAX_INTERVAL_S:  # (NaN too)
        raise ConfigError(f"--interval must be in (0, {_MAX_INTERVAL_S:g}] seconds, "
                          f"got {args.interval:g}")
    key = args.api_key or os.environ.get("DPSERVE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=_TIMEOUT_S) as client:
        try:
            return _once(client, url, args.interval) if args.once else _live(
                client, url, args.interval)
        except TopError as e:
            print(f"dpserve: error: {e}", file=sys.stderr)
            return 1


def poll(client: httpx.Client, url: str) -> Poll:
    """GET /engines and /metrics once (TopError: why not)."""
    engines = _get(client, url, "/engines")
    metrics = _get(client, url, "/metrics")
    try:
        body = engines.json()
        if not isinstance(body, dict):
            raise ValueError("not a JSON object")
        parsed = parse_metrics(metrics.text)
    except ValueError as e:
        raise TopError(f"{url} answered something that is not dpserve's /engines and "
                       f"/metrics ({e})", fatal=True) from None
    return Poll(at=time.monotonic(), wall=time.time(), engines=body, metrics=parsed)


def _get(client: httpx.Client, url: str, path: str) -> httpx.Response:
    try:
        response = client.get(path)
    except httpx.TimeoutException:
        raise TopError(f"cannot reach {url}: no answer in {_TIMEOUT_S:g} s",
                       fatal=False) from None
    except httpx.HTTPError as e:
        raise TopError(f"cannot reach {url}: {e}", fatal=False) from None
    if response.status_code in (401, 403):
        raise TopError(f"{url}{path} answered {response.status_code}: pass the server's key "
                       f"with --api-key (or $DPSERVE_API_KEY)", fatal=True)
    if response.status_code == 404:
        raise TopError(f"{url} has no {path} (is it a dpserve server?)", fatal=True)
    if response.status_code != 200:
        raise TopError(f"{url}{path} answered HTTP {response.status_code}", fatal=False)
    return response


def _once(client: httpx.Client, url: str, interval: float) -> int:
    """Two polls `interval` apart, the second shown as plain text."""
    first = poll(client, url)
    time.sleep(interval)
    view = view_of(url, first, poll(client, url))
    width = shutil.get_terminal_size((_PLAIN_WIDTH, 24)).columns if sys.stdout.isatty() \
        else _PLAIN_WIDTH
    console = Console(file=sys.stdout, width=max(width, 120), color_system=None,
                      highlight=False, emoji=False)
    console.print(render(view, None, boxed=False))
    return 0


def _live(client: httpx.Client, url: str, interval: float) -> int:
    """Redraw after every poll until `q`, Ctrl-C or SIGTERM (exit 0) or a fatal error
    (raised, after the terminal is restored)."""
    try:
        with _sigterm_interrupts(), _keys() as pressed_q, Live(console=Console(), screen=True,
                                        auto_refresh=False) as live:
            previous: Poll | None = None
            view: View | None = None
            while True:
                status = None
                try:
                    current = poll(client, url)
                    view, previous = view_of(url, previous, current), current
                except TopError as e:
                    if e.fatal:
                        raise
                    status = f"{e}; reconnecting (every {interval:g} s)"
                live.update(Group(render(view, status, boxed=True),
                                  Text("q or Ctrl-C: quit", style="dim")), refresh=True)
                if pressed_q(interval):
                    return 0
    except KeyboardInterrupt:
        return 0


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM ends the live view as Ctrl-C does (the terminal restored on the way out)."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _keys() -> Iterator[Any]:
    """A function `pressed_q(seconds)`: waits that long, True as soon as `q` is typed.
    stdin a terminal: cbreak mode (keys arrive unbuffered, Ctrl-C still signals),
    its settings restored on exit; otherwise it only waits."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    if fd is None:
        yield lambda seconds: time.sleep(seconds) or False
        return
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def pressed_q(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([fd], [], [], left)[0]:
                continue
            try:
                typed = os.read(fd, 64)
            except OSError:  # the terminal went away
                typed = b""
            if not typed:  # end of input: only wait
                time.sleep(max(0.0, deadline - time.monotonic()))
                return False
            if b"q" in typed.lower():
                return True
        return False

    try:
        yield pressed_q
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
