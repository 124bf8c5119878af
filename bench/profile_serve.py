"""Where the time goes: a sampled profile of `dpserve serve` under a serve workload.

Starts one `dpserve serve` (default model unless --model; DP=1 unless
--serve-options), runs the workload with dpserve's load generator (W1: one
stream; W16: 16 at a time; 128 prompt and 64 output tokens, greedy, ignore_eos)
and, once it is under way, samples every process of the server with py-spy
(one py-spy per process; a sample whose leaf frame blocks, in select, poll,
a condition wait or a socket receive, counts as waiting, not as CPU). Each
other sample is put in the first category (leaf first) whose frame it contains:

  linears, attention, sampler, model (other: norms, rope, embedding),
  runner inputs, scheduler (incl. KV blocks), IPC (zmq, msgspec, the engine's
  and front-end's socket loops), detokenize, output processing, HTTP/SSE
  (uvicorn, starlette, fastapi, dpserve.server), other

and the report gives, per process (API server, engine), its CPU use over the
window and each category's share, and per output token the CPU milliseconds
each category cost, next to the measured inter-token latency.

    .venv/bin/python bench/profile_serve.py --workload W1|W16 [--seconds 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dp_scaling import ServeProcess, _bench, _free_port, _log, _on_sigterm, machine  # noqa: E402

from dpserve.benchmark.serve import BenchConfig  # noqa: E402

WORKLOADS = {"W1": (16, 1), "W16": (64, 16)}  # name -> (requests, concurrency)

# (category, pattern on "function (file:line)" frames), tried leaf first.
CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    (name, re.compile(pattern)) for name, pattern in [
        ("linears", r"^linear \(.*dpserve/model/layers\.py"),
        ("attention", r"dpserve/model/attention\.py"),
        ("sampler", r"dpserve/model/sampler\.py"),
        ("model other", r"dpserve/model/(llama|layers|moe\w*)\.py"),
        ("runner inputs", r"dpserve/model/runner\.py"),
        ("scheduler", r"dpserve/engine/(scheduler|kv_cache|request)\.py"),
        ("detokenize", r"dpserve/frontend/(detokenizer|tokenizer)\.py|tokenizers"),
        ("output processing", r"dpserve/frontend/output_processor\.py"),
        ("IPC", r"/zmq/|msgspec|dpserve/engine/process\.py|dpserve/frontend/engine_client\.py"),
        ("HTTP/SSE", r"/(uvicorn|starlette|fastapi|h11|httptools|anyio)/|dpserve/server/"),
    ]
]
ORDER = [name for name, _ in CATEGORIES] + ["other"]


# A leaf frame that blocks (py-spy's idle test misses waits in epoll, zmq polls and
# condition variables): such samples are "waiting", not CPU.
WAITING = re.compile(r"^(\S*\.)?(select|poll|_poll|wait|sleep|get|recv|recv_multipart|"
                     r"_recv_bytes|watch|acquire|accept) \(")


def categorise(stack: list[str]) -> str:
    if stack and WAITING.search(stack[-1]):
        return "waiting"
    for frame in reversed(stack):
        for name, pattern in CATEGORIES:
            if pattern.search(frame):
                return name
    return "other"


def role(name: str) -> str:
    """A process name (dpserve::EngineCore_1, ...) -> "engine 1", "API server 0", ..."""
    for marker, who in (("EngineCore_", "engine "), ("APIServer_", "API server "),
                        ("DPCoordinator", "coordinator")):
        if marker in name:
            return who + name.split(marker, 1)[1]
    return name


def parse_raw(path: Path) -> collections.Counter[str]:
    """One process's py-spy raw output -> category -> samples."""
    out: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack_text, _, count = line.rpartition(" ")
        if stack_text and count.isdigit():
            out[categorise(stack_text.split(";")[1:])] += int(count)
    return out


def report(samples: dict[str, collections.Counter[str]], rate: int, seconds: float,
           output_tokens: float, itl_ms: float | None) -> str:
    lines = ["| process | CPU use | threads waiting | " + " | ".join(ORDER) + " |",
             "|---|---:|---:|" + "---:|" * len(ORDER)]
    per_token: collections.Counter[str] = collections.Counter()
    for who, counter in sorted(samples.items()):
        total = sum(n for c, n in counter.items() if c != "waiting")
        if not total:
            continue
        cells = [f"{100 * counter[c] / total:.0f}%" for c in ORDER]
        lines.append(f"| {who.split(':')[0]} | {total / rate / seconds:.2f} cores | "
                     f"{counter['waiting'] / rate / seconds:.2f} | " + " | ".join(cells) + " |")
        for c in ORDER:
            per_token[c] += counter[c] / rate
    if output_tokens:
        total_ms = 1000 * sum(per_token.values()) / output_tokens
        cells = [f"{1000 * per_token[c] / output_tokens:.2f}" for c in ORDER]
        lines.append(f"| CPU ms per output token | {total_ms:.1f} | | " + " | ".join(cells)
                     + " |")
    if itl_ms is not None:
        lines.append(f"\nmean inter-token latency in the window: {itl_ms:.1f} ms; "
                     f"output tokens in the window: {output_tokens:.0f}")
    return "\n".join(lines)


def scrape(url: str) -> dict[str, float]:
    """/metrics -> metric name -> value summed over its label sets."""
    import httpx

    out: dict[str, float] = collections.defaultdict(float)
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name_labels, _, value = line.rpartition(" ")
            out[name_labels.split("{", 1)[0]] += float(value)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="W16")
    p.add_argument("--model", default=None)
    p.add_argument("--serve-options", default="", help="Options for dpserve serve.")
    p.add_argument("--seconds", type=float, default=20.0, help="Sampling window.")
    p.add_argument("--delay", type=float, default=3.0, help="Load time before sampling.")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second.")
    p.add_argument("--out", default=None, help="Append the markdown section to this file.")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)  # a timeout still stops the server
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        sys.exit("bench/profile_serve.py: py-spy not found (pip install py-spy)")
    requests, concurrency = WORKLOADS[args.workload]
    tmp = Path(tempfile.mkdtemp(prefix="dpserve-profile-"))
    server = ServeProcess(args.model, _free_port(), tuple(shlex.split(args.serve_options)),
                          tmp / "serve.log")
    with server:
        _log(f"ready in {server.start(600):.1f} s")
        # Enough requests to outlast the window: repeat the workload's count.
        config = replace(BenchConfig(base_url=server.url), num_prompts=requests * 50,
                         concurrency=concurrency, prompt_len=128, output_len=64,
                         warmup=2, max_duration=args.delay + args.seconds + 30)
        # One py-spy per process: with --subprocesses, py-spy 0.4 labels every sample
        # with the root process, so the roles could not be told apart.
        procs = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(
            recursive=True)]
        cmds = {f"{role(p.name())}:{p.pid}": [
            spy, "record", "--pid", str(p.pid), "--format", "raw", "--rate", str(args.rate),
            "--duration", str(int(args.seconds)), "--nonblocking", "-o", str(tmp / f"{p.pid}.txt")]
            for p in procs}

        async def run() -> object:
            bench = asyncio.create_task(_bench(config))
            await asyncio.sleep(args.delay)
            before = await asyncio.to_thread(scrape, server.url)
            t0 = time.monotonic()
            spies = [await asyncio.create_subprocess_exec(
                *cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for cmd in cmds.values()]
            for spy_proc in spies:
                _, err = await spy_proc.communicate()
                if spy_proc.returncode:
                    raise RuntimeError(f"py-spy failed: {err.decode()[-2000:]}")
            window = (t0, time.monotonic())
            after = await asyncio.to_thread(scrape, server.url)
            bench.cancel()  # the window is what counts; stop the load
            with contextlib.suppress(asyncio.CancelledError):
                await bench
            delta = {k: after[k] - before.get(k, 0.0) for k in after}
            return window, delta

        (t0, t1), delta = asyncio.run(run())
        server.check_alive()
    samples = {who: parse_raw(Path(cmd[-1])) for who, cmd in cmds.items()}
    itl_count = delta.get("dpserve:inter_token_latency_seconds_count", 0.0)
    itl_ms = (1000 * delta["dpserve:inter_token_latency_seconds_sum"] / itl_count
              if itl_count else None)
    text = report(samples, args.rate, t1 - t0,
                  delta.get("dpserve:generation_tokens_total", 0.0), itl_ms)
    header = (f"\n## profile (bench/profile_serve.py), "
              f"{datetime.datetime.now().isoformat(sep=' ', timespec='minutes')}\n\n"
              f"- machine: {machine()}\n- command: `python bench/profile_serve.py "
              f"{shlex.join(argv if argv is not None else sys.argv[1:])}`\n"
              f"- {args.workload}: {concurrency} stream(s), 128 prompt / 64 output tokens; "
              f"py-spy {args.rate} Hz over {t1 - t0:.1f} s, active samples only\n")
    print(header + "\n" + text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(header + "\n" + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
