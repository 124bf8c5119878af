"""Data-parallel scaling of `dpserve serve`: real servers under `dpserve bench serve` load.

Scenarios (all by default; --scenarios picks), on the default model unless --model:

* throughput: DP=1 vs DP=2, one torch thread per engine (`--threads-per-engine 1`),
  concurrency 32, 128 -> 64 tokens: output tok/s and the ratio DP2/DP1 (aim: >= 1.9x);
  DP=2 twice: each engine bound to a core of its own (`--cpu-bind auto`, the
  default) and left to the OS scheduler (`--cpu-bind none`).
* skewed: DP=2, one thread per engine, prompts mixed 16:8,1024:1 (eight 16-token
  prompts per 1024-token one, in a seeded order), 16 output tokens, concurrency 8;
  once with `--load-balance round-robin`, once `least-loaded`, the very same request
  sequence: TTFT p50/p99 overall, and mean/p90/p99 per prompt length. A 1024-token
  prefill holds its engine for one long step (~3 s on one core with the default
  model), stalling everything placed there; round-robin keeps sending every other
  request to it, a load-aware balancer sends the short ones to the other engine, so
  the short prompts' mean and p90 TTFT tell the two apart. The mix is lean on long
  prompts on purpose: in a closed loop (a new request as soon as one ends) long
  prompts pile up in flight, and at 1 long per 4 short both engines are mostly busy
  with long prefills, leaving little for any balancer to steer around.
* all-cores: DP=1 with torch's default threads vs DP=2 with its default threads per
  engine (cores // 2), concurrency 32, 128 -> 64: the way a user would run it.

Each row starts a fresh server (`python -m dpserve.cli serve [MODEL] --port P OPTIONS`,
its output in a temporary log), waits for /health (bounded, watching the process),
warms it up and runs the load in this process with dpserve.benchmark.serve (the code
behind `dpserve bench serve`), then stops it: SIGTERM, wait, and SIGKILL whatever is
left of its process tree (engines and coordinator are titled `dpserve::EngineCore_0`
etc., so look them up by pid, not by name). At the end it prints a markdown section
for a file in bench/results/ (date, machine, command, one table per scenario); --out FILE also
appends it there. Exit status 0 when every measured request of every row completed.

    .venv/bin/python bench/dp_scaling.py [--scenarios throughput,skewed] [--out FILE]

A full run with the default model on an idle 2-core dev machine should take 6-7
minutes (server starts ~6-10 s each; rows ~0.5-1 min, DP=1 on one thread the longest).
Not here: several API servers, request-rate (Poisson) arrivals, GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import httpx
import psutil

from dpserve.benchmark.serve import (
    BenchConfig,
    BenchResult,
    Latency,
    parse_prompt_mix,
    run_benchmark,
)
from dpserve.benchmark.serve import machine as cpu_and_cores
from dpserve.config import ConfigError

SCENARIOS = ("throughput", "skewed", "all-cores")
_STOP_TIMEOUT_S = 30.0  # SIGTERM -> exit (uvicorn drains 2 s, then engines shut down)
_TREE_TIMEOUT_S = 10.0  # server gone -> its children gone


# ---------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Row:
    """One server configuration: a row of a scenario's table."""

    label: str  # what the options amount to, e.g. "DP=2, 1 thread each"
    serve_options: tuple[str, ...]  # `dpserve serve` flags after the model and --port


@dataclass(frozen=True)
class Scenario:
    """One table: the same load against each row's server, in turn."""

    name: str
    title: str
    rows: tuple[Row, ...]
    workload: dict[str, Any]  # BenchConfig fields: num_prompts, concurrency, lengths
    kind: str  # "scaling" (tok/s and ratio to the first row) | "latency" (TTFT per length)


@dataclass
class Outcome:
    """What one row measured, or why it could not."""

    row: Row
    command: str  # the server's command line, with the port
    result: BenchResult | None = None
    ready_s: float = 0.0  # launch -> /health answers 200
    error: str = ""
    notes: list[str] = field(default_factory=list)  # e.g. processes that had to be killed


def make_scenarios(args: argparse.Namespace) -> dict[str, Scenario]:
    one, dp2 = ("--threads-per-engine", "1"), ("--data-parallel-size", "2")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    uniform = {"num_prompts": 96, "concurrency": 32, "prompt_len": 128, "output_len": 64}
    skewed = {"num_prompts": 216, "concurrency": args.skew_concurrency,
              "prompt_mix": args.skew_mix, "output_len": 16}
    lb = "--load-balance"
    all_rows = {
        "throughput": (Row("DP=1, 1 thread", one),
                       Row("DP=2, 1 thread each, a core each", dp2 + one),
                       Row("DP=2, 1 thread each, unbound", dp2 + one + ("--cpu-bind", "none"))),
        "skewed": (Row("DP=2, blind to load", dp2 + one + (lb, "round-robin")),
                   Row("DP=2, load-aware", dp2 + one + (lb, "least-loaded"))),
        "all-cores": (Row("DP=1, torch's default threads", ()),
                      Row(f"DP=2, {max(1, (cores or 1) // 2)} thread(s) each (cores // 2)",
                          dp2)),
    }
    titles = {
        "throughput": "DP=1 vs DP=2, one torch thread per engine",
        "skewed": "DP=2 under skewed prompt lengths: round-robin vs least-loaded",
        "all-cores": "DP=1 vs DP=2 with default threads (all cores)",
    }
    workloads = {"throughput": uniform, "skewed": skewed, "all-cores": uniform}
    out = {}
    for name in SCENARIOS:
        workload = dict(workloads[name])
        if args.num_prompts is not None:
            workload["num_prompts"] = args.num_prompts
        out[name] = Scenario(name, titles[name], all_rows[name], workload,
                             "latency" if name == "skewed" else "scaling")
    return out


# ---------------------------------------------------------------- one server


class ServeProcess:
    """One `dpserve serve` subprocess: started, healthy, then stopped with its whole tree.

    It runs in a session of its own, so a last sweep finds any process of its group
    that outlived the tree snapshot (the API server renames itself, so names are
    useless for this).
    """

    def __init__(self, model: str | None, port: int, options: tuple[str, ...],
                 log_path: Path) -> None:
        self.argv = [sys.executable, "-m", "dpserve.cli", "serve",
                     *([model] if model else []), "--port", str(port), *options]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.notes: list[str] = []

    def start(self, timeout: float) -> float:
        """Launch and wait until /health answers 200; seconds taken. RuntimeError if the
        server exits first or is not healthy within `timeout`."""
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was "
                                   f"ready:\n{self.log_tail()}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"server not healthy after {timeout:g} s:\n{self.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            time.sleep(0.25)

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode} during the run:\n"
                               f"{self.log_tail()}")

    def stop(self) -> str:
        """SIGTERM, wait; then kill what is left of the tree and of the process group.
        Returns a one-line summary (anomalies also go to `notes`)."""
        if self.proc is None:
            return "not running"
        proc, self.proc = self.proc, None
        tree = _descendants(proc.pid)  # before it exits: orphans cannot be found from it
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.notes.append(f"server ignored SIGTERM for {_STOP_TIMEOUT_S:g} s; killed")
                tree = _descendants(proc.pid) or tree
                proc.kill()
                proc.wait(10)
        if proc.returncode not in (0, 128 + signal.SIGTERM, -signal.SIGTERM):
            self.notes.append(f"server exit code {proc.returncode}")
        _, alive = psutil.wait_procs(tree, timeout=_TREE_TIMEOUT_S)
        alive += [p for p in _group_members(proc.pid) if p not in alive]
        for p in alive:
            self.notes.append(f"killed leftover pid {p.pid}")
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        _, still = psutil.wait_procs(alive, timeout=5)
        self.notes += [f"pid {p.pid} survived SIGKILL" for p in still]
        return (f"server exit code {proc.returncode}; {len(tree)} child process(es) ended, "
                f"{len(alive)} killed")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        # Another Ctrl-C or SIGTERM now would leave processes behind: hold them until done.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            _log(f"  stopped: {self.stop()}")
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _group_members(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of process group `pgid`."""
    members = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                members.append(p)
    return members


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_row(args: argparse.Namespace, row: Row, config: BenchConfig, log_path: Path,
            ) -> Outcome:
    """Fresh server with the row's options, the load, then the server stopped."""
    port = args.port or _free_port()
    server = ServeProcess(args.model, port, row.serve_options, log_path)
    out = Outcome(row, shlex.join(["dpserve", "serve", *server.argv[4:]]))
    _log(f"  starting: {out.command}")
    try:
        with server:
            out.ready_s = server.start(args.start_timeout)
            _log(f"  ready in {out.ready_s:.1f} s; {config.num_prompts} requests ...")
            out.result = asyncio.run(_bench(replace(config, base_url=server.url)))
            server.check_alive()
    except (RuntimeError, OSError, httpx.HTTPError, asyncio.TimeoutError) as e:
        out.error = f"{type(e).__name__}: {e}"
        _log(f"  error: {out.error}")
    out.notes = server.notes
    for note in out.notes:
        _log(f"  note: {note}")
    if out.result is not None:
        r = out.result
        _log(f"  {r.output_throughput:.1f} output tok/s, TTFT p50 {_s(r.ttft_ms, 'p50')}, "
             f"{r.completed} ok / {r.failed} failed / {r.not_sent} not sent "
             f"in {r.duration_s:.1f} s")
    return out


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds like Ctrl-C: the running server is stopped on the way


async def _bench(config: BenchConfig) -> BenchResult:
    """run_benchmark; SIGTERM cancels it (raising inside a task would leave asyncio noise)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await run_benchmark(config)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)  # resets it to SIG_DFL
        signal.signal(signal.SIGTERM, _on_sigterm)


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- markdown


def _s(lat: Latency | None, key: str) -> str:
    return "n/a" if lat is None else f"{getattr(lat, key) / 1000:.2f} s"


def _ms(lat: Latency | None, key: str) -> str:
    return "n/a" if lat is None else f"{getattr(lat, key):.0f} ms"


def _setup_cells(out: Outcome) -> str:
    """The first two cells: what the row is, and its exact `dpserve serve` options."""
    opts = " ".join(out.row.serve_options)
    return f"{out.row.label} | " + (f"`{opts}`" if opts else "(none)")


def _requests_cell(out: Outcome) -> str:
    if out.result is None:
        return f"error: {out.error.splitlines()[0][:120]}"
    r = out.result
    cell = f"{r.completed} ok" + (f", {r.failed} failed, {r.not_sent} not sent"
                                  if r.failed or r.not_sent else "")
    return cell + (f"; then {out.error.splitlines()[0][:120]}" if out.error else "")


def scaling_table(outcomes: list[Outcome]) -> list[str]:
    lines = ["| setup | serve options | output tok/s | TTFT p50 | ITL p50 | E2E p50 | requests |",
             "| --- " * 7 + "|"]
    base = outcomes[0].result.output_throughput if outcomes[0].result else 0.0
    for i, out in enumerate(outcomes):
        r = out.result
        tok = "n/a" if r is None else f"{r.output_throughput:.1f}"
        if r is not None and i and base > 0:
            tok = f"**{tok} ({r.output_throughput / base:.2f}x)**"
        lat = [_s(r.ttft_ms if r else None, "p50"), _ms(r.itl_ms if r else None, "p50"),
               _s(r.e2e_ms if r else None, "p50")]
        lines.append(f"| {_setup_cells(out)} | {tok} | {' | '.join(lat)} | "
                     f"{_requests_cell(out)} |")
    return lines


def ttft_by_length(res: BenchResult, lengths: list[int]) -> dict[int, Latency | None]:
    """TTFT of completed requests grouped by the mix length nearest their prompt length."""
    groups: dict[int, list[float]] = {n: [] for n in lengths}
    for r in res.requests:
        if r.ok and r.ttft_s is not None:
            groups[min(lengths, key=lambda n: abs(n - r.prompt_tokens))].append(r.ttft_s)
    return {n: Latency.of(v) for n, v in groups.items()}


def latency_table(outcomes: list[Outcome], mix: str) -> list[str]:
    lengths = [n for n, _ in parse_prompt_mix(mix)]
    per_len = " | ".join(f"{n}-token TTFT mean / p90 / p99" for n in lengths)
    lines = [f"| setup | serve options | TTFT p50 | TTFT p99 | {per_len} | ITL p99 | "
             f"output tok/s | duration | requests |",
             "| --- " * (8 + len(lengths)) + "|"]
    for out in outcomes:
        r = out.result
        if r is None:
            lines.append(f"| {_setup_cells(out)} |" + " n/a |" * (5 + len(lengths))
                         + f" {_requests_cell(out)} |")
            continue
        by_len = ttft_by_length(r, lengths)
        cells = [_s(r.ttft_ms, "p50"), _s(r.ttft_ms, "p99"),
                 *(" / ".join(_s(by_len[n], k) for k in ("mean", "p90", "p99"))
                   for n in lengths),
                 _ms(r.itl_ms, "p99"), f"{r.output_throughput:.1f}", f"{r.duration_s:.1f} s"]
        lines.append(f"| {_setup_cells(out)} | {' | '.join(cells)} | {_requests_cell(out)} |")
    return lines


def bench_command(config: BenchConfig) -> str:
    """The equivalent `dpserve bench serve` command (non-default options only)."""
    words = ["dpserve", "bench", "serve"]
    for f in fields(BenchConfig):
        value = getattr(config, f.name)
        if f.name != "base_url" and value != f.default:
            words += ["--" + f.name.replace("_", "-"), str(value)]
    return shlex.join(words)


def scenario_markdown(sc: Scenario, config: BenchConfig, outcomes: list[Outcome]) -> str:
    c = config
    lines = [f"\n### {sc.name}: {sc.title}\n",
             f"- load: {c.num_prompts} requests, concurrency {c.concurrency}, {c.prompt_desc} "
             f"prompt -> {c.output_len} output tokens (`{bench_command(c)}`)",
             f"- server start to ready: "
             f"{', '.join(f'{o.ready_s:.1f} s' for o in outcomes if o.ready_s) or 'n/a'}", ""]
    if sc.kind == "scaling":
        lines += scaling_table(outcomes)
    else:
        lines += latency_table(outcomes, c.prompt_mix or str(c.prompt_len) + ":1")
    notes = [f"{o.row.label}: {n}" for o in outcomes for n in o.notes]
    if notes:
        lines += ["", *(f"- note: {n}" for n in notes)]
    return "\n".join(lines) + "\n"


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu_and_cores()}, {gpu}, torch {torch.__version__}"


def header_markdown(args: argparse.Namespace, vocab_size: int) -> str:
    model = args.model or "default (SmolLM2-135M-Instruct)"
    return "\n".join([
        f"\n## data-parallel scaling (bench/dp_scaling.py), "
        f"{datetime.datetime.now().isoformat(sep=' ', timespec='minutes')}\n",
        f"- machine: {machine()}",
        f"- command: `python {shlex.join(sys.argv)}`",
        f"- model: {model}; each row is a fresh `dpserve serve [MODEL] --port PORT "
        f"OPTIONS`, loaded by the `dpserve bench serve` code: completions, random token "
        f"prompts (ids < {vocab_size}), ignore_eos, temperature 0, seed {args.seed}, "
        f"{args.warmup} warm-up requests first",
    ]) + "\n"


# ---------------------------------------------------------------- main


def vocab_size(model: str | None) -> int:
    """The model's vocabulary (prompt token ids must stay below it)."""
    from dpserve.checkpoint.loader import resolve_model  # the default: a cached conversion

    with open(resolve_model(model) / "config.json") as f:
        return int(json.load(f)["vocab_size"])


def parse_rows(parser: Any, text: str, rows: Sequence[str]) -> list[str]:
    """A comma-separated --rows value, each one of `rows`; else a usage error."""
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    if not chosen or set(chosen) - set(rows):
        parser.error(f"--rows: choose from {', '.join(rows)}")
    return chosen


def begin(name: str, model: str | None) -> int | None:
    """A benchmark's start: SIGTERM stops it as Ctrl-C does (its servers with it); the
    model's vocabulary, or None (the error logged, naming `name`) when unreadable."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return vocab_size(model)
    except (ConfigError, OSError, KeyError, ValueError) as e:
        _log(f"{name}: error: model {model or '(default)'}: {e}")
        return None


def run_rows(rows: list[str], run: Any, log_dir: Path) -> list[Any] | None:
    """Each row in turn, `run(row, log_path)` (a server per row, stopped at its end),
    its server's log in `log_dir`: the outcomes, or None when interrupted (Ctrl-C or
    SIGTERM: the running server was stopped; nothing is to be printed)."""
    outcomes = []
    for i, row in enumerate(rows):
        _log(f"[{row}]")
        try:
            outcomes.append(run(row, log_dir / f"{i}_{row.replace(' ', '_')}.log"))
        except (KeyboardInterrupt, asyncio.CancelledError):
            _log("interrupted (the running server was stopped); no results printed")
            return None
    return outcomes


def publish(text: str, out: str | None, start: float) -> None:
    """The end of a run: how long it took, its markdown to stdout and appended to
    `out` (--out) for a file in bench/results/."""
    _log(f"done in {time.monotonic() - start:.0f} s")
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated, from {', '.join(SCENARIOS)} (default: all)")
    p.add_argument("--model", default=None, help="default: built-in SmolLM2-135M-Instruct")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="measured requests per row (default: 96; skewed 216)")
    p.add_argument("--max-duration", type=float, default=600.0,
                   help="seconds one row's load may take (warm-up included); the rest is "
                        "reported as not sent")
    p.add_argument("--skew-mix", default="16:8,1024:1",
                   help="skewed: prompt lengths LEN:WEIGHT,... (see dpserve bench serve "
                        "--prompt-mix)")
    p.add_argument("--skew-concurrency", type=int, default=8, help="skewed: concurrency")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests per row")
    p.add_argument("--port", type=int, default=0,
                   help="port of every server in turn (default: a free one per server)")
    p.add_argument("--start-timeout", type=float, default=300.0,
                   help="seconds a server may take to answer /health")
    p.add_argument("--out", metavar="FILE", help="also append the markdown to FILE")
    args = p.parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown or not args.scenarios:
        p.error(f"--scenarios: unknown {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    try:
        parse_prompt_mix(args.skew_mix)
    except ValueError as e:
        p.error(f"--skew-mix: {e}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vocab = begin("dp_scaling", args.model)
    if vocab is None:
        return 2
    scenarios = make_scenarios(args)
    try:  # every load validated before any server starts
        plan = [(scenarios[name], BenchConfig(
            **scenarios[name].workload, vocab_size=vocab, seed=args.seed, warmup=args.warmup,
            max_duration=args.max_duration)) for name in args.scenarios]
    except ValueError as e:
        _log(f"dp_scaling: error: {e}")
        return 2
    sections, all_ok, start = [header_markdown(args, vocab)], True, time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dp_scaling_") as tmp:
        for sc, config in plan:
            _log(f"[{sc.name}] {sc.title}")
            try:
                outcomes = [run_row(args, row, config, Path(tmp) / f"{sc.name}_{i}.log")
                            for i, row in enumerate(sc.rows)]
            except (KeyboardInterrupt, asyncio.CancelledError):
                _log("interrupted (the running server was stopped); no results printed")
                return 130
            all_ok &= all(o.result is not None and o.result.completed == config.num_prompts
                          for o in outcomes)
            sections.append(scenario_markdown(sc, config, outcomes))
    publish("".join(sections), args.out, start)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
