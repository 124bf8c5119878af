"""Prefix-cache-aware routing at DP=2: `--load-balance least-loaded` vs `cache-aware`.

The workload (issue 15): --sessions sessions, each a shared prefix of
--prefix-len random tokens (a long system prompt or document) plus --turns short
turns (--turn-len fresh tokens after the prefix, --output-len output tokens,
ignore_eos, temperature 0). The turns go in rounds (turn t of every session, in a
seeded shuffled order per round), --concurrency requests in flight (closed loop).
Each engine's KV cache (`--num-kv-blocks`) holds about half the prefixes plus room
for the running turns' own blocks, so an engine that sees every session cycles
through more prefixes than it holds, and one that sees only its half keeps them.

Each row starts a fresh `dpserve serve [MODEL] --data-parallel-size 2
--threads-per-engine 1 --num-kv-blocks N --max-model-len M --load-balance POLICY`
(bench/dp_scaling.py's ServeProcess: bounded start, whole tree stopped), sends
--warmup random short requests, then the measured load with the code behind
`dpserve bench serve` (dpserve.benchmark.serve.run_benchmark, the prompts given).
Reported per policy: output tok/s, TTFT p50/p90, the prefix-cache hit rate over the
measured load (dpserve:prefix_cache_hits / dpserve:prefix_cache_queries in /metrics,
both engines, differences around it), the requests; then cache-aware's ratios to
least-loaded. The markdown section for BENCHMARKS.md goes to stdout (--out FILE
appends it there too). Exit status 0 when every measured request of every row completed.

    .venv/bin/python bench/prefix_routing.py [--sessions 32 --prefix-len 1024 ...]
    .venv/bin/python bench/prefix_routing.py --sessions 8 --prefix-len 256 --turns 3 \\
        --concurrency 4    # a quick check, not a measurement

Timings need an otherwise idle machine. Not here: several API servers (each tracks
only its own sends), chat templates, multi-turn prompts that grow with the answers.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import random
import re
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
from dp_scaling import (
    ServeProcess,
    _bench,
    _free_port,
    _log,
    _on_sigterm,
    begin,
    machine,
    publish,
    run_rows,
)

from dpserve.benchmark.serve import BenchConfig, BenchResult, Latency, run_benchmark
from dpserve.frontend.routing import LOAD_BALANCE_POLICIES

POLICIES = ("least-loaded", "cache-aware")
BLOCK_SIZE = 16  # the engines' default --block-size


@dataclass
class Outcome:
    """One policy's row."""

    policy: str
    command: str
    result: BenchResult | None = None
    hits: float = 0.0  # prefix-cache tokens hit during the measured load (both engines)
    queries: float = 0.0  # prefix-cache tokens looked up during it
    ready_s: float = 0.0
    error: str = ""
    notes: tuple[str, ...] = ()

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """Every (session, turn) prompt, in sending order: rounds of turns, each round's
    sessions in a seeded shuffled order."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(100, vocab) for _ in range(args.prefix_len)]
                for _ in range(args.sessions)]
    prompts = []
    for _ in range(args.turns):
        order = list(range(args.sessions))
        rng.shuffle(order)
        prompts += [prefixes[s] + [rng.randrange(100, vocab) for _ in range(args.turn_len)]
                    for s in order]
    return prompts


def kv_blocks(args: argparse.Namespace) -> int:
    """Per engine: half the sessions' prefixes, plus every running turn's own blocks."""
    if args.num_kv_blocks:
        return args.num_kv_blocks
    prefix_blocks = args.prefix_len // BLOCK_SIZE
    own = math.ceil((args.prefix_len % BLOCK_SIZE + args.turn_len + args.output_len)
                    / BLOCK_SIZE) + 1
    return math.ceil(args.sessions / 2) * prefix_blocks + args.concurrency * own


def serve_options(args: argparse.Namespace, policy: str) -> tuple[str, ...]:
    max_len = args.prefix_len + args.turn_len + args.output_len
    return ("--data-parallel-size", "2", "--threads-per-engine", "1",
            "--num-kv-blocks", str(kv_blocks(args)), "--max-model-len", str(max_len),
            "--load-balance", policy, *args.serve_arg)


def prefix_counts(url: str) -> tuple[float, float]:
    """(hits, queries) of the prefix cache, summed over the engines, from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(float(m.group(1)) for m in re.finditer(
            rf"^dpserve:{name}_total(?:{{.*}})? (\S+)$", text, re.M))
    return total("prefix_cache_hits"), total("prefix_cache_queries")


def run_row(args: argparse.Namespace, policy: str, config: BenchConfig,
            prompts: list[list[int]], log_path: Path) -> Outcome:
    """A fresh server with this policy, warm-up, the measured load, the server stopped."""
    server = ServeProcess(args.model, args.port or _free_port(), serve_options(args, policy),
                          log_path)
    out = Outcome(policy, shlex.join(["dpserve", "serve", *server.argv[4:]]))
    _log(f"  starting: {out.command}")
    try:
        with server:
            out.ready_s = server.start(args.start_timeout)
            if args.warmup:
                asyncio.run(_bench(replace(config, base_url=server.url,
                                           num_prompts=args.warmup, prompt_len=32)))
            hits0, queries0 = prefix_counts(server.url)
            _log(f"  ready in {out.ready_s:.1f} s; {len(prompts)} requests ...")
            out.result = asyncio.run(run_measured(replace(config, base_url=server.url),
                                                  prompts))
            hits1, queries1 = prefix_counts(server.url)
            out.hits, out.queries = hits1 - hits0, queries1 - queries0
            server.check_alive()
    except (RuntimeError, OSError, httpx.HTTPError, asyncio.TimeoutError) as e:
        out.error = f"{type(e).__name__}: {e}"
        _log(f"  error: {out.error}")
    out.notes = tuple(server.notes)
    if out.result is not None:
        r = out.result
        _log(f"  {r.output_throughput:.1f} output tok/s, TTFT p50 {_s(r.ttft_ms, 'p50')}, "
             f"hit rate {_pct(out.hit_rate)}, {r.completed} ok / {r.failed} failed / "
             f"{r.not_sent} not sent in {r.duration_s:.1f} s")
    return out


async def run_measured(config: BenchConfig, prompts: list[list[int]]) -> BenchResult:
    """run_benchmark with these prompts; SIGTERM cancels it (as dp_scaling._bench)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await run_benchmark(config, prompts)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)


# ---------------------------------------------------------------- markdown


def _s(lat: Latency | None, key: str) -> str:
    return "n/a" if lat is None else f"{getattr(lat, key) / 1000:.2f} s"


def _pct(rate: float | None) -> str:
    return "n/a" if rate is None else f"{100 * rate:.1f}%"


def table(outcomes: list[Outcome]) -> list[str]:
    lines = ["| balancer | output tok/s | TTFT p50 | TTFT p90 | prefix-cache hit rate | "
             "requests |", "| --- " * 6 + "|"]
    for o in outcomes:
        r = o.result
        if r is None:
            why = (o.error.splitlines() or ["no result"])[0][:120]
            lines.append(f"| {o.policy} | n/a | n/a | n/a | n/a | error: {why} |")
            continue
        req = f"{r.completed} ok" + (f", {r.failed} failed, {r.not_sent} not sent"
                                     if r.failed or r.not_sent else "")
        lines.append(f"| {o.policy} | {r.output_throughput:.1f} | {_s(r.ttft_ms, 'p50')} | "
                     f"{_s(r.ttft_ms, 'p90')} | {_pct(o.hit_rate)} | {req} |")
    return lines


def ratios(outcomes: list[Outcome]) -> list[str]:
    by = {o.policy: o.result for o in outcomes}
    base, aware = by.get("least-loaded"), by.get("cache-aware")
    if base is None or aware is None or not base.output_throughput or base.ttft_ms is None \
            or aware.ttft_ms is None:
        return []
    return ["", f"- cache-aware / least-loaded: output tok/s "
                f"**{aware.output_throughput / base.output_throughput:.2f}x** (target >= 1.5x), "
                f"TTFT p50 **{aware.ttft_ms.p50 / base.ttft_ms.p50:.2f}x** (target <= 0.6x)"]


def markdown(args: argparse.Namespace, outcomes: list[Outcome]) -> str:
    model = args.model or "default (SmolLM2-135M-Instruct)"
    lines = [
        f"\n## prefix-cache-aware routing (bench/prefix_routing.py), "
        f"{datetime.datetime.now().isoformat(sep=' ', timespec='minutes')}\n",
        f"- machine: {machine()}",
        f"- command: `python {shlex.join(sys.argv)}`",
        f"- model: {model}; load: {args.sessions} sessions x {args.turns} turns = "
        f"{args.sessions * args.turns} requests, each a {args.prefix_len}-token session "
        f"prefix + {args.turn_len} fresh tokens -> {args.output_len} output tokens "
        f"(completions, random token ids, ignore_eos, temperature 0, seed {args.seed}), "
        f"in rounds of turns, concurrency {args.concurrency}, {args.warmup} warm-up "
        f"requests first",
        f"- each engine: `--num-kv-blocks {kv_blocks(args)}` (block size {BLOCK_SIZE}): "
        f"{math.ceil(args.sessions / 2)} of the {args.sessions} prefixes plus room for "
        f"the running turns",
        f"- server: `dpserve serve [MODEL] --port PORT "
        f"{shlex.join(serve_options(args, 'POLICY'))}`; start to ready: "
        f"{', '.join(f'{o.ready_s:.1f} s' for o in outcomes if o.ready_s) or 'n/a'}",
        "", *table(outcomes), *ratios(outcomes)]
    lines += [f"- note ({o.policy}): {n}" for o in outcomes for n in o.notes]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main


def add_run_options(p: argparse.ArgumentParser, max_duration: float) -> None:
    """The options of how each row runs, shared by the session benchmarks (this one,
    kv_tier.py, pd.py): warm-up, the row's time limit, extra serve arguments, port,
    start-up limit."""
    p.add_argument("--warmup", type=int, default=4, help="random warm-up requests per row")
    p.add_argument("--max-duration", type=float, default=max_duration,
                   help="seconds one row's measured load may take")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="an extra `dpserve serve` argument for every row (repeatable)")
    p.add_argument("--port", type=int, default=0, help="port (default: a free one per row)")
    p.add_argument("--start-timeout", type=float, default=300.0,
                   help="seconds a server may take to answer /health")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: built-in SmolLM2-135M-Instruct")
    p.add_argument("--sessions", type=int, default=32, help="sessions (distinct prefixes)")
    p.add_argument("--prefix-len", type=int, default=1024, help="tokens of each prefix")
    p.add_argument("--turns", type=int, default=4, help="requests per session")
    p.add_argument("--turn-len", type=int, default=32, help="fresh tokens per turn")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per turn")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--num-kv-blocks", type=int, default=0,
                   help="KV blocks per engine (default: half the prefixes + running turns)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated --load-balance values (default: {','.join(POLICIES)})")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and order")
    add_run_options(p, max_duration=900.0)
    p.add_argument("--out", metavar="FILE", help="also append the markdown to FILE")
    args = p.parse_args(argv)
    for name in ("sessions", "prefix_len", "turns", "turn_len", "output_len", "concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.num_kv_blocks < 0:
        p.error("--warmup and --num-kv-blocks must not be negative")
    args.policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    bad = set(args.policies) - set(LOAD_BALANCE_POLICIES)
    if bad or not args.policies:
        p.error(f"--policies: unknown {sorted(bad)}; choose from "
                f"{', '.join(LOAD_BALANCE_POLICIES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_bench("prefix_routing", args, args.policies, make_prompts, run_row, markdown)


def run_bench(name: str, args: argparse.Namespace, rows: list[str],
              make_prompts: Callable, run_row: Callable, markdown: Callable) -> int:
    """The shared driver of the session benchmarks (this one, kv_tier.py): one server
    per row in turn, the same measured sessions; the markdown to stdout (and
    --out); 0 when every measured request of every row completed."""
    vocab = begin(name, args.model)
    if vocab is None:
        return 2
    prompts = make_prompts(args, vocab)
    config = BenchConfig(num_prompts=len(prompts), concurrency=args.concurrency,
                         prompt_len=args.prefix_len + args.turn_len,
                         output_len=args.output_len, vocab_size=vocab, seed=args.seed,
                         warmup=0, max_duration=args.max_duration)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"{name}_") as tmp:
        outcomes = run_rows(rows, lambda row, log: run_row(args, row, config, prompts, log),
                            Path(tmp))
    if outcomes is None:
        return 130
    publish(markdown(args, outcomes), args.out, start)
    ok = all(o.result is not None and o.result.completed == len(prompts) for o in outcomes)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
