"""Prefill/decode disaggregation at DP=2: colocated vs `prefill:1,decode:1`.

The workload: a mixed load, long prompts arriving among many decoding streams.
--requests requests in a seeded order, every --long-every-th one a long prompt
(--long-len random tokens: a document to read) and the others short ones
(--short-len random tokens: chat turns that mostly decode); every request asks
for --output-len tokens (ignore_eos, temperature 0); --concurrency in flight
(closed loop), so a long prompt always lands among running decodes. Every prompt
is distinct (no prefix-cache hits between requests).

Each row starts a fresh `dpserve serve [MODEL] --data-parallel-size 2
--threads-per-engine 1 --max-model-len M --kv-offload-memory SIZE` (both rows
have the host tier, so the only difference is the roles), the `prefill:1,decode:1`
row with `--data-parallel-roles prefill:1,decode:1`; --warmup random short requests,
then the measured load with the code behind `dpserve bench serve`
(bench/prefix_routing.py's run_bench). Reported per row: output tok/s, TTFT p50
of all requests and of the long ones, the decoding streams' ITL (the gaps between
tokens of the short requests, pooled) p50 / p99, the handoffs counted by the server
(dpserve:pd_handoffs over the measured load); then the roles row's ratios to the
colocated one. Expected on 2 cores: the decoding streams' ITL p99 improves (a long
prefill no longer shares their steps), throughput may not (one rank does all the
prefill). The markdown section for a file in bench/results/ goes to stdout (--out FILE
appends it). Exit status 0 when every measured request of every row completed.

    .venv/bin/python bench/pd.py [--requests 48 --long-len 1536 ...]
    .venv/bin/python bench/pd.py --smoke   # 4 tiny requests a row: a check, no timing

Timings need an otherwise idle machine. Not here: several hosts (the pull between
stores), several API servers.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import re
import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
from dp_scaling import ServeProcess, _bench, _free_port, _log, machine, parse_rows
from prefix_routing import _s, add_run_options, run_bench, run_measured

from dpserve.benchmark.serve import BenchConfig, BenchResult, Latency

ROWS = ("colocated", "pd")  # the second: --data-parallel-roles ROLES
ROLES = "prefill:1,decode:1"
SMOKE = dict(requests=4, long_every=2, long_len=48, short_len=8, output_len=6,
             concurrency=2, warmup=1, kv_offload_memory="64MiB")


@dataclass
class Outcome:
    """One row."""

    name: str
    command: str
    long: list[bool]  # per measured request: a long prompt
    result: BenchResult | None = None
    handoffs: float = 0.0  # dpserve:pd_handoffs over the measured load
    ready_s: float = 0.0
    error: str = ""
    notes: tuple[str, ...] = ()

    def ttft(self, long: bool | None = None) -> Latency | None:
        """TTFT of every request (None), or of the long / short ones."""
        return Latency.of([r.ttft_s for r, lg in self._done() if r.ttft_s is not None
                           and (long is None or lg == long)])

    def decode_itl(self) -> Latency | None:
        """The gaps between tokens of the decoding streams (short prompts), pooled."""
        return Latency.of([gap for r, lg in self._done() if not lg for gap in r.itl_s])

    def _done(self) -> list:
        if self.result is None:
            return []
        return [(r, lg) for r, lg in zip(self.result.requests, self.long) if r.ok]


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """Every measured prompt, in sending order (module docstring)."""
    rng = random.Random(args.seed)
    return [[rng.randrange(100, vocab) for _ in range(args.long_len if is_long(args, i)
                                                      else args.short_len)]
            for i in range(args.requests)]


def is_long(args: argparse.Namespace, i: int) -> bool:
    return i % args.long_every == args.long_every - 1


def serve_options(args: argparse.Namespace, row: str) -> tuple[str, ...]:
    max_len = args.long_len + args.output_len + 16
    roles = ("--data-parallel-roles", ROLES) if row == "pd" else ()
    return ("--data-parallel-size", "2", "--threads-per-engine", "1",
            "--max-model-len", str(max_len), "--kv-offload-memory", args.kv_offload_memory,
            *roles, *args.serve_arg)


def handoffs(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(
        r"^dpserve:pd_handoffs_total(?:{.*})? (\S+)$", text, re.M))


def run_row(args: argparse.Namespace, row: str, config: BenchConfig,
            prompts: list[list[int]], log_path: Path) -> Outcome:
    """A fresh server for this row, warm-up, the measured load, the server stopped."""
    server = ServeProcess(args.model, args.port or _free_port(), serve_options(args, row),
                          log_path)
    out = Outcome(row, shlex.join(["dpserve", "serve", *server.argv[4:]]),
                  [is_long(args, i) for i in range(len(prompts))])
    _log(f"  starting: {out.command}")
    try:
        with server:
            out.ready_s = server.start(args.start_timeout)
            if args.warmup:
                asyncio.run(_bench(replace(config, base_url=server.url,
                                           num_prompts=args.warmup, prompt_len=16)))
            before = handoffs(server.url)
            _log(f"  ready in {out.ready_s:.1f} s; {len(prompts)} requests ...")
            out.result = asyncio.run(run_measured(replace(config, base_url=server.url),
                                                  prompts))
            out.handoffs = handoffs(server.url) - before
            server.check_alive()
    except (RuntimeError, OSError, httpx.HTTPError, asyncio.TimeoutError) as e:
        out.error = f"{type(e).__name__}: {e}"
        _log(f"  error: {out.error}")
    out.notes = tuple(server.notes)
    if out.result is not None:
        r = out.result
        _log(f"  {r.output_throughput:.1f} output tok/s, TTFT p50 {_s(out.ttft(), 'p50')}, "
             f"decode ITL p99 {_ms(out.decode_itl(), 'p99')}, {out.handoffs:g} handoffs, "
             f"{r.completed} ok / {r.failed} failed / {r.not_sent} not sent")
    return out


# ---------------------------------------------------------------- markdown


def _ms(lat: Latency | None, key: str) -> str:
    return "n/a" if lat is None else f"{getattr(lat, key):.0f} ms"


def table(outcomes: list[Outcome]) -> list[str]:
    lines = ["| row | output tok/s | TTFT p50 | TTFT p50 long prompts | decode ITL p50 | "
             "decode ITL p99 | handoffs | requests |", "| --- " * 8 + "|"]
    for o in outcomes:
        r = o.result
        if r is None:
            why = (o.error.splitlines() or ["no result"])[0][:120]
            lines.append(f"| {o.name} | n/a | n/a | n/a | n/a | n/a | n/a | error: {why} |")
            continue
        req = f"{r.completed} ok" + (f", {r.failed} failed, {r.not_sent} not sent"
                                     if r.failed or r.not_sent else "")
        itl = o.decode_itl()
        lines.append(f"| {o.name} | {r.output_throughput:.1f} | {_s(o.ttft(), 'p50')} | "
                     f"{_s(o.ttft(True), 'p50')} | {_ms(itl, 'p50')} | {_ms(itl, 'p99')} | "
                     f"{o.handoffs:g} | {req} |")
    return lines


def ratios(outcomes: list[Outcome]) -> list[str]:
    by = {o.name: o for o in outcomes if o.result is not None}
    base, pd = by.get("colocated"), by.get("pd")
    if base is None or pd is None:
        return []
    b_itl, p_itl, b_ttft, p_ttft = base.decode_itl(), pd.decode_itl(), base.ttft(), pd.ttft()
    if b_itl is None or p_itl is None or b_ttft is None or p_ttft is None \
            or not b_itl.p99 or not b_ttft.p50:
        return []
    assert base.result is not None and pd.result is not None
    tps = pd.result.output_throughput / max(base.result.output_throughput, 1e-9)
    return ["", f"- pd ({ROLES}) / colocated: decode ITL p99 "
                f"**{p_itl.p99 / b_itl.p99:.2f}x**, TTFT p50 **{p_ttft.p50 / b_ttft.p50:.2f}x**, "
                f"output tok/s **{tps:.2f}x**"]


def markdown(args: argparse.Namespace, outcomes: list[Outcome]) -> str:
    model = args.model or "default (SmolLM2-135M-Instruct)"
    lines = [
        f"\n## Prefill/decode disaggregation at DP=2 (bench/pd.py), "
        f"{datetime.datetime.now().isoformat(sep=' ', timespec='minutes')}\n",
        f"- machine: {machine()}",
        f"- command: `python {shlex.join(sys.argv)}`",
        f"- model: {model}; load: {args.requests} requests, every {args.long_every}th a "
        f"{args.long_len}-token prompt, the others {args.short_len}-token prompts, each -> "
        f"{args.output_len} output tokens (completions, random token ids, ignore_eos, "
        f"temperature 0, seed {args.seed}), concurrency {args.concurrency}, "
        f"{args.warmup} warm-up requests first; decode ITL: the short requests' gaps",
        f"- server: `dpserve serve [MODEL] --port PORT "
        f"{shlex.join(serve_options(args, 'pd'))}` (the colocated row without "
        f"--data-parallel-roles); start to ready: "
        f"{', '.join(f'{o.ready_s:.1f} s' for o in outcomes if o.ready_s) or 'n/a'}",
        "", *table(outcomes), *ratios(outcomes)]
    lines += [f"- note ({o.name}): {n}" for o in outcomes for n in o.notes]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: built-in SmolLM2-135M-Instruct")
    p.add_argument("--requests", type=int, default=48, help="measured requests")
    p.add_argument("--long-every", type=int, default=4, help="every Nth request is long")
    p.add_argument("--long-len", type=int, default=1536, help="tokens of a long prompt")
    p.add_argument("--short-len", type=int, default=32, help="tokens of a short prompt")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--kv-offload-memory", default="1GiB", help="each row's host tier size")
    p.add_argument("--rows", default=",".join(ROWS),
                   help=f"comma-separated, from {', '.join(ROWS)} (pd: "
                        f"--data-parallel-roles {ROLES}; default: both)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    add_run_options(p, max_duration=900.0)
    p.add_argument("--smoke", action="store_true",
                   help="a tiny load (4 requests a row, short prompts): checks that the "
                        "script runs, measures nothing")
    p.add_argument("--out", metavar="FILE", help="also append the markdown to FILE")
    args = p.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    for name in ("requests", "long_every", "long_len", "short_len", "output_len",
                 "concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must not be negative")
    args.rows = parse_rows(p, args.rows, ROWS)
    # run_bench's names: the long prompt stands for its prefix (BenchConfig.prompt_len)
    args.prefix_len, args.turn_len = args.long_len, 0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_bench("pd", args, args.rows, make_prompts, run_row, markdown)


if __name__ == "__main__":
    sys.exit(main())
