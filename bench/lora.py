"""LoRA adapters at DP=2: adapter-aware routing (`--load-balance cache-aware`) vs
count-only (`least-loaded`), over a workload spread across --adapters adapters.

The adapters: --adapters random PEFT-format LoRA adapters (rank --rank on q/k/v/o
and gate/up/down, written here from the model's config.json with numpy: no
torch, no peft), so any model works, the default one included. Each engine has
`--max-loras` device slots (default 2) for 8 adapters, so a rank that sees every
adapter must swap slots, and one that sees about half of them swaps less.

Each row starts a fresh `dpserve serve [MODEL] --data-parallel-size 2
--threads-per-engine 1 --enable-lora --max-loras S --max-cpu-loras 8
--load-balance POLICY` (bench/dp_scaling.py's ServeProcess: bounded start,
whole tree stopped), loads every adapter through `POST /v1/load_lora_adapter`
(admin API, unauthenticated on 127.0.0.1), sends --warmup requests, then the
measured load: --requests completions (random token prompts of --prompt-len,
--output-len greedy tokens, ignore_eos), each naming an adapter drawn from a
seeded Zipf-like distribution (weight 1/(i+1)), --concurrency in flight (closed
loop, httpx). Reported per policy: output tok/s, mean latency, the adapters put
into device slots during the measured load (`lora.loads` of every rank in
/engines: heartbeats, read until they stop moving), and adapter-aware's ratios to
count-only. The markdown section for a file in bench/results/ goes to stdout (--out FILE
appends it). Exit status 0 when every measured request completed.

    .venv/bin/python bench/lora.py [--model PATH] [--requests 256 --concurrency 8]
    .venv/bin/python bench/lora.py --requests 16 --warmup 2 --output-len 4 \\
        --prompt-len 16   # a dry run at a tiny size, not a measurement

Timings need an otherwise idle machine. Not here: several API servers (each router
tracks only its own sends), adapter loads during the run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from dp_scaling import ServeProcess, _free_port, _log, begin, machine, publish, run_rows

POLICIES = {"count-only": "least-loaded", "adapter-aware": "cache-aware"}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Outcome:
    """One policy's row."""

    name: str
    policy: str
    command: str
    completed: int = 0
    failed: int = 0
    output_tokens: int = 0
    duration_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    slot_loads: int = 0  # adapters put into device slots during the measured load
    ready_s: float = 0.0
    error: str = ""

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s else 0.0


def make_adapters(model: str | None, root: Path, n: int, rank: int, seed: int) -> list[Path]:
    """`n` random LoRA adapters for `model`, in PEFT's layout (adapter_config.json,
    adapter_model.safetensors; B non-zero so that each changes the model)."""
    from safetensors.numpy import save_file

    from dpserve.checkpoint.loader import resolve_model

    base = resolve_model(model)
    c = json.loads((base / "config.json").read_text())
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    kv = c.get("num_key_value_heads", heads) * head_dim
    inter = c["intermediate_size"]
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv),
              "v_proj": (hidden, kv), "o_proj": (heads * head_dim, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        tensors = {}
        for layer in range(c["num_hidden_layers"]):
            for t in TARGETS:
                part = "self_attn" if t.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) \
                    else "mlp"
                name = f"base_model.model.model.layers.{layer}.{part}.{t}"
                d_in, d_out = shapes[t]
                tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((rank, d_in))
                                                    / d_in ** 0.5).astype(np.float32)
                tensors[f"{name}.lora_B.weight"] = (rng.standard_normal((d_out, rank))
                                                    * 0.05 / rank ** 0.5).astype(np.float32)
        folder = root / f"adapter{i}"
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
            "target_modules": list(TARGETS), "task_type": "CAUSAL_LM"}))
        out.append(folder)
    return out


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[str, list[int]]]:
    """(adapter name, prompt token ids) of every measured request, in sending order."""
    rng = random.Random(args.seed)
    names = [f"adapter{i}" for i in range(args.adapters)]
    weights = [1.0 / (i + 1) for i in range(args.adapters)]
    return [(rng.choices(names, weights)[0],
             [rng.randrange(100, vocab) for _ in range(args.prompt_len)])
            for _ in range(args.requests)]


async def drive(url: str, args: argparse.Namespace, load: list[tuple[str, list[int]]],
                out: Outcome | None) -> None:
    """Closed loop: --concurrency requests in flight until `load` is sent; results into
    `out` (None: a warm-up, results dropped)."""
    queue = list(reversed(load))
    timeout = httpx.Timeout(args.request_timeout)

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            model, prompt = queue.pop()
            t0 = time.monotonic()
            try:
                resp = await client.post(url + "/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": args.output_len,
                    "temperature": 0.0, "ignore_eos": True})
                resp.raise_for_status()
                tokens = resp.json()["usage"]["completion_tokens"]
            except (httpx.HTTPError, KeyError, ValueError) as e:
                if out is not None:
                    out.failed += 1
                    out.error = out.error or f"{type(e).__name__}: {e}"
                continue
            if out is not None:
                out.completed += 1
                out.output_tokens += tokens
                out.latencies.append(time.monotonic() - t0)

    async with httpx.AsyncClient(timeout=timeout) as client:
        start = time.monotonic()
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
        if out is not None:
            out.duration_s = time.monotonic() - start


def slot_loads(url: str, settle_s: float = 3.0) -> int:
    """Adapters put into device slots so far, every rank (heartbeats reach /engines
    within a second or two: read until two reads a second apart agree, at most
    `settle_s` more seconds)."""
    def read() -> int:
        rows = httpx.get(url + "/engines", timeout=10).json()["engines"]
        return sum((r.get("lora") or {}).get("loads", 0) for r in rows)

    last, deadline = read(), time.monotonic() + settle_s
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = read()
        if now == last:
            break
        last = now
    return last


def serve_options(args: argparse.Namespace, policy: str) -> tuple[str, ...]:
    return ("--data-parallel-size", "2", "--threads-per-engine", "1", "--enable-lora",
            "--max-loras", str(args.max_loras), "--max-cpu-loras", str(args.adapters),
            "--max-lora-rank", str(args.rank), "--enable-admin-api",
            "--allow-unauthenticated-admin", "--load-balance", policy, *args.serve_arg)


def run_row(args: argparse.Namespace, name: str, adapters: list[Path],
            load: list[tuple[str, list[int]]], vocab: int, log_path: Path) -> Outcome:
    """A fresh server with this policy: adapters loaded, warm-up, the measured load."""
    policy = POLICIES[name]
    server = ServeProcess(args.model, args.port or _free_port(), serve_options(args, policy),
                          log_path)
    out = Outcome(name, policy, shlex.join(["dpserve", "serve", *server.argv[4:]]))
    _log(f"  starting: {out.command}")
    try:
        with server:
            out.ready_s = server.start(args.start_timeout)
            for i, path in enumerate(adapters):
                resp = httpx.post(server.url + "/v1/load_lora_adapter", timeout=300,
                                  json={"lora_name": f"adapter{i}", "lora_path": str(path)})
                if resp.status_code != 200:
                    raise RuntimeError(f"loading adapter{i}: {resp.status_code} {resp.text}")
            warm = workload(argparse.Namespace(**{**vars(args), "requests": args.warmup,
                                                  "seed": args.seed + 1}), vocab)
            asyncio.run(drive(server.url, args, warm, None))
            before = slot_loads(server.url)
            _log(f"  ready in {out.ready_s:.1f} s; {len(load)} requests ...")
            asyncio.run(drive(server.url, args, load, out))
            out.slot_loads = slot_loads(server.url) - before
            server.check_alive()
    except (RuntimeError, OSError, httpx.HTTPError) as e:
        out.error = f"{type(e).__name__}: {e}"
        _log(f"  error: {out.error}")
    _log(f"  {out.tok_s:.1f} output tok/s, {out.slot_loads} slot loads, {out.completed} ok "
         f"/ {out.failed} failed in {out.duration_s:.1f} s")
    return out


def markdown(args: argparse.Namespace, outcomes: list[Outcome]) -> str:
    model = args.model or "default (SmolLM2-135M-Instruct)"
    lines = [
        f"\n## LoRA adapters at DP=2: adapter-aware vs count-only routing (bench/lora.py), "
        f"{datetime.datetime.now().isoformat(sep=' ', timespec='minutes')}\n",
        f"- machine: {machine()}",
        f"- command: `python {shlex.join(sys.argv)}`",
        f"- model: {model}; {args.adapters} random rank-{args.rank} adapters (q/k/v/o, "
        f"gate/up/down), {args.max_loras} device slots per engine; load: {args.requests} "
        f"completions, adapter drawn with weight 1/(i+1), {args.prompt_len} random prompt "
        f"tokens -> {args.output_len} output tokens (ignore_eos, temperature 0, seed "
        f"{args.seed}), concurrency {args.concurrency}, {args.warmup} warm-up requests",
        f"- server: `dpserve serve [MODEL] --port PORT "
        f"{shlex.join(serve_options(args, 'POLICY'))}`",
        "", "| routing | --load-balance | output tok/s | mean latency | slot loads | "
        "requests |", "| --- " * 6 + "|"]
    for o in outcomes:
        mean = f"{statistics.mean(o.latencies):.2f} s" if o.latencies else "n/a"
        req = f"{o.completed} ok" + (f", {o.failed} failed ({o.error[:80]})" if o.failed
                                     else "")
        lines.append(f"| {o.name} | {o.policy} | {o.tok_s:.1f} | {mean} | {o.slot_loads} | "
                     f"{req} |")
    by = {o.name: o for o in outcomes}
    base, aware = by.get("count-only"), by.get("adapter-aware")
    if base is not None and aware is not None and base.tok_s:
        lines += ["", f"- adapter-aware / count-only: output tok/s "
                      f"**{aware.tok_s / base.tok_s:.2f}x**, slot loads "
                      f"{aware.slot_loads} vs {base.slot_loads}"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: built-in SmolLM2-135M-Instruct")
    p.add_argument("--adapters", type=int, default=8, help="LoRA adapters in the workload")
    p.add_argument("--rank", type=int, default=8, help="rank of every adapter")
    p.add_argument("--max-loras", type=int, default=2, help="device slots per engine")
    p.add_argument("--requests", type=int, default=256, help="measured requests")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--warmup", type=int, default=8, help="warm-up requests per row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated rows (default: {','.join(POLICIES)})")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--serve-arg", action="append", default=[],
                   help="an extra `dpserve serve` argument for every row (repeatable)")
    p.add_argument("--port", type=int, default=0, help="port (default: a free one per row)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--out", metavar="FILE", help="also append the markdown to FILE")
    args = p.parse_args(argv)
    for name in ("adapters", "rank", "max_loras", "requests", "prompt_len", "output_len",
                 "concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_loras > args.adapters:
        p.error("--max-loras must be at most --adapters")
    args.policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    bad = set(args.policies) - set(POLICIES)
    if bad or not args.policies:
        p.error(f"--policies: unknown {sorted(bad)}; choose from {', '.join(POLICIES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vocab = begin("lora", args.model)
    if vocab is None:
        return 2
    load = workload(args, vocab)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lora_bench_") as tmp:
        adapters = make_adapters(args.model, Path(tmp) / "adapters", args.adapters,
                                 args.rank, args.seed)
        outcomes = run_rows(args.policies, lambda name, log: run_row(
            args, name, adapters, load, vocab, log), Path(tmp))
    if outcomes is None:
        return 130
    publish(markdown(args, outcomes), args.out, start)
    return 0 if all(o.completed == args.requests for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
