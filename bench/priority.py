"""Priorities and tenant fairness at DP=2: `--scheduling-policy`.

(a) Urgent TTFT. Tenant `urgent` sends --urgent-requests streamed completions one
after another (--urgent-gap s between them; priority -10), each --prompt-len random
tokens -> --urgent-output-len tokens. Rows:

* `idle`: nothing else runs;
* `priority`: tenant `batch` keeps --low-concurrency streams of priority 10 in
  flight (closed loop, --low-output-len tokens each: the engines saturated, a queue
  in each), started --settle s before the first urgent request;
* `fcfs`: the same load under `--scheduling-policy fcfs`, every priority removed.

Reported: the urgent requests' TTFT p50/p90, and the ratios priority / idle
(target <= 2x) and fcfs / priority (target >= 5x).

(b) Fairness (`fair`, and `fair fcfs` for comparison). Tenants `steady` and `burst`
send the same requests (--prompt-len -> --fair-output-len tokens) open loop, `burst`
at 3x the rate of `steady` (--fair-rate requests/s for steady), for --fair-duration s:
more than the server can run, so both queue. Output tokens each tenant received
(streamed, counted from each chunk's logprobs) from --fair-warmup s on until the end
of the window, where both are backlogged; then every request still open is cancelled.
Reported: the tokens and shares (target: within 20% of equal, min/max >= 0.8).

Each row starts a fresh `dpserve serve [MODEL] --data-parallel-size 2
--threads-per-engine 1 --max-num-seqs N --api-key-file KEYS` (bench/dp_scaling.py's
ServeProcess: bounded start, whole tree stopped); the tenants are the names of the
keys (one key per tenant, written to a 0600 file for the run). The markdown section
for a file in bench/results/ goes to stdout (--out FILE appends it). Exit status 0 when every
row ran and no request failed (requests cancelled at a row's end do not count).

    .venv/bin/python bench/priority.py [--rows idle,priority,fcfs,fair,fair fcfs]
    .venv/bin/python bench/priority.py --smoke   # a tiny load per row: a check, no timing

Timings need an otherwise idle machine. Not here: tenant limits (429), several API
servers (every one runs the same policy; the engines order the queue).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from dp_scaling import ServeProcess, _free_port, _log, begin, machine, parse_rows, publish, run_rows

from dpserve.benchmark.serve import Latency

ROWS = ("idle", "priority", "fcfs", "fair", "fair fcfs")
KEYS = {name: f"{name}-bench-key-{i:04d}-0123456789" for i, name in
        enumerate(("urgent", "batch", "steady", "burst"))}
URGENT, LOW = -10, 10  # the priorities of (a)
SMOKE = dict(urgent_requests=3, urgent_gap=0.0, urgent_output_len=4, low_concurrency=4,
             low_output_len=16, settle=0.5, prompt_len=16, fair_rate=2.0,
             fair_duration=3.0, fair_warmup=1.0, fair_output_len=8, warmup=1)


@dataclass
class Outcome:
    """One row."""

    name: str
    command: str
    ttfts: list[float] = field(default_factory=list)  # urgent requests completed (s)
    failed: int = 0  # requests of any tenant that failed (not those cancelled at the end)
    background_done: int = 0  # batch requests completed during the row
    tokens: dict[str, int] = field(default_factory=dict)  # fairness: tenant -> tokens
    ready_s: float = 0.0
    error: str = ""
    notes: tuple[str, ...] = ()

    @property
    def ttft(self) -> Latency | None:
        return Latency.of(self.ttfts)


# ---------------------------------------------------------------- load


class Client:
    """Streamed completions as the tenants send them (random token prompts)."""

    def __init__(self, http: httpx.AsyncClient, url: str, model: str, vocab: int,
                 seed: int) -> None:
        self.http, self.url, self.model, self.vocab = http, url, model, vocab
        self.rng = random.Random(seed)

    async def stream(self, tenant: str, prompt_len: int, max_tokens: int, priority: int,
                     on_tokens: Callable[[int], None] | None = None) -> float:
        """One request to the end; its TTFT (s). `on_tokens(n)` for each chunk's tokens.
        A priority of 0 is not sent (fcfs rows send none)."""
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "logprobs": 0,
                "prompt": [self.rng.randrange(100, self.vocab) for _ in range(prompt_len)],
                **({"priority": priority} if priority else {})}
        start, ttft = time.monotonic(), None
        async with self.http.stream("POST", self.url + "/v1/completions", json=body,
                                    headers={"Authorization": f"Bearer {KEYS[tenant]}"}
                                    ) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"{resp.status_code}: {(await resp.aread())[:300]!r}")
            buffer = ""
            async for text in resp.aiter_text():
                buffer += text
                *events, buffer = buffer.split("\n\n")
                for event in events:
                    if not event.startswith("data: {"):
                        continue
                    chunk = json.loads(event.removeprefix("data: "))
                    if "error" in chunk:
                        raise RuntimeError(str(chunk["error"])[:300])
                    n = sum(len((c.get("logprobs") or {}).get("tokens") or [None])
                            for c in chunk.get("choices", []))
                    if n and ttft is None:
                        ttft = time.monotonic() - start
                    if n and on_tokens is not None:
                        on_tokens(n)
        if ttft is None:
            raise RuntimeError("no token came")
        return ttft


async def background(client: Client, args: argparse.Namespace, priority: int,
                     out: Outcome) -> None:
    """--low-concurrency streams of tenant `batch`, one after another each, until
    cancelled."""

    async def worker() -> None:
        while True:
            try:
                await client.stream("batch", args.prompt_len, args.low_output_len, priority)
                out.background_done += 1
            except (RuntimeError, httpx.HTTPError) as e:
                out.failed += 1
                _log(f"  batch request failed: {e}")
                await asyncio.sleep(0.1)

    await asyncio.gather(*[worker() for _ in range(args.low_concurrency)])


async def urgent_row(client: Client, args: argparse.Namespace, out: Outcome,
                     loaded: bool, priorities: bool) -> None:
    """(a): the urgent series, alone or over the batch load."""
    load = None
    if loaded:
        load = asyncio.create_task(background(client, args, LOW if priorities else 0, out))
        await asyncio.sleep(args.settle)
    try:
        for _ in range(args.urgent_requests):
            try:
                out.ttfts.append(await client.stream(
                    "urgent", args.prompt_len, args.urgent_output_len,
                    URGENT if priorities else 0))
            except (RuntimeError, httpx.HTTPError) as e:
                out.failed += 1
                _log(f"  urgent request failed: {e}")
            await asyncio.sleep(args.urgent_gap)
    finally:
        if load is not None:
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load


async def fair_row(client: Client, args: argparse.Namespace, out: Outcome) -> None:
    """(b): steady and burst (3x its rate) open loop; tokens counted in the window."""
    counting_from = time.monotonic() + args.fair_warmup
    end = time.monotonic() + args.fair_duration
    out.tokens = {"steady": 0, "burst": 0}
    tasks: list[asyncio.Task] = []

    def counter(tenant: str):
        def count(n: int) -> None:
            if counting_from <= time.monotonic() <= end:
                out.tokens[tenant] += n
        return count

    async def sender(tenant: str, rate: float) -> None:
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(client.stream(
                tenant, args.prompt_len, args.fair_output_len, 0, counter(tenant))))
            await asyncio.sleep(1.0 / rate)

    await asyncio.gather(sender("steady", args.fair_rate), sender("burst", 3 * args.fair_rate))
    await asyncio.sleep(max(0.0, end - time.monotonic()))
    for task in tasks:
        task.cancel()
    ends = await asyncio.gather(*tasks, return_exceptions=True)
    out.failed += sum(isinstance(e, Exception) for e in ends)  # not the cancelled ones


# ---------------------------------------------------------------- rows


def serve_options(args: argparse.Namespace, row: str, keys: Path) -> tuple[str, ...]:
    policy = "fcfs" if "fcfs" in row else "priority"
    return ("--data-parallel-size", "2", "--threads-per-engine", "1",
            "--max-num-seqs", str(args.max_num_seqs), "--scheduling-policy", policy,
            "--api-key-file", str(keys), *args.serve_arg)


async def _run(url: str, args: argparse.Namespace, row: str, vocab: int,
               out: Outcome) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10),
                                 limits=httpx.Limits(max_connections=None)) as http:
        headers = {"Authorization": f"Bearer {KEYS['urgent']}"}
        model = (await http.get(url + "/v1/models", headers=headers)).json()["data"][0]["id"]
        client = Client(http, url, model, vocab, args.seed)
        for _ in range(args.warmup):
            await client.stream("urgent", args.prompt_len, 4, 0)
        if row.startswith("fair"):
            await fair_row(client, args, out)
        else:
            await urgent_row(client, args, out, loaded=row != "idle",
                             priorities=row != "fcfs")


def run_row(args: argparse.Namespace, row: str, vocab: int, keys: Path,
            log_path: Path) -> Outcome:
    """A fresh server for this row, its load, the server stopped."""
    server = ServeProcess(args.model, args.port or _free_port(),
                          serve_options(args, row, keys), log_path)
    out = Outcome(row, shlex.join(["dpserve", "serve", *server.argv[4:]]))
    _log(f"  starting: {out.command}")
    try:
        with server:
            out.ready_s = server.start(args.start_timeout)
            asyncio.run(_run(server.url, args, row, vocab, out))
            server.check_alive()
    except (RuntimeError, OSError, httpx.HTTPError, asyncio.TimeoutError) as e:
        out.error = f"{type(e).__name__}: {e}"
        _log(f"  error: {out.error}")
    out.notes = tuple(server.notes)
    if out.tokens:
        _log(f"  tokens: {out.tokens}")
    elif out.ttfts:
        _log(f"  urgent TTFT p50 {_s(out.ttft, 'p50')} over {len(out.ttfts)} requests; "
             f"{out.background_done} batch requests done")
    return out


# ---------------------------------------------------------------- markdown


def _s(lat: Latency | None, key: str) -> str:
    return "n/a" if lat is None else f"{getattr(lat, key) / 1000:.3f} s"


def urgent_table(outcomes: list[Outcome]) -> list[str]:
    rows = [o for o in outcomes if not o.name.startswith("fair")]
    if not rows:
        return []
    lines = ["| row | urgent TTFT p50 | TTFT p90 | urgent requests | batch requests done |",
             "| --- " * 5 + "|"]
    for o in rows:
        done = f"{len(o.ttfts)} ok" + (f"; {o.failed} failed (any tenant)" if o.failed
                                       else "")
        if o.error:
            done += f"; error: {(o.error.splitlines() or [''])[0][:100]}"
        lines.append(f"| {o.name} | {_s(o.ttft, 'p50')} | {_s(o.ttft, 'p90')} | {done} | "
                     f"{o.background_done if o.name != 'idle' else '-'} |")
    by = {o.name: o.ttft for o in rows}
    idle, prio, fcfs = by.get("idle"), by.get("priority"), by.get("fcfs")
    if idle and prio and idle.p50:
        lines += ["", f"- priority under load / idle: urgent TTFT p50 "
                      f"**{prio.p50 / idle.p50:.2f}x** (target <= 2x)"]
    if prio and fcfs and prio.p50:
        lines += [f"- fcfs / priority under load: urgent TTFT p50 "
                  f"**{fcfs.p50 / prio.p50:.2f}x** (target >= 5x)"]
    return lines


def fair_table(outcomes: list[Outcome]) -> list[str]:
    rows = [o for o in outcomes if o.name.startswith("fair")]
    if not rows:
        return []
    lines = ["", "| row | steady tokens | burst (3x rate) tokens | steady share | "
                 "min / max |", "| --- " * 5 + "|"]
    for o in rows:
        steady, burst = o.tokens.get("steady", 0), o.tokens.get("burst", 0)
        total, most = steady + burst, max(steady, burst)
        share = f"{100 * steady / total:.1f}%" if total else "n/a"
        ratio = f"{min(steady, burst) / most:.2f}" if most else "n/a"
        if o.failed:
            ratio += f"; {o.failed} requests failed"
        if o.error:
            ratio += f"; error: {(o.error.splitlines() or [''])[0][:100]}"
        lines.append(f"| {o.name} | {steady} | {burst} | {share} | {ratio} |")
    return lines + ["", "- target (fair): min / max >= 0.8 (within 20% of equal shares)"]


def markdown(args: argparse.Namespace, outcomes: list[Outcome]) -> str:
    model = args.model or "default (SmolLM2-135M-Instruct)"
    lines = [
        f"\n## Priorities and tenant fairness at DP=2 (bench/priority.py), "
        f"{datetime.datetime.now().isoformat(sep=' ', timespec='minutes')}\n",
        f"- machine: {machine()}",
        f"- command: `python {shlex.join(sys.argv)}`",
        f"- model: {model}; completions of {args.prompt_len} random token ids, "
        f"ignore_eos, temperature 0, streamed, seed {args.seed}, {args.warmup} warm-up "
        f"requests per row",
        f"- (a) urgent: {args.urgent_requests} requests one after another "
        f"({args.urgent_gap:g} s apart), priority {URGENT} (none under fcfs), -> "
        f"{args.urgent_output_len} tokens; load: tenant batch, {args.low_concurrency} "
        f"streams in flight of {args.low_output_len} tokens, priority {LOW} (none under "
        f"fcfs), from {args.settle:g} s before",
        f"- (b) fair: tenants steady ({args.fair_rate:g} requests/s) and burst "
        f"({3 * args.fair_rate:g}/s), {args.fair_output_len} tokens each, for "
        f"{args.fair_duration:g} s; tokens counted from {args.fair_warmup:g} s on",
        f"- server: `dpserve serve [MODEL] --port PORT "
        f"{shlex.join(serve_options(args, 'priority', Path('KEYS')))}` (the fcfs rows: "
        f"`--scheduling-policy fcfs`); start to ready: "
        f"{', '.join(f'{o.ready_s:.1f} s' for o in outcomes if o.ready_s) or 'n/a'}",
        "", *urgent_table(outcomes), *fair_table(outcomes)]
    lines += [f"- note ({o.name}): {n}" for o in outcomes for n in o.notes]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: built-in SmolLM2-135M-Instruct")
    p.add_argument("--rows", default=",".join(ROWS),
                   help=f"comma-separated, from {', '.join(ROWS)} (default: all)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of each request")
    p.add_argument("--max-num-seqs", type=int, default=8, help="each engine's running limit")
    p.add_argument("--urgent-requests", type=int, default=20)
    p.add_argument("--urgent-gap", type=float, default=0.5, help="seconds between them")
    p.add_argument("--urgent-output-len", type=int, default=16)
    p.add_argument("--low-concurrency", type=int, default=48, help="batch streams in flight")
    p.add_argument("--low-output-len", type=int, default=128)
    p.add_argument("--settle", type=float, default=10.0,
                   help="seconds of batch load before the first urgent request")
    p.add_argument("--fair-rate", type=float, default=2.0, help="steady's requests/s")
    p.add_argument("--fair-duration", type=float, default=60.0)
    p.add_argument("--fair-warmup", type=float, default=15.0,
                   help="seconds before tokens count (the queues fill)")
    p.add_argument("--fair-output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=4, help="requests per row before the load")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="an extra `dpserve serve` argument for every row (repeatable)")
    p.add_argument("--port", type=int, default=0, help="port (default: a free one per row)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--smoke", action="store_true",
                   help="a tiny load per row: checks that the script runs, measures nothing")
    p.add_argument("--out", metavar="FILE", help="also append the markdown to FILE")
    args = p.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    for name in ("prompt_len", "max_num_seqs", "urgent_requests", "urgent_output_len",
                 "low_concurrency", "low_output_len", "fair_output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.fair_rate <= 0 or args.fair_duration <= args.fair_warmup:
        p.error("--fair-rate must be positive and --fair-duration above --fair-warmup")
    args.rows = parse_rows(p, args.rows, ROWS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vocab = begin("priority", args.model)
    if vocab is None:
        return 2
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="priority_") as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text("".join(f"{name} {key}\n" for name, key in KEYS.items()))
        keys.chmod(0o600)
        outcomes = run_rows(args.rows, lambda row, log: run_row(args, row, vocab, keys, log),
                            Path(tmp))
    if outcomes is None:
        return 130
    publish(markdown(args, outcomes), args.out, start)
    ok = all(not o.error and not o.failed for o in outcomes) and all(
        len(o.ttfts) == args.urgent_requests or o.name.startswith("fair") for o in outcomes)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
