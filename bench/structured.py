"""Structured-output overhead: the serve workload with a json_schema on every request
vs unconstrained, on one `dpserve serve` (default model, DP=2 unless --serve-options).

Both runs send the same seeded prompts at the same concurrency through
dpserve.benchmark.serve (the code behind `dpserve bench serve`): every request asks
for exactly `--output-len` tokens (max_tokens + ignore_eos, greedy). The schema is an
array of at least 200 small objects, so no constrained request completes its JSON
before max_tokens: each one is masked on every token it generates, and both runs
generate the same number of tokens. Order: a warm-up of each kind (the schema's
compile is cached after it), then unconstrained, constrained, unconstrained,
constrained (--repeats pairs), the best of each kind reported. Overhead = 1 -
constrained / unconstrained output tok/s (aim: under 10%).

    .venv/bin/python bench/structured.py [--model M] [--out bench/results/DATE-TOPIC.md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shlex
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dp_scaling import ServeProcess, _bench, _free_port, _log, machine  # noqa: E402

from dpserve.benchmark.serve import BenchConfig, BenchResult  # noqa: E402

SCHEMA = {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {
        "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"}},
    "required": ["id", "name", "tags", "ok"], "additionalProperties": False}}
RESPONSE_FORMAT = {"response_format": {"type": "json_schema", "json_schema": {
    "name": "items", "schema": SCHEMA, "strict": True}}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="Model (default: the built-in one).")
    p.add_argument("--serve-options", default="--data-parallel-size 2",
                   help="Options for dpserve serve (one string).")
    p.add_argument("--endpoint", default="chat", choices=["chat", "completions"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="Pairs of runs.")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--out", default=None, help="Append the markdown section to this file.")
    return p.parse_args(argv)


def _row(name: str, r: BenchResult) -> str:
    ttft = f"{r.ttft_ms.p50:.0f} / {r.ttft_ms.p99:.0f}" if r.ttft_ms else "-"
    itl = f"{r.itl_ms.p50:.1f} / {r.itl_ms.p99:.1f}" if r.itl_ms else "-"
    return (f"| {name} | {r.output_throughput:.1f} | {ttft} | {itl} | "
            f"{r.completed} ok, {r.failed} failed |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    port = _free_port()
    log = Path(tempfile.mkdtemp(prefix="dpserve-structured-")) / "serve.log"
    server = ServeProcess(args.model, port, tuple(shlex.split(args.serve_options)), log)
    base = BenchConfig(base_url=server.url, endpoint=args.endpoint,
                       num_prompts=args.num_prompts, concurrency=args.concurrency,
                       prompt_len=args.prompt_len, output_len=args.output_len, warmup=4)
    constrained = replace(base, extra_body=json.dumps(RESPONSE_FORMAT))
    best: dict[str, BenchResult] = {}
    with server:
        _log(f"ready in {server.start(args.start_timeout):.1f} s")
        for _ in range(args.repeats):
            for name, config in (("unconstrained", base), ("json_schema", constrained)):
                r = asyncio.run(_bench(config))
                server.check_alive()
                _log(f"{name}: {r.output_throughput:.1f} output tok/s, {r.completed} ok, "
                     f"{r.failed} failed")
                if name not in best or r.output_throughput > best[name].output_throughput:
                    best[name] = r
    free, fixed = best["unconstrained"], best["json_schema"]
    overhead = 1 - fixed.output_throughput / free.output_throughput
    md = "\n".join([
        f"## Structured output overhead ({datetime.date.today()})", "",
        f"Machine: {machine()}. `python bench/structured.py "
        f"{shlex.join(argv if argv is not None else sys.argv[1:])}`: dpserve serve "
        f"{args.serve_options}, {args.endpoint}, {args.num_prompts} requests at concurrency "
        f"{args.concurrency}, {args.prompt_len} -> {args.output_len} tokens; best of "
        f"{args.repeats}.", "",
        "| run | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | requests |",
        "| --- | --- | --- | --- | --- |",
        _row("unconstrained", free), _row("json_schema on every request", fixed), "",
        f"Overhead: {overhead * 100:.1f}% of output throughput.", ""])
    print(md)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + md)
    ok = all(r.failed == 0 and r.not_sent == 0 for r in best.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
