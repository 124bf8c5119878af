"""What one fault costs a running `dpserve serve --data-parallel-size 2`, measured.

For each fault a fresh server runs a steady closed-loop load (C streaming clients,
greedy, --prompt-len -> --output-len tokens, ignore_eos); after a warm-up the fault
is caused for real, and the run goes on until the server is back to full strength
(or --settle-s passes), then a few seconds more. Faults:

    kill         SIGKILL EngineCore_1 (it is restarted)
    stop         SIGSTOP EngineCore_1 for --stop-s seconds, then SIGCONT
    hang         EngineCore_1's forward hangs (DPSERVE_FAULT_FORWARD_HANG_AT, test-only
                 injection; --engine-stall-timeout --stall-s); the rank stays out
    coordinator  SIGKILL the DP coordinator (it is restarted)
    api-server   SIGKILL APIServer_1 of two (--api-server-count 2; it is restarted)

Per fault: time to detect it (the rank leaves "serving" in /health, or the dead
process's replacement appears), time until full capacity again (every rank serving /
the replacement serving), requests lost (failed or cut; a killed API server's own
open connections are lost with it and counted), requests moved and tokens
recomputed (from /metrics), and output tok/s before, in the worst second after the
fault, and after recovery. vLLM's behaviour on the same faults, for comparison, is
its documented fail-stop design (one engine core's death ends the whole server;
nothing restarts it): every request in flight is lost and the server is gone until
an orchestrator restarts all of it.

    .venv/bin/python bench/faults.py [--faults kill,stop] [--model M] [--out FILE]

Needs an otherwise idle machine for meaningful throughput figures (2 cores: other
load slows the engines many times over); the fault handling itself is measured
either way. Exit status 0 when no request was lost in the engine faults.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import random
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from dp_scaling import ServeProcess, _descendants, _free_port, machine

FAULTS = ("kill", "stop", "hang", "coordinator", "api-server")
_WORDS = ("data parallel serving runs several replicas of one model behind one endpoint "
          "and a coordinator keeps them in step while requests come and go").split()


@dataclass
class Run:
    fault: str
    ok: int = 0
    lost: int = 0
    token_times: list[float] = field(default_factory=list)
    fault_at: float = 0.0
    detected_at: float | None = None
    recovered_at: float | None = None
    notes: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


async def _client(url: str, model: str, args: argparse.Namespace, run: Run, stop: asyncio.Event,
                  seed: int) -> None:
    """Closed loop: one streamed request after another until `stop`."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_keepalive_connections=0)  # spread over API servers
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        while not stop.is_set():
            body = {"model": model, "prompt": _prompt(rng, args.prompt_len),
                    "max_tokens": args.output_len, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            tokens, finished = 0, False
            try:
                async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        raise RuntimeError(f"HTTP {resp.status_code}")
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            raise RuntimeError(chunk["error"]["message"])
                        choice = chunk["choices"][0]
                        if choice.get("text"):
                            tokens += 1
                            run.token_times.append(time.monotonic())
                        finished = finished or choice.get("finish_reason") == "length"
                if not finished:
                    raise RuntimeError("stream ended early")
                run.ok += 1
            except (httpx.HTTPError, RuntimeError) as e:
                run.lost += 1
                if len(run.notes) < 5:
                    run.notes.append(f"lost a request: {e}")


def _ranks(url: str) -> list[dict]:
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        return httpx.get(url + "/health", timeout=2).json()["ranks"]
    return []


def _child(server: ServeProcess, name: str) -> psutil.Process | None:
    assert server.proc is not None
    found = [p for p in _descendants(server.proc.pid)
             if p.is_running() and p.name() == f"dpserve::{name}"]
    return found[0] if found else None


def _all_serving(url: str) -> bool:
    ranks = _ranks(url)
    return bool(ranks) and all(r["state"] == "serving" for r in ranks)


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    out = {}
    for name in ("request_retries", "request_migrations", "request_recomputed_tokens",
                 "engine_restarts"):
        out[name] = sum(float(v) for v in re.findall(
            rf"^dpserve:{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return out


async def _watch_fault(server: ServeProcess, run: Run, args: argparse.Namespace) -> None:
    """Cause the fault, then follow it: detection, recovery."""
    url = server.url
    victim_name = {"coordinator": "DPCoordinator", "api-server": "APIServer_1"}.get(
        run.fault, "EngineCore_1")
    victim = _child(server, victim_name)
    assert victim is not None, f"no {victim_name}"
    run.fault_at = time.monotonic()
    if run.fault in ("kill", "coordinator", "api-server"):
        victim.send_signal(signal.SIGKILL)
    elif run.fault == "stop":
        victim.send_signal(signal.SIGSTOP)
    deadline = run.fault_at + args.settle_s
    resumed = False
    while time.monotonic() < deadline:
        now = time.monotonic()
        if run.fault in ("coordinator", "api-server"):
            new = await asyncio.to_thread(_child, server, victim_name)
            if new is not None and new.pid != victim.pid:
                run.detected_at = run.detected_at or now
                if run.fault == "coordinator" or "restarted" in server.log_tail(20000):
                    run.recovered_at = now
                    return
        else:
            ranks = await asyncio.to_thread(_ranks, url)
            state = ranks[1]["state"] if len(ranks) > 1 else "?"
            if run.detected_at is None and state not in ("serving", "?"):
                run.detected_at = now
            if run.fault == "stop" and not resumed and now - run.fault_at >= args.stop_s:
                victim.send_signal(signal.SIGCONT)
                resumed = True
                run.notes.append(f"SIGCONT after {args.stop_s:g} s")
            if run.detected_at is not None and state == "serving" and \
                    (run.fault != "stop" or resumed):
                run.recovered_at = now
                return
        await asyncio.sleep(0.05)
    if run.fault == "stop" and not resumed:
        victim.send_signal(signal.SIGCONT)


async def _load(server: ServeProcess, model: str, args: argparse.Namespace, run: Run) -> None:
    stop = asyncio.Event()
    clients = [asyncio.create_task(_client(server.url, model, args, run, stop, seed))
               for seed in range(args.concurrency)]
    await asyncio.sleep(args.warmup_s)
    await _watch_fault(server, run, args)
    await asyncio.sleep(args.after_s)
    stop.set()
    await asyncio.gather(*clients)


def _rate(times: list[float], start: float, end: float) -> float:
    return sum(start <= t < end for t in times) / max(end - start, 1e-9)


def _summary(run: Run, args: argparse.Namespace) -> dict[str, str]:
    t0 = run.fault_at
    before = _rate(run.token_times, t0 - args.warmup_s / 2, t0)
    worst = min((_rate(run.token_times, t, t + 1.0)
                 for t in [t0 + 0.25 * i for i in range(int(4 * (args.settle_s - 1)))]
                 if t + 1.0 <= (run.recovered_at or t0 + args.settle_s)), default=before)
    end = max(run.token_times, default=t0)
    after = _rate(run.token_times, (run.recovered_at or end) + 1.0, end) \
        if run.recovered_at and end > run.recovered_at + 2 else float("nan")

    def secs(t: float | None) -> str:
        return f"{t - t0:.2f} s" if t is not None else "not within the run"

    return {"fault": run.fault, "detect": secs(run.detected_at),
            "full capacity": secs(run.recovered_at), "completed": str(run.ok),
            "lost": str(run.lost),
            "moved (retried / migrated)": f"{run.metrics.get('request_retries', 0):.0f} / "
                                          f"{run.metrics.get('request_migrations', 0):.0f}",
            "tokens recomputed": f"{run.metrics.get('request_recomputed_tokens', 0):.0f}",
            "tok/s before / worst 1 s / after": f"{before:.1f} / {worst:.1f} / {after:.1f}"}


def run_fault(fault: str, args: argparse.Namespace, log_dir: Path) -> Run:
    options = ["--data-parallel-size", "2", "--threads-per-engine", "1",
               "--max-model-len", str(args.prompt_len * 4 + args.output_len + 64)]
    env_note = ""
    if fault == "api-server":
        options += ["--api-server-count", "2"]
    if fault == "hang":
        options += ["--engine-stall-timeout", str(args.stall_s)]
        env_note = "DPSERVE_FAULT_FORWARD_HANG_AT=200 DPSERVE_FAULT_RANK=1 "
    run = Run(fault)
    server = ServeProcess(args.model, _free_port(), tuple(options), log_dir / f"{fault}.log")
    with _env({"DPSERVE_FAULT_FORWARD_HANG_AT": "200", "DPSERVE_FAULT_RANK": "1"}
              if fault == "hang" else {}), server:
        server.start(timeout=300)
        model = args.model or "SmolLM2-135M-Instruct"
        asyncio.run(_load(server, model, args, run))
        run.metrics = _metrics(server.url)
        server.check_alive()
    run.notes += server.notes
    argv = " ".join(["dpserve serve", *([args.model] if args.model else []), *options])
    run.notes.insert(0, f"`{env_note}{argv}`")
    return run


@contextlib.contextmanager
def _env(values: dict[str, str]):
    import os

    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def markdown(runs: list[Run], args: argparse.Namespace, argv: list[str]) -> str:
    rows = [_summary(r, args) for r in runs]
    cols = list(rows[0])
    lines = [f"## bench/faults.py, {datetime.date.today().isoformat()}", "",
             f"- machine: {machine()}",
             f"- command: `{' '.join(['python bench/faults.py', *argv])}`",
             f"- load: {args.concurrency} streaming clients in a closed loop, "
             f"{args.prompt_len} prompt words -> {args.output_len} tokens, greedy, "
             f"ignore_eos; model {args.model or 'default (SmolLM2-135M-Instruct)'}; "
             f"DP=2, one thread per engine", "",
             "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(r[c] for c in cols) + " |" for r in rows]
    lines += ["", "vLLM 0.32 on the same faults (its design: fail-stop): an engine core's "
              "death or a killed DP coordinator / API server ends the whole server, every "
              "request in flight is lost, and nothing restarts it; a frozen or hung engine "
              "keeps /health at 200 and keeps getting requests.", ""]
    for r in runs:
        lines += [f"- {r.fault}: " + "; ".join(r.notes)]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--model", default=None, help="default: the built-in model")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32, help="prompt words")
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--warmup-s", type=float, default=8.0)
    p.add_argument("--after-s", type=float, default=6.0)
    p.add_argument("--settle-s", type=float, default=60.0)
    p.add_argument("--stop-s", type=float, default=6.0)
    p.add_argument("--stall-s", type=float, default=5.0)
    p.add_argument("--out", default=None, help="append the markdown here")
    args = p.parse_args(argv)
    bad = set(args.faults.split(",")) - set(FAULTS)
    if bad:
        p.error(f"--faults: unknown {', '.join(sorted(bad))}; choose from {', '.join(FAULTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="dpserve-faults-") as tmp:
        for fault in args.faults.split(","):
            print(f"fault {fault} ...", file=sys.stderr, flush=True)
            run = run_fault(fault, args, Path(tmp))
            print(f"  {_summary(run, args)}", file=sys.stderr, flush=True)
            runs.append(run)
    text = markdown(runs, args, argv)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)
    return 0 if all(r.lost == 0 for r in runs if r.fault != "api-server") else 1


if __name__ == "__main__":
    sys.exit(main())
