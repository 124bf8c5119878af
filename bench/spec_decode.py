"""Draft-free speculative decoding: `--speculative-config` on and off.

Rows, each on a fresh `dpserve serve [MODEL]` (bench/dp_scaling.py's ServeProcess:
bounded start, whole tree stopped):

* `copy off` / `copy on`: copy-heavy requests one at a time (concurrency 1): each
  prompt holds a generated Python function and asks for it again, primed with its
  first line (editing code: the output is in the prompt); greedy, --copy-output-len
  tokens (ignore_eos). Reported: output tok/s (tokens / the requests' summed wall
  time) and whether the on row's texts equal the off row's (greedy: they must).
* `W16 off` / `W16 on`: the W16 load (--num-prompts random 128-token prompts -> 64
  tokens, concurrency 16; `dpserve bench serve`'s load generator), greedy.
* `W16 sampled off` / `W16 sampled on` (not run unless named): the same at
  temperature 1, where few drafts are accepted: the cost of proposing and verifying.

From /metrics after each `on` row: draft tokens, accepted ones, the acceptance rate
and the mean acceptance length (1 + accepted / speculative rows). Targets:
copy on / off >= 1.5x output tok/s with identical text, W16 on / off >= 0.95x.
The markdown section for a file in bench/results/ goes to stdout (--out FILE appends it). Exit
status 0 when every row ran with no failed request (texts are compared, not checked:
bfloat16 may round a near tie the other way; float32 greedy text is identical).

    .venv/bin/python bench/spec_decode.py [--rows "copy off,copy on,W16 off,W16 on"]
    .venv/bin/python bench/spec_decode.py --smoke   # tiny loads: a check, no timing

Timings need an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import re
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from dp_scaling import ServeProcess, _free_port, _log, begin, machine, parse_rows, publish, run_rows

from dpserve.benchmark.serve import BenchConfig, BenchResult, run_benchmark

DEFAULT_ROWS = ("copy off", "copy on", "W16 off", "W16 on")
# W16 sampled at temperature 1: drafts are accepted far less often than under greedy
# decoding (whose random prompts fall into repetition), so the planner's choices show.
ROWS = (*DEFAULT_ROWS, "W16 sampled off", "W16 sampled on")
SAMPLED = '{"temperature": 1.0}'
SMOKE = dict(copy_requests=2, copy_output_len=8, num_prompts=4, concurrency=2, prompt_len=16,
             output_len=8, warmup=1)
_NAMES = ("total", "count", "items", "value", "result", "index", "scale", "limit")


@dataclass
class Outcome:
    """One row."""

    name: str
    command: str
    tok_per_s: float = 0.0
    completed: int = 0
    failed: int = 0
    texts: list[str] = field(default_factory=list)  # copy rows: each request's text
    ttft_p50_ms: float | None = None
    itl_p50_ms: float | None = None
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    drafts: float = 0.0
    error: str = ""


def copy_prompts(num: int, seed: int) -> list[str]:
    """Seeded copy-heavy prompts: a generated function, asked for again."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        a, b, c = rng.sample(_NAMES, 3)
        lines = [f"def step_{i}_{a}({a}, {b}):", f'    """Combine {a} and {b} into {c}."""',
                 f"    {c} = []"]
        for j in range(rng.randint(4, 7)):
            op = rng.choice(("+", "-", "*"))
            lines += [f"    for k in range(len({a})):",
                      f"        {c}.append({a}[k] {op} {b}[k % {j + 2}] * {rng.randint(2, 9)})"]
        code = "\n".join(lines + [f"    return {c}", ""])
        prompts.append(f"Repeat this code exactly:\n\n{code}\nHere it is again:\n\n{lines[0]}\n")
    return prompts


async def _copy_load(url: str, prompts: list[str], max_tokens: int) -> Outcome:
    """The copy requests one after another; tok/s over their summed wall time."""
    out = Outcome("", "")
    tokens, busy = 0, 0.0
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        for prompt in prompts:
            t0 = time.perf_counter()
            r = await client.post(url + "/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True})
            busy += time.perf_counter() - t0
            if r.status_code != 200:
                out.failed += 1
                continue
            body = r.json()
            out.completed += 1
            out.texts.append(body["choices"][0]["text"])
            tokens += body["usage"]["completion_tokens"]
    out.tok_per_s = tokens / busy if busy else 0.0
    return out


def _spec_counters(url: str, out: Outcome) -> None:
    """The engines' speculative-decoding totals from /metrics (summed over ranks)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    for name, attr in (("draft_tokens", "draft_tokens"), ("accepted_tokens", "accepted_tokens"),
                       ("drafts", "drafts")):
        values = re.findall(rf"^dpserve:spec_decode_num_{name}_total(?:{{.*}})? (\S+)$", text,
                            re.M)
        setattr(out, attr, sum(float(v) for v in values))


def run_row(args: argparse.Namespace, row: str, vocab: int, log_path: Path) -> Outcome:
    """Fresh server with or without --speculative-config, the row's load, then stopped."""
    port = args.port or _free_port()
    options = [*(["--speculative-config", args.speculative_config] if row.endswith(" on")
                 else []), *args.serve_arg]
    server = ServeProcess(args.model, port, tuple(options), log_path)
    command = shlex.join(["dpserve", "serve", *server.argv[4:]])
    _log(f"  starting: {command}")
    out = Outcome(row, command)
    try:
        with server:
            server.start(args.start_timeout)
            if row.startswith("copy"):
                load = asyncio.run(_copy_load(server.url, copy_prompts(args.copy_requests,
                                                                       args.seed),
                                              args.copy_output_len))
                out.tok_per_s, out.texts = load.tok_per_s, load.texts
                out.completed, out.failed = load.completed, load.failed
            else:
                _w16(args, vocab, server.url, out)
            _spec_counters(server.url, out)
            server.check_alive()
    except (RuntimeError, OSError, httpx.HTTPError, asyncio.TimeoutError, KeyError) as e:
        out.error = f"{type(e).__name__}: {e}"
        _log(f"  error: {out.error}")
    _log(f"  {out.tok_per_s:.1f} output tok/s, {out.completed} ok / {out.failed} failed; "
         f"drafts {out.draft_tokens:.0f}, accepted {out.accepted_tokens:.0f}")
    return out


def _w16(args: argparse.Namespace, vocab: int, url: str, out: Outcome) -> None:
    config = BenchConfig(base_url=url, num_prompts=args.num_prompts,
                         concurrency=args.concurrency, prompt_len=args.prompt_len,
                         output_len=args.output_len, vocab_size=vocab, seed=args.seed,
                         warmup=args.warmup,
                         extra_body=SAMPLED if out.name.startswith("W16 sampled") else None)
    result: BenchResult = asyncio.run(run_benchmark(config))
    out.tok_per_s, out.completed = result.output_throughput, result.completed
    out.failed = result.failed + result.not_sent
    out.ttft_p50_ms = result.ttft_ms.p50 if result.ttft_ms else None
    out.itl_p50_ms = result.itl_ms.p50 if result.itl_ms else None


def _ratio(outcomes: dict[str, Outcome], on: str, off: str) -> str:
    a, b = outcomes.get(on), outcomes.get(off)
    return f"{a.tok_per_s / b.tok_per_s:.2f}x" if a and b and b.tok_per_s else "n/a"


def markdown(args: argparse.Namespace, outcomes: list[Outcome]) -> str:
    by = {o.name: o for o in outcomes}
    ms = lambda v: "n/a" if v is None else f"{v:.0f} ms"  # noqa: E731
    lines = [f"\n## Speculative decoding, n-gram (bench/spec_decode.py), "
             f"{datetime.datetime.now().isoformat(sep=' ', timespec='minutes')}\n",
             f"- machine: {machine()}",
             f"- model: {args.model or 'default (SmolLM2-135M-Instruct)'}; "
             f"`--speculative-config '{args.speculative_config}'` on the `on` rows",
             f"- copy: {args.copy_requests} copy-heavy completions one at a time, greedy, "
             f"{args.copy_output_len} tokens each; W16: {args.num_prompts} requests, "
             f"{args.prompt_len} in / {args.output_len} out, concurrency {args.concurrency}",
             "", "| row | output tok/s | ok / failed | TTFT p50 | ITL p50 | draft tokens | "
             "accepted | acceptance | mean acceptance length | command |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        rate = f"{o.accepted_tokens / o.draft_tokens:.0%}" if o.draft_tokens else "n/a"
        mean = f"{1 + o.accepted_tokens / o.drafts:.2f}" if o.drafts else "n/a"
        lines.append(f"| {o.name} | {o.tok_per_s:.1f} | {o.completed} / {o.failed} | "
                     f"{ms(o.ttft_p50_ms)} | {ms(o.itl_p50_ms)} | {o.draft_tokens:.0f} | "
                     f"{o.accepted_tokens:.0f} | {rate} | {mean} | `{o.command}` |"
                     + (f" error: {o.error}" if o.error else ""))
    on, off = by.get("copy on"), by.get("copy off")
    same = (f"{sum(a == b for a, b in zip(on.texts, off.texts))} of {len(off.texts)}"
            if on and off else "n/a")
    lines += ["", f"- copy on / off: **{_ratio(by, 'copy on', 'copy off')}** output tok/s "
              f"(target >= 1.5x); greedy texts identical: **{same}** (float32: all; "
              f"bfloat16 rounds the k + 1 verified rows differently from one-row steps)",
              f"- W16 on / off: **{_ratio(by, 'W16 on', 'W16 off')}** output tok/s "
              f"(target >= 0.95x)"]
    if "W16 sampled on" in by:
        lines.append(f"- W16 sampled (temperature 1) on / off: "
                     f"**{_ratio(by, 'W16 sampled on', 'W16 sampled off')}** output tok/s")
    lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: built-in SmolLM2-135M-Instruct")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                   help=f"comma-separated, from {', '.join(ROWS)} (default: "
                        f"{', '.join(DEFAULT_ROWS)})")
    p.add_argument("--speculative-config", default='{"method": "ngram", '
                   '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                   '"prompt_lookup_min": 2}', help="the `on` rows' option")
    p.add_argument("--copy-requests", type=int, default=8)
    p.add_argument("--copy-output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=64, help="W16: measured requests")
    p.add_argument("--concurrency", type=int, default=16, help="W16: requests in flight")
    p.add_argument("--prompt-len", type=int, default=128, help="W16: prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="W16: output tokens")
    p.add_argument("--warmup", type=int, default=4, help="W16: warm-up requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-arg", action="append", default=[],
                   help="an extra `dpserve serve` argument for every row (repeatable)")
    p.add_argument("--port", type=int, default=0, help="port (default: a free one per row)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--smoke", action="store_true",
                   help="tiny loads: checks that the script runs, measures nothing")
    p.add_argument("--out", metavar="FILE", help="also append the markdown to FILE")
    args = p.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    for name in ("copy_requests", "copy_output_len", "num_prompts", "concurrency",
                 "prompt_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    args.rows = parse_rows(p, args.rows, ROWS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vocab = begin("spec_decode", args.model)
    if vocab is None:
        return 2
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="spec_decode_") as tmp:
        outcomes = run_rows(args.rows, lambda row, log: run_row(args, row, vocab, log),
                            Path(tmp))
    if outcomes is None:
        return 130
    publish(markdown(args, outcomes), args.out, start)
    return 0 if all(not o.error and not o.failed for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
