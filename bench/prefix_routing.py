"""The balancers at DP=2 (`--load-balance`): the default against each alternative, on a
uniform load and a prefix-heavy one, with one and two API servers, one torch thread
per engine and the default threads (cache-aware is the default only while it
never loses to least-loaded beyond noise on W16 and wins on prefix-heavy loads).

Workloads (--workloads):

* uniform (W16): --uniform-requests 64 random prompts of --uniform-prompt-len 128
  tokens -> --uniform-output-len 64 (no shared prefixes), --uniform-concurrency 16;
  each engine's KV cache at its default size.
* prefix: --sessions sessions, each a shared prefix of --prefix-len random
  tokens (a long system prompt or document) plus --turns short turns (--turn-len
  fresh tokens after the prefix, --output-len output tokens), in rounds (turn t of
  every session, in a seeded shuffled order per round), --concurrency in flight.
  Each engine's KV cache (`--num-kv-blocks`) holds about half the prefixes plus
  room for the running turns, so an engine that sees every session cycles through
  more prefixes than it holds, and one that sees only its half keeps them.

Every workload runs with every --api-server-counts (1,2), --threads (1: `--threads-
per-engine 1`; default: the flag left out) and --policies: `default` (no
`--load-balance`: what a user gets), then each alternative by name (least-loaded,
round-robin, cache-aware; the default's own name again measures the run's noise).
Each row starts a fresh `dpserve serve [MODEL] --data-parallel-size 2
--api-server-count N [--threads-per-engine 1] [--load-balance POLICY] ...`
(bench/dp_scaling.py's ServeProcess: bounded start, whole tree stopped), sends
--warmup random short requests, then the measured load with the code behind `dpserve
bench serve` (dpserve.benchmark.serve.run_benchmark, the prompts given), the same
requests for every row of a workload. Reported per row: output tok/s, TTFT p50/p90,
the prefix-cache hit rate over the measured load (dpserve:prefix_cache_hits /
dpserve:prefix_cache_queries in /metrics, every engine and API server), the
requests; then per group the default's ratios to each alternative. The markdown
section for a file in bench/results/ goes to stdout (--out FILE appends it too). Exit status 0
when every measured request of every row completed.

    .venv/bin/python bench/prefix_routing.py --out bench/results/DATE-TOPIC.md   # every row (32)
    .venv/bin/python bench/prefix_routing.py --workloads prefix --api-server-counts 2 \\
        --threads 1 --policies default,least-loaded               # one group
    .venv/bin/python bench/prefix_routing.py --smoke --model DIR   # tiny: a check

Timings need an otherwise idle machine. Not here: chat templates, multi-turn prompts
that grow with the answers.
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
from dpserve.benchmark.serve import make_prompts as random_prompts
from dpserve.frontend.routing import DEFAULT_LOAD_BALANCE, LOAD_BALANCE_POLICIES

WORKLOADS = ("uniform", "prefix")
POLICIES = ("default", *LOAD_BALANCE_POLICIES)  # default: no --load-balance
BLOCK_SIZE = 16  # the engines' default --block-size
# --smoke: every size at its smallest that still shares prefixes (a check, no timing).
SMOKE = dict(uniform_requests=4, uniform_prompt_len=16, uniform_output_len=4,
             uniform_concurrency=2, sessions=2, prefix_len=48, turns=2, turn_len=8,
             output_len=4, concurrency=2, warmup=1)


@dataclass(frozen=True)
class Row:
    """One server and its load."""

    workload: str  # uniform | prefix
    api_servers: int
    threads: str  # "1" (--threads-per-engine 1) or "default" (the flag left out)
    policy: str  # a --load-balance value, or "default" (none given)

    @property
    def name(self) -> str:
        return f"{self.workload} api{self.api_servers} threads-{self.threads} {self.policy}"

    @property
    def group(self) -> tuple[str, int, str]:
        return self.workload, self.api_servers, self.threads

    @property
    def balancer(self) -> str:
        return f"default ({DEFAULT_LOAD_BALANCE})" if self.policy == "default" else self.policy


@dataclass
class Outcome:
    """One row's result."""

    row: Row
    command: str
    result: BenchResult | None = None
    hits: float = 0.0  # prefix-cache tokens hit during the measured load (every engine)
    queries: float = 0.0  # prefix-cache tokens looked up during it
    ready_s: float = 0.0
    error: str = ""
    notes: tuple[str, ...] = ()

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


@dataclass(frozen=True)
class Load:
    """A workload's measured requests and how they are sent (the same for every row)."""

    prompts: list[list[int]]
    config: BenchConfig


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


def uniform_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """W16's random prompts (no shared prefixes), seeded."""
    config = BenchConfig(prompt_len=args.uniform_prompt_len, vocab_size=vocab)
    return random_prompts(config, args.uniform_requests, args.seed)  # type: ignore[return-value]


def loads(args: argparse.Namespace, vocab: int) -> dict[str, Load]:
    """Each chosen workload's requests and load shape."""
    out = {}
    if "uniform" in args.workloads:
        prompts = uniform_prompts(args, vocab)
        out["uniform"] = Load(prompts, BenchConfig(
            num_prompts=len(prompts), concurrency=args.uniform_concurrency,
            prompt_len=args.uniform_prompt_len, output_len=args.uniform_output_len,
            vocab_size=vocab, seed=args.seed, warmup=0, max_duration=args.max_duration))
    if "prefix" in args.workloads:
        prompts = make_prompts(args, vocab)
        out["prefix"] = Load(prompts, BenchConfig(
            num_prompts=len(prompts), concurrency=args.concurrency,
            prompt_len=args.prefix_len + args.turn_len, output_len=args.output_len,
            vocab_size=vocab, seed=args.seed, warmup=0, max_duration=args.max_duration))
    return out


def kv_blocks(args: argparse.Namespace) -> int:
    """Per engine: half the sessions' prefixes, plus every running turn's own blocks."""
    if args.num_kv_blocks:
        return args.num_kv_blocks
    prefix_blocks = args.prefix_len // BLOCK_SIZE
    own = math.ceil((args.prefix_len % BLOCK_SIZE + args.turn_len + args.output_len)
                    / BLOCK_SIZE) + 1
    return math.ceil(args.sessions / 2) * prefix_blocks + args.concurrency * own


def serve_options(args: argparse.Namespace, row: Row) -> tuple[str, ...]:
    """The row's `dpserve serve` options after the model and port."""
    if row.workload == "prefix":
        sizes = ("--num-kv-blocks", str(kv_blocks(args)), "--max-model-len",
                 str(args.prefix_len + args.turn_len + args.output_len))
    else:
        sizes = ("--max-model-len", str(args.uniform_prompt_len + args.uniform_output_len))
    return ("--data-parallel-size", "2", "--api-server-count", str(row.api_servers),
            *(("--threads-per-engine", "1") if row.threads == "1" else ()), *sizes,
            *(("--load-balance", row.policy) if row.policy != "default" else ()),
            *args.serve_arg)


def make_rows(args: argparse.Namespace) -> list[Row]:
    """Every chosen (workload, API servers, threads, policy), grouped in that order."""
    return [Row(w, n, t, p) for w in args.workloads for n in args.api_server_counts
            for t in args.threads for p in args.policies]


def prefix_counts(url: str) -> tuple[float, float]:
    """(hits, queries) of the prefix cache, summed over the engines, from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(float(m.group(1)) for m in re.finditer(
            rf"^dpserve:{name}_total(?:{{.*}})? (\S+)$", text, re.M))
    return total("prefix_cache_hits"), total("prefix_cache_queries")


def run_row(args: argparse.Namespace, row: Row, load: Load, log_path: Path) -> Outcome:
    """A fresh server for this row, warm-up, the measured load, the server stopped."""
    server = ServeProcess(args.model, args.port or _free_port(), serve_options(args, row),
                          log_path)
    out = Outcome(row, shlex.join(["dpserve", "serve", *server.argv[4:]]))
    _log(f"  starting: {out.command}")
    try:
        with server:
            out.ready_s = server.start(args.start_timeout)
            if args.warmup:
                asyncio.run(_bench(replace(load.config, base_url=server.url,
                                           num_prompts=args.warmup,
                                           prompt_len=min(32, load.config.prompt_len))))
            hits0, queries0 = prefix_counts(server.url)
            _log(f"  ready in {out.ready_s:.1f} s; {len(load.prompts)} requests ...")
            out.result = asyncio.run(run_measured(replace(load.config, base_url=server.url),
                                                  load.prompts))
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
    lines = ["| workload | API servers | threads / engine | balancer | output tok/s | "
             "TTFT p50 | TTFT p90 | prefix-cache hit rate | requests |", "| --- " * 9 + "|"]
    for o in outcomes:
        row, r = o.row, o.result
        cells = f"| {row.workload} | {row.api_servers} | {row.threads} | {row.balancer} |"
        if r is None:
            why = (o.error.splitlines() or ["no result"])[0][:120]
            lines.append(f"{cells} n/a | n/a | n/a | n/a | error: {why} |")
            continue
        req = f"{r.completed} ok" + (f", {r.failed} failed, {r.not_sent} not sent"
                                     if r.failed or r.not_sent else "")
        lines.append(f"{cells} {r.output_throughput:.1f} | {_s(r.ttft_ms, 'p50')} | "
                     f"{_s(r.ttft_ms, 'p90')} | {_pct(o.hit_rate)} | {req} |")
    return lines


def ratios(outcomes: list[Outcome]) -> list[str]:
    """Per group, the default's output tok/s and TTFT p50 over each alternative's."""
    lines = []
    groups: dict[tuple[str, int, str], dict[str, BenchResult | None]] = {}
    for o in outcomes:
        groups.setdefault(o.row.group, {})[o.row.policy] = o.result
    for (workload, api, threads), by in groups.items():
        base = by.get("default")
        parts = []
        for policy, other in by.items():
            if policy == "default" or base is None or other is None:
                continue
            if not other.output_throughput or other.ttft_ms is None or base.ttft_ms is None \
                    or not other.ttft_ms.p50:
                continue
            same = " (the default again: noise)" if policy == DEFAULT_LOAD_BALANCE else ""
            parts.append(f"/ {policy}{same}: output tok/s "
                         f"**{base.output_throughput / other.output_throughput:.2f}x**, "
                         f"TTFT p50 **{base.ttft_ms.p50 / other.ttft_ms.p50:.2f}x**")
        if parts:
            lines.append(f"- {workload}, {api} API server(s), threads {threads}: default "
                         + "; ".join(parts))
    return ["", *lines] if lines else []


def markdown(args: argparse.Namespace, outcomes: list[Outcome]) -> str:
    model = args.model or "default (SmolLM2-135M-Instruct)"
    lines = [
        f"\n## balancers at DP=2: the default against each (bench/prefix_routing.py), "
        f"{datetime.datetime.now().isoformat(sep=' ', timespec='minutes')}\n",
        f"- machine: {machine()}",
        f"- command: `python {shlex.join(sys.argv)}`",
        f"- model: {model}; completions, random token ids, ignore_eos, temperature 0, seed "
        f"{args.seed}; {args.warmup} warm-up requests per row first",
    ]
    if "uniform" in args.workloads:
        lines.append(f"- uniform (W16): {args.uniform_requests} requests, "
                     f"{args.uniform_prompt_len} prompt -> {args.uniform_output_len} output "
                     f"tokens, concurrency {args.uniform_concurrency}, no shared prefixes")
    if "prefix" in args.workloads:
        lines.append(
            f"- prefix: {args.sessions} sessions x {args.turns} turns = "
            f"{args.sessions * args.turns} requests, each a {args.prefix_len}-token session "
            f"prefix + {args.turn_len} fresh tokens -> {args.output_len} output tokens, in "
            f"rounds of turns, concurrency {args.concurrency}; each engine `--num-kv-blocks "
            f"{kv_blocks(args)}` (block size {BLOCK_SIZE}): {math.ceil(args.sessions / 2)} "
            f"of the {args.sessions} prefixes plus room for the running turns")
    example = Row(args.workloads[0], max(args.api_server_counts), args.threads[0], "POLICY")
    lines += [f"- server (e.g.): `dpserve serve [MODEL] --port PORT "
              f"{shlex.join(serve_options(args, example))}`; `default` rows give no "
              f"--load-balance, threads `default` no --threads-per-engine",
              "", *table(outcomes), *ratios(outcomes)]
    lines += [f"- note ({o.row.name}): {n}" for o in outcomes for n in o.notes]
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


def _csv(text: str, allowed: tuple[str, ...], flag: str, p: argparse.ArgumentParser
         ) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        p.error(f"{flag}: unknown {bad}; choose from {', '.join(allowed)}")
    return items


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: built-in SmolLM2-135M-Instruct")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated, from {', '.join(WORKLOADS)} (default: both)")
    p.add_argument("--api-server-counts", default="1,2",
                   help="comma-separated --api-server-count values (default: 1,2)")
    p.add_argument("--threads", default="1,default",
                   help="comma-separated: 1 (--threads-per-engine 1) and/or default")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated, from {', '.join(POLICIES)} (default: all; "
                        f"`default` gives no --load-balance)")
    p.add_argument("--uniform-requests", type=int, default=64, help="uniform: requests")
    p.add_argument("--uniform-prompt-len", type=int, default=128, help="uniform: tokens")
    p.add_argument("--uniform-output-len", type=int, default=64, help="uniform: tokens")
    p.add_argument("--uniform-concurrency", type=int, default=16, help="uniform: in flight")
    p.add_argument("--sessions", type=int, default=32, help="prefix: sessions (prefixes)")
    p.add_argument("--prefix-len", type=int, default=1024, help="prefix: tokens per prefix")
    p.add_argument("--turns", type=int, default=4, help="prefix: requests per session")
    p.add_argument("--turn-len", type=int, default=32, help="prefix: fresh tokens per turn")
    p.add_argument("--output-len", type=int, default=32, help="prefix: output tokens")
    p.add_argument("--concurrency", type=int, default=8, help="prefix: requests in flight")
    p.add_argument("--num-kv-blocks", type=int, default=0,
                   help="prefix: KV blocks per engine (default: half the prefixes + turns)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and order")
    p.add_argument("--smoke", action="store_true",
                   help="every size at its smallest (a check that it runs, no timing)")
    add_run_options(p, max_duration=900.0)
    p.add_argument("--out", metavar="FILE", help="also append the markdown to FILE")
    args = p.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    for name in ("sessions", "prefix_len", "turns", "turn_len", "output_len", "concurrency",
                 "uniform_requests", "uniform_prompt_len", "uniform_output_len",
                 "uniform_concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.num_kv_blocks < 0:
        p.error("--warmup and --num-kv-blocks must not be negative")
    args.workloads = _csv(args.workloads, WORKLOADS, "--workloads", p)
    args.threads = _csv(args.threads, ("1", "default"), "--threads", p)
    args.policies = _csv(args.policies, POLICIES, "--policies", p)
    counts = _csv(args.api_server_counts, tuple(str(n) for n in range(1, 9)),
                  "--api-server-counts", p)
    args.api_server_counts = [int(n) for n in counts]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vocab = begin("prefix_routing", args.model)
    if vocab is None:
        return 2
    by_workload = loads(args, vocab)
    rows = {row.name: row for row in make_rows(args)}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="prefix_routing_") as tmp:
        outcomes = run_rows(list(rows), lambda name, log: run_row(
            args, rows[name], by_workload[rows[name].workload], log), Path(tmp))
    if outcomes is None:
        return 130
    publish(markdown(args, outcomes), args.out, start)
    ok = all(o.result is not None
             and o.result.completed == len(by_workload[o.row.workload].prompts)
             for o in outcomes)
    return 0 if ok else 1


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
