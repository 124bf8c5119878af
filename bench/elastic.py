"""Scaling at run time under steady load: how fast a new rank serves, how long a
rank takes to leave, and throughput while it happens.

A fresh `dpserve serve MODEL --data-parallel-size 1 --data-parallel-size-max 2
--enable-admin-api` (the default model unless --model) gets --clients closed-loop
streaming clients (--output-len tokens each, ignore_eos). After --warmup-s:
`POST /scale_elastic_ep {"new_data_parallel_size": 2}`; after --hold-s more:
back to 1; then --tail-s of load at one engine. Printed:

* up: the scale call's duration, and the time from the call to the first request
  finished by rank 1 (dpserve:engine_requests_finished{engine="1"}, polled every 0.1 s);
* down: the scale call's duration under load (drain + stop);
* streamed chunks (about one token each) per second in 1 s buckets, with the
  events;
* requests ok / failed (any failure is a bug: exit status 1).

    .venv/bin/python bench/elastic.py [--model DIR] [--clients 16] [--out FILE]
    .venv/bin/python bench/elastic.py --serve-arg=--api-server-count=2

Timings need an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import free_port, wait_healthy  # noqa: E402


@dataclass
class Run:
    start: float = field(default_factory=time.monotonic)
    tokens: list[float] = field(default_factory=list)  # time of each streamed chunk
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    stop: bool = False

    def mark(self, what: str) -> None:
        self.events.append((time.monotonic() - self.start, what))
        print(f"[{time.monotonic() - self.start:7.2f} s] {what}", flush=True)


async def client_loop(run: Run, http: httpx.AsyncClient, url: str, model: str, i: int,
                      output_len: int) -> None:
    body = {"model": model, "prompt": f"Client {i} tells a story:", "stream": True,
            "max_tokens": output_len, "ignore_eos": True, "temperature": 0}
    while not run.stop:
        try:
            async with http.stream("POST", url + "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    run.failed.append(f"HTTP {resp.status_code}: {await resp.aread()!r}")
                    continue
                finish = None
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line.removeprefix("data: "))
                        if "error" in chunk:
                            run.failed.append(line)
                            break
                        run.tokens.append(time.monotonic())  # a chunk: about one token
                        finish = chunk["choices"][0].get("finish_reason") or finish
                if finish == "length":
                    run.ok += 1
                else:
                    run.failed.append(f"stream ended with finish_reason {finish!r}")
        except httpx.HTTPError as e:
            run.failed.append(f"{type(e).__name__}: {e}")


def finished_by_rank(url: str, rank: int) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(
        rf'^dpserve:engine_requests_finished_total\{{[^}}]*engine="{rank}"[^}}]*\}} (\S+)$',
        text, re.M))


async def scale(run: Run, url: str, size: int) -> float:
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=1800) as http:
        resp = await http.post(url + "/scale_elastic_ep", json={"new_data_parallel_size": size})
    took = time.monotonic() - started
    if resp.status_code != 200:
        raise SystemExit(f"scale to {size} failed: HTTP {resp.status_code} {resp.text}")
    run.mark(f"scale to {size} answered 200 after {took:.2f} s")
    return took


async def first_served_by(run: Run, url: str, rank: int, since: float) -> float:
    before = await asyncio.to_thread(finished_by_rank, url, rank)
    while await asyncio.to_thread(finished_by_rank, url, rank) <= before:
        await asyncio.sleep(0.1)
    took = time.monotonic() - since
    run.mark(f"first request finished by rank {rank}, {took:.2f} s after the scale call")
    return took


async def scenario(args: argparse.Namespace, url: str, model: str) -> dict[str, float]:
    run = Run()
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        clients = [asyncio.create_task(client_loop(run, http, url, model, i, args.output_len))
                   for i in range(args.clients)]
        await asyncio.sleep(args.warmup_s)
        run.mark("scale up to 2")
        called = time.monotonic()
        first = asyncio.create_task(first_served_by(run, url, 1, called))
        up = await scale(run, url, 2)
        first_s = await first
        await asyncio.sleep(args.hold_s)
        run.mark("scale down to 1")
        down = await scale(run, url, 1)
        await asyncio.sleep(args.tail_s)
        run.stop = True
        run.mark("stopping the clients")
        await asyncio.gather(*clients)
    report(run, args)
    return {"up_s": up, "first_request_s": first_s, "down_s": down,
            "ok": run.ok, "failed": len(run.failed)}


def report(run: Run, args: argparse.Namespace) -> None:
    end = max(run.tokens, default=run.start) - run.start
    buckets = [0] * (int(end) + 1)
    for t in run.tokens:
        buckets[int(t - run.start)] += 1
    print("\n  s   chunks/s  events")
    for second, n in enumerate(buckets):
        events = "; ".join(w for t, w in run.events if int(t) == second)
        print(f"{second:4d} {n:9d}  {events}")
    print(f"\nrequests ok {run.ok}, failed {len(run.failed)}")
    for line in run.failed[:10]:
        print("  failed:", line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the built-in model")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--warmup-s", type=float, default=15.0)
    parser.add_argument("--hold-s", type=float, default=15.0)
    parser.add_argument("--tail-s", type=float, default=10.0)
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra `dpserve serve` option (repeatable)")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=None, help="append a markdown row to this file")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", prefix="dpserve-elastic-", suffix=".log")
    cmd = [sys.executable, "-m", "dpserve.cli", "serve", *([args.model] if args.model else []),
           "--port", str(port), "--data-parallel-size", "1", "--data-parallel-size-max", "2",
           "--enable-admin-api", "--allow-unauthenticated-admin", *args.serve_arg]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(proc, url, 900, describe=lambda: Path(log.name).read_text())
        model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        result = asyncio.run(scenario(args, url, model))
    finally:
        proc.terminate()
        proc.wait(60)
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"| elastic {args.label} | {args.clients} clients | up {result['up_s']:.2f} s "
                    f"| first request on the new rank {result['first_request_s']:.2f} s | down "
                    f"{result['down_s']:.2f} s | ok {result['ok']} failed {result['failed']} |\n")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
