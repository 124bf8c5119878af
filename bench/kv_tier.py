"""The KV host tier at DP=2: `--load-balance cache-aware` without and with
`--kv-offload-memory`, on a prefix-heavy load that neither rank's cache can hold.

The workload: --sessions sessions, each a shared prefix of --prefix-len random
tokens (a long system prompt or document) plus short turns (--turn-len fresh
tokens, --output-len output tokens, ignore_eos, temperature 0). Arrivals are
skewed: after one turn of every session (shuffled), the load is a sequence of
bursts, each --burst turns of ONE session sent back to back (many users on one
document, an agent's fan-out), the burst's session drawn with Zipf-like weights
1/(i+1) (a few sessions take most bursts),
--concurrency requests in flight (closed loop). A burst makes its prefix's owner
the busiest rank, so routing must either queue the burst there or send part of it
to the other rank, which without a tier recomputes the prefix. Each engine's KV
cache (`--num-kv-blocks`) holds --cache-fraction of the prefixes plus room for
the running turns' own blocks, so a session that comes back has often been
evicted from its rank; the host tier (`--kv-offload-memory`, default 1GiB: every
prefix of the default load) holds them all.

Each row starts a fresh `dpserve serve [MODEL] --data-parallel-size 2
--threads-per-engine 1 --num-kv-blocks N --max-model-len M --load-balance
cache-aware [--kv-offload-memory SIZE]` (bench/dp_scaling.py's ServeProcess:
bounded start, whole tree stopped), sends --warmup random short requests, then the
measured load with the code behind `dpserve bench serve`. Reported per row: output
tok/s, TTFT p50/p90, and where the prompt tokens came from over the measured load
(from /metrics, both engines): the rank's own prefix cache
(dpserve:prefix_cache_hits / dpserve:prefix_cache_queries), the host tier
(dpserve:external_prefix_cache_hits / the same queries), computed (the rest); then
the tier row's ratios to the row without (targets: TTFT p50 <= 0.5x, output tok/s
>= 1.3x). The markdown section for a file in bench/results/ goes to stdout (--out FILE appends
it). Exit status 0 when every measured request of every row completed.

    .venv/bin/python bench/kv_tier.py [--sessions 16 --prefix-len 512 ...]
    .venv/bin/python bench/kv_tier.py --smoke   # 4 tiny requests a row: a check, no timing

Timings need an otherwise idle machine. Not here: several hosts (each has its own
tier), several API servers (each router tracks only its own sends).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import random
import re
import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
from dp_scaling import ServeProcess, _bench, _free_port, _log, machine, parse_rows
from prefix_routing import _pct, _s, add_run_options, run_bench, run_measured

from dpserve.benchmark.serve import BenchConfig, BenchResult

BLOCK_SIZE = 16  # the engines' default --block-size
ROWS = ("no tier", "tier")
SMOKE = dict(sessions=2, prefix_len=48, requests=4, burst=2, turn_len=8, output_len=4,
             concurrency=2, warmup=1, cache_fraction=0.5, kv_offload_memory="64MiB")


@dataclass
class Outcome:
    """One row."""

    name: str
    command: str
    result: BenchResult | None = None
    counts: dict[str, float] | None = None  # metric -> its growth over the measured load
    ready_s: float = 0.0
    error: str = ""
    notes: tuple[str, ...] = ()

    def share(self, metric: str) -> float | None:
        """`metric`'s tokens / prompt tokens looked up (None: nothing looked up)."""
        if not self.counts or not self.counts.get("prefix_cache_queries"):
            return None
        return self.counts.get(metric, 0.0) / self.counts["prefix_cache_queries"]


COUNTED = ("prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_queries",
           "external_prefix_cache_hits", "kv_offload_load_bytes", "kv_offload_store_bytes")


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """Every measured prompt, in sending order: one turn of every session (shuffled: the
    router gives each prefix an owner), then bursts of one Zipf-drawn session each."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(100, vocab) for _ in range(args.prefix_len)]
                for _ in range(args.sessions)]
    weights = [1 / (i + 1) for i in range(args.sessions)]
    firsts = list(range(args.sessions))
    rng.shuffle(firsts)
    order = firsts[:args.requests]
    while len(order) < args.requests:
        session = rng.choices(range(args.sessions), weights)[0]
        order += [session] * min(args.burst, args.requests - len(order))
    return [prefixes[s] + [rng.randrange(100, vocab) for _ in range(args.turn_len)]
            for s in order]


def kv_blocks(args: argparse.Namespace) -> int:
    """Per engine: --cache-fraction of the prefixes, plus every running turn's own blocks."""
    if args.num_kv_blocks:
        return args.num_kv_blocks
    prefix_blocks = args.prefix_len // BLOCK_SIZE
    own = math.ceil((args.prefix_len % BLOCK_SIZE + args.turn_len + args.output_len)
                    / BLOCK_SIZE) + 1
    held = max(1, math.floor(args.sessions * args.cache_fraction))
    return held * prefix_blocks + args.concurrency * own


def serve_options(args: argparse.Namespace, row: str) -> tuple[str, ...]:
    max_len = args.prefix_len + args.turn_len + args.output_len
    tier = ("--kv-offload-memory", args.kv_offload_memory) if row == "tier" else ()
    return ("--data-parallel-size", "2", "--threads-per-engine", "1",
            "--num-kv-blocks", str(kv_blocks(args)), "--max-model-len", str(max_len),
            "--load-balance", "cache-aware", *tier, *args.serve_arg)


def counts(url: str) -> dict[str, float]:
    """The COUNTED counters, summed over the engines, from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {name: sum(float(m.group(1)) for m in re.finditer(
        rf"^dpserve:{name}_total(?:{{.*}})? (\S+)$", text, re.M)) for name in COUNTED}


def run_row(args: argparse.Namespace, row: str, config: BenchConfig,
            prompts: list[list[int]], log_path: Path) -> Outcome:
    """A fresh server for this row, warm-up, the measured load, the server stopped."""
    server = ServeProcess(args.model, args.port or _free_port(), serve_options(args, row),
                          log_path)
    out = Outcome(row, shlex.join(["dpserve", "serve", *server.argv[4:]]))
    _log(f"  starting: {out.command}")
    try:
        with server:
            out.ready_s = server.start(args.start_timeout)
            if args.warmup:
                asyncio.run(_bench(replace(config, base_url=server.url,
                                           num_prompts=args.warmup, prompt_len=32)))
            before = counts(server.url)
            _log(f"  ready in {out.ready_s:.1f} s; {len(prompts)} requests ...")
            out.result = asyncio.run(run_measured(replace(config, base_url=server.url),
                                                  prompts))
            after = counts(server.url)
            out.counts = {k: after[k] - before[k] for k in COUNTED}
            server.check_alive()
    except (RuntimeError, OSError, httpx.HTTPError, asyncio.TimeoutError) as e:
        out.error = f"{type(e).__name__}: {e}"
        _log(f"  error: {out.error}")
    out.notes = tuple(server.notes)
    if out.result is not None:
        r = out.result
        _log(f"  {r.output_throughput:.1f} output tok/s, TTFT p50 {_s(r.ttft_ms, 'p50')}, "
             f"own cache {_pct(out.share('prefix_cache_hits'))}, tier "
             f"{_pct(out.share('external_prefix_cache_hits'))}, {r.completed} ok / "
             f"{r.failed} failed / {r.not_sent} not sent in {r.duration_s:.1f} s")
    return out


# ---------------------------------------------------------------- markdown


def _computed(o: Outcome) -> str:
    own, tier = o.share("prefix_cache_hits"), o.share("external_prefix_cache_hits")
    return "n/a" if own is None else _pct(max(0.0, 1.0 - own - (tier or 0.0)))


def _mib(o: Outcome, metric: str) -> str:
    return "n/a" if not o.counts else f"{o.counts.get(metric, 0.0) / 2**20:.1f}"


def table(outcomes: list[Outcome]) -> list[str]:
    lines = ["| row | output tok/s | TTFT p50 | TTFT p90 | prompt tokens: own cache | "
             "host tier | computed | MiB loaded / saved | requests |", "| --- " * 9 + "|"]
    for o in outcomes:
        r = o.result
        if r is None:
            why = (o.error.splitlines() or ["no result"])[0][:120]
            lines.append(f"| {o.name} | n/a | n/a | n/a | n/a | n/a | n/a | n/a | "
                         f"error: {why} |")
            continue
        req = f"{r.completed} ok" + (f", {r.failed} failed, {r.not_sent} not sent"
                                     if r.failed or r.not_sent else "")
        lines.append(f"| {o.name} | {r.output_throughput:.1f} | {_s(r.ttft_ms, 'p50')} | "
                     f"{_s(r.ttft_ms, 'p90')} | {_pct(o.share('prefix_cache_hits'))} | "
                     f"{_pct(o.share('external_prefix_cache_hits'))} | {_computed(o)} | "
                     f"{_mib(o, 'kv_offload_load_bytes')} / "
                     f"{_mib(o, 'kv_offload_store_bytes')} | {req} |")
    return lines


def ratios(outcomes: list[Outcome]) -> list[str]:
    by = {o.name: o.result for o in outcomes}
    base, tier = by.get("no tier"), by.get("tier")
    if base is None or tier is None or not base.output_throughput or base.ttft_ms is None \
            or tier.ttft_ms is None or not base.ttft_ms.p50:
        return []
    return ["", f"- tier / no tier: output tok/s "
                f"**{tier.output_throughput / base.output_throughput:.2f}x** (target >= 1.3x), "
                f"TTFT p50 **{tier.ttft_ms.p50 / base.ttft_ms.p50:.2f}x** (target <= 0.5x)"]


def markdown(args: argparse.Namespace, outcomes: list[Outcome]) -> str:
    model = args.model or "default (SmolLM2-135M-Instruct)"
    lines = [
        f"\n## KV host tier at DP=2 (bench/kv_tier.py), "
        f"{datetime.datetime.now().isoformat(sep=' ', timespec='minutes')}\n",
        f"- machine: {machine()}",
        f"- command: `python {shlex.join(sys.argv)}`",
        f"- model: {model}; load: {args.requests} requests: one turn of each session, "
        f"then bursts of {args.burst} turns of one session (drawn with weights 1/(i+1)), "
        f"{args.sessions} sessions, each a {args.prefix_len}-token prefix + "
        f"{args.turn_len} fresh tokens -> {args.output_len} output tokens (completions, "
        f"random token ids, ignore_eos, temperature 0, seed {args.seed}), concurrency "
        f"{args.concurrency}, {args.warmup} warm-up requests first",
        f"- each engine: `--num-kv-blocks {kv_blocks(args)}` (block size {BLOCK_SIZE}): "
        f"about {args.cache_fraction:.0%} of the prefixes plus room for the running turns; "
        f"the tier row: `--kv-offload-memory {args.kv_offload_memory}` for the host",
        f"- server: `dpserve serve [MODEL] --port PORT "
        f"{shlex.join(serve_options(args, 'tier'))}` (the other row without "
        f"--kv-offload-memory); start to ready: "
        f"{', '.join(f'{o.ready_s:.1f} s' for o in outcomes if o.ready_s) or 'n/a'}",
        "", *table(outcomes), *ratios(outcomes)]
    lines += [f"- note ({o.name}): {n}" for o in outcomes for n in o.notes]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: built-in SmolLM2-135M-Instruct")
    p.add_argument("--sessions", type=int, default=16, help="sessions (distinct prefixes)")
    p.add_argument("--prefix-len", type=int, default=512, help="tokens of each prefix")
    p.add_argument("--requests", type=int, default=96, help="measured requests")
    p.add_argument("--burst", type=int, default=6, help="turns of one session back to back")
    p.add_argument("--turn-len", type=int, default=16, help="fresh tokens per turn")
    p.add_argument("--output-len", type=int, default=16, help="output tokens per turn")
    p.add_argument("--concurrency", type=int, default=6, help="requests in flight")
    p.add_argument("--cache-fraction", type=float, default=0.25,
                   help="share of the prefixes one engine's KV cache holds")
    p.add_argument("--num-kv-blocks", type=int, default=0,
                   help="KV blocks per engine (default: from --cache-fraction)")
    p.add_argument("--kv-offload-memory", default="1GiB",
                   help="the tier row's host tier size (default 1GiB)")
    p.add_argument("--rows", default=",".join(ROWS),
                   help=f"comma-separated, from {', '.join(ROWS)} (default: both)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and order")
    add_run_options(p, max_duration=600.0)
    p.add_argument("--smoke", action="store_true",
                   help="a tiny load (4 requests a row, short prompts): checks that the "
                        "script runs, measures nothing")
    p.add_argument("--out", metavar="FILE", help="also append the markdown to FILE")
    args = p.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    for name in ("sessions", "prefix_len", "requests", "burst", "turn_len", "output_len",
                 "concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 < args.cache_fraction <= 1:
        p.error("--cache-fraction must be in (0, 1]")
    if args.warmup < 0 or args.num_kv_blocks < 0:
        p.error("--warmup and --num-kv-blocks must not be negative")
    args.rows = parse_rows(p, args.rows, ROWS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_bench("kv_tier", args, args.rows, make_prompts, run_row, markdown)


if __name__ == "__main__":
    sys.exit(main())
