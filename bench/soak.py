"""Does a loaded `dpserve serve` keep its memory flat? A soak, measured per process.

A fresh server (default: --data-parallel-size 2 --kv-cache-memory 128MiB
--max-model-len 1024, a KV cache small enough to be fully in use within the first
minute) gets --minutes of mixed closed-loop load from --clients clients:

* completions, streamed or not (half and half);
* prompts of 3 to 200 words, 4 to 64 output tokens, temperature 0 or 0.8;
* one stream in eight dropped by the client after a few chunks.

Every --sample-s seconds the resident memory (RSS) of each process of the server is
printed (launcher, API servers, coordinator, each engine), with requests done so
far. At the end: requests ok / failed / dropped, requests still running or waiting
on any engine (from /metrics; must be 0), and per process its RSS at the end of
the warm-up (--warmup-s, default 120 s), at the end, the most it grew above the
warm-up figure and its trend (MB per minute, least squares after the warm-up).

    .venv/bin/python bench/soak.py [--minutes 30] [--label "after fix"] [--out FILE]
    .venv/bin/python bench/soak.py --serve-arg=--kv-cache-memory=2GiB

Exit status 0 when no request failed, nothing was left running and no process grew
by more than --limit-mb (default 25) after the warm-up. Memory figures do not need
an idle machine; requests per second do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import random
import re
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from dp_scaling import ServeProcess, _descendants, _free_port, machine

_WORDS = ("an engine replica serves the same model as its peers while a coordinator "
          "balances requests across them and keeps their waves in step so that no rank "
          "waits for another longer than one step of decoding").split()
_MB = 2**20


@dataclass
class Load:
    """Outcome counters of the client side."""

    ok: int = 0
    dropped: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.failed += 1
        if len(self.errors) < 5:
            self.errors.append(what)


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 200)))


async def _one_request(client: httpx.AsyncClient, model: str, rng: random.Random,
                       load: Load) -> None:
    stream = rng.random() < 0.5
    drop_after = rng.randint(1, 3) if stream and rng.random() < 1 / 8 else 0
    body = {"model": model, "prompt": _prompt(rng), "max_tokens": rng.randint(4, 64),
            "temperature": rng.choice((0.0, 0.8)), "stream": stream}
    try:
        if not stream:
            resp = await client.post("/v1/completions", json=body)
            if resp.status_code != 200 or not resp.json()["choices"]:
                load.fail(f"HTTP {resp.status_code}: {resp.text[:200]}")
            else:
                load.ok += 1
            return
        chunks = 0
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                load.fail(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    load.ok += 1
                    return
                data = json.loads(line[6:])
                if "error" in data:
                    load.fail(f"in-stream error: {data['error']}")
                    return
                chunks += 1
                if drop_after and chunks >= drop_after:
                    load.dropped += 1  # leaving the block closes the connection
                    return
        load.fail("stream ended without [DONE]")
    except httpx.HTTPError as e:
        load.fail(f"{type(e).__name__}: {e}")


async def _client_loop(url: str, model: str, seed: int, deadline: float, load: Load) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            await _one_request(client, model, rng, load)


def _label(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        cmdline = proc.cmdline()
        title = cmdline[0] if cmdline else proc.name()
        if title.startswith("dpserve::"):
            return title[len("dpserve::"):].split()[0]
        if "resource_tracker" in " ".join(cmdline):
            return "resource_tracker"  # multiprocessing's helper
        return "launcher" if "dpserve.cli" in " ".join(cmdline) else proc.name()
    return f"pid{proc.pid}"


def _rss_by_process(root: psutil.Process) -> dict[str, float]:
    """MB resident per process of the server (the launcher and its tree)."""
    rss: dict[str, float] = {}
    for proc in [root, *_descendants(root.pid)]:
        with contextlib.suppress(psutil.Error):
            name = _label(proc)
            rss[name] = proc.memory_info().rss / _MB
    return rss


def _running_and_waiting(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    totals = []
    for metric in ("dpserve:num_requests_running", "dpserve:num_requests_waiting"):
        totals.append(sum(float(m.group(1)) for m in re.finditer(
            rf"^{metric}(?:{{[^}}]*}})? (\S+)$", text, re.M)))
    return totals[0], totals[1]


def _trend(points: list[tuple[float, float]]) -> float:
    """Least-squares slope in MB per minute of (seconds, MB) points."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    sxx = sum((t - mx) ** 2 for t, _ in points)
    return 60 * sum((t - mx) * (v - my) for t, v in points) / sxx if sxx else 0.0


@dataclass
class Soak:
    args: argparse.Namespace
    load: Load = field(default_factory=Load)
    samples: list[tuple[float, int, dict[str, float]]] = field(default_factory=list)
    left_running: tuple[float, float] = (0.0, 0.0)
    seconds: float = 0.0

    def growth(self) -> dict[str, tuple[float, float, float, float]]:
        """Per process: (MB at warm-up end, MB at the end, most grown since, MB/min)."""
        after = [(t, r) for t, _, r in self.samples if t >= self.args.warmup_s]
        if not after:
            return {}
        base = after[0][1]
        out = {}
        for name, start in base.items():
            series = [(t, r[name]) for t, r in after if name in r]
            out[name] = (start, series[-1][1], max(v for _, v in series) - start,
                         _trend(series))
        return out

    def passed(self) -> bool:
        grown = self.growth()
        return (self.load.failed == 0 and self.left_running == (0.0, 0.0) and bool(grown)
                and all(g[2] <= self.args.limit_mb for g in grown.values()))


async def _sample_loop(soak: Soak, root: psutil.Process, t0: float, deadline: float) -> None:
    names: list[str] = []
    while True:
        now = time.monotonic()
        rss = _rss_by_process(root)
        done = soak.load.ok + soak.load.dropped + soak.load.failed
        soak.samples.append((now - t0, done, rss))
        if not names:
            names = sorted(rss)
            print("   t(s)  requests  " + "  ".join(f"{n:>14}" for n in names), flush=True)
        print(f"{now - t0:7.0f}  {done:8d}  "
              + "  ".join(f"{rss.get(n, float('nan')):11.1f} MB" for n in names), flush=True)
        if now >= deadline:
            return
        await asyncio.sleep(min(soak.args.sample_s, max(deadline - now, 0.0)))


async def _drive(soak: Soak, server: ServeProcess) -> None:
    args = soak.args
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
    assert server.proc is not None
    root = psutil.Process(server.proc.pid)
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    clients = [asyncio.create_task(_client_loop(server.url, model, args.seed + i, deadline,
                                                soak.load)) for i in range(args.clients)]
    sampler = asyncio.create_task(_sample_loop(soak, root, t0, deadline))
    await asyncio.gather(*clients)
    soak.seconds = time.monotonic() - t0
    await sampler
    await asyncio.sleep(1.0)  # let aborts of the last drops reach the engines
    soak.left_running = _running_and_waiting(server.url)
    soak.samples.append((time.monotonic() - t0, soak.load.ok + soak.load.dropped
                         + soak.load.failed, _rss_by_process(root)))


def report(soak: Soak) -> str:
    load, args = soak.load, soak.args
    lines = [f"requests: {load.ok} ok, {load.dropped} dropped by the client, "
             f"{load.failed} failed in {soak.seconds:.0f} s "
             f"({(load.ok + load.dropped) / max(soak.seconds, 1):.2f} req/s); "
             f"left running/waiting on the engines: {soak.left_running[0]:g}/"
             f"{soak.left_running[1]:g}"]
    lines += [f"  error: {e}" for e in load.errors]
    lines.append(f"RSS after the {args.warmup_s:g} s warm-up -> end (MB); most grown since; "
                 f"trend:")
    for name, (start, end, grown, slope) in sorted(soak.growth().items()):
        flag = "" if grown <= args.limit_mb else f"   > {args.limit_mb:g} MB"
        lines.append(f"  {name:>14}: {start:8.1f} -> {end:8.1f}   +{grown:6.1f}   "
                     f"{slope:+6.2f} MB/min{flag}")
    lines.append("PASS" if soak.passed() else "FAIL")
    return "\n".join(lines)


def markdown(soak: Soak, command: str) -> str:
    args, load = soak.args, soak.load
    rows = ["| process | RSS at warm-up end (MB) | RSS at end (MB) | most grown since (MB) "
            "| trend (MB/min) |", "|---|---|---|---|---|"]
    for name, (start, end, grown, slope) in sorted(soak.growth().items()):
        rows.append(f"| {name} | {start:.1f} | {end:.1f} | {grown:+.1f} | {slope:+.2f} |")
    when = datetime.datetime.now().isoformat(sep=" ", timespec="minutes")
    return "\n".join([
        f"\n## memory soak (bench/soak.py){' — ' + args.label if args.label else ''}, {when}\n",
        f"- machine: {machine()}",
        f"- command: `{command}`",
        f"- server: `dpserve serve {shlex.join(soak_server_options(args))}`",
        f"- load: {args.clients} clients, {args.minutes:g} min; {load.ok} ok, "
        f"{load.dropped} dropped by the client, {load.failed} failed; left running/waiting: "
        f"{soak.left_running[0]:g}/{soak.left_running[1]:g}; verdict "
        f"{'PASS' if soak.passed() else 'FAIL'} (limit {args.limit_mb:g} MB after "
        f"{args.warmup_s:g} s)",
        "", *rows, ""])


def soak_server_options(args: argparse.Namespace) -> list[str]:
    return ["--data-parallel-size", str(args.dp), "--kv-cache-memory", args.kv_cache_memory,
            "--max-model-len", "1024", *args.serve_arg]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model (default: the default model)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--dp", type=int, default=2, help="--data-parallel-size")
    parser.add_argument("--kv-cache-memory", default="128MiB")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--sample-s", type=float, default=10.0,
                        help="seconds between memory samples")
    parser.add_argument("--warmup-s", type=float, default=120.0,
                        help="growth is measured from the first sample after this")
    parser.add_argument("--limit-mb", type=float, default=25.0,
                        help="most a process may grow after the warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra `dpserve serve` argument (repeatable; use --serve-arg=...)")
    parser.add_argument("--label", default="", help="a word on this run for BENCHMARKS.md")
    parser.add_argument("--out", type=Path, default=None, help="append results to this file")
    args = parser.parse_args()

    log = Path(tempfile.mkstemp(prefix="dpserve-soak-", suffix=".log")[1])
    server = ServeProcess(args.model, _free_port(), tuple(soak_server_options(args)), log)
    soak = Soak(args)
    # A SIGTERM stops the server too (the finally below), rather than orphaning it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    print(f"server log: {log}", flush=True)
    try:
        server.start(timeout=600)
        asyncio.run(_drive(soak, server))
    finally:
        print(f"server stop: {server.stop()}", flush=True)
    print(report(soak))
    if args.out:
        command = "python " + shlex.join(sys.argv)
        with open(args.out, "a") as f:
            f.write(markdown(soak, command))
    return 0 if soak.passed() else 1


if __name__ == "__main__":
    sys.exit(main())
