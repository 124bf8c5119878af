"""Mixture of experts at DP=2, with and without expert parallelism (`dpserve serve`).

The model: a random Mixtral-shaped checkpoint built here with transformers
(8 experts, top-2; by default hidden 768, expert intermediate 2048, 6 layers:
about 0.9 GB of expert weights in float32, most of the model), kept in
--model-dir between runs. Rows, each a fresh `dpserve serve MODEL
--data-parallel-size 2 --threads-per-engine 1 ...`:

* dp2: every rank holds every expert (lockstep on by itself, as for any MoE);
* dp2-ep: `--enable-expert-parallel`: each rank holds half the experts.

Per row, the load of `dpserve bench serve` (dpserve.benchmark.serve): --warmup
requests, then --num-prompts completions of --prompt-len random token ids,
--output-len output tokens each (ignore_eos, greedy) at --concurrency. Printed:
output tokens/s, the resident memory (RSS) of each engine process after the
load, and the routed-expert parameter bytes each rank holds (GET
/debug/dp_state). Both rows' completions are compared token for token (EP must
not change them; a mismatch is reported and the exit status is 1).

    .venv/bin/python bench/moe.py [--num-prompts 32] [--out bench/results/DATE-TOPIC.md]
    .venv/bin/python bench/moe.py --hidden 128 --intermediate 256 --layers 2 \\
        --num-prompts 8 --output-len 8    # a quick check that it works

It prints a markdown section for a file in bench/results/; --out appends it there.
Timings need an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dp_scaling import ServeProcess, _bench, _free_port, _log, machine  # noqa: E402

from dpserve.benchmark.serve import BenchConfig, BenchResult  # noqa: E402

ROWS = (("dp2", ()), ("dp2-ep", ("--enable-expert-parallel",)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path,
                   default=Path(os.environ.get("TMPDIR", "/tmp")) / "dpserve-bench-moe",
                   help="Where the random checkpoints are kept (one per shape).")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2048, help="Per expert.")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--out", default=None, help="Append the markdown section to this file.")
    return p.parse_args(argv)


def build_model(root: Path, hidden: int, inter: int, layers: int) -> Path:
    """The random Mixtral checkpoint (built once per shape)."""
    from dpserve.testing.tiny_model import make_tiny_model

    path = root / f"mixtral-{hidden}-{inter}-{layers}"
    if (path / "config.json").is_file():
        return path
    _log(f"building a random Mixtral ({layers} layers, hidden {hidden}, 8 experts of "
         f"{inter}) in {path} ...")
    return make_tiny_model(path, "mixtral", hidden_size=hidden, intermediate_size=inter,
                           num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                           num_key_value_heads=max(1, hidden // 256), initializer_range=0.02)


def engine_rss(server: ServeProcess) -> dict[int, float]:
    """MiB resident per engine process of the server (by its process title)."""
    assert server.proc is not None
    out = {}
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            title = " ".join(p.cmdline()) or p.name()
            if "EngineCore_" in title:
                rank = title.split("EngineCore_", 1)[1].split()[0].split("_")[0]
                out[int(rank)] = p.memory_info().rss / 2**20
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError, IndexError):
            pass
    return out


def expert_bytes(url: str) -> dict[int, int]:
    """Routed-expert parameter bytes per rank, from GET /debug/dp_state."""
    state = httpx.get(url + "/debug/dp_state", timeout=30).json()
    return {int(rank): (e["experts"] or {}).get("expert_bytes", 0)
            for rank, e in state["engines"].items()}


def greedy_tokens(url: str, model: str, prompts: list[list[int]], n: int) -> list[str]:
    """Non-streamed greedy completions of a few prompts (compared across rows)."""
    out = []
    for p in prompts:
        body = {"model": model, "prompt": p, "max_tokens": n, "temperature": 0,
                "ignore_eos": True}
        out.append(httpx.post(url + "/v1/completions", json=body, timeout=300)
                   .json()["choices"][0]["text"])
    return out


def run_row(args: argparse.Namespace, model: Path, options: tuple[str, ...],
            config: BenchConfig, log: Path) -> dict[str, Any]:
    server = ServeProcess(str(model), _free_port(), (
        "--data-parallel-size", "2", "--threads-per-engine", "1", "--max-model-len", "1024",
        "--kv-cache-memory", "512MiB", *options), log)
    with server:
        _log(f"  ready in {server.start(args.start_timeout):.1f} s")
        result: BenchResult = asyncio.run(_bench(replace(config, base_url=server.url)))
        server.check_alive()
        rss = engine_rss(server)
        experts = expert_bytes(server.url)
        probe = [[100 + (7 * i + j) % 280 for j in range(args.prompt_len)] for i in range(4)]
        texts = greedy_tokens(server.url, str(model), probe, min(16, args.output_len))
    return dict(result=result, rss=rss, experts=experts, texts=texts,
                command=shlex.join(["dpserve", "serve", *server.argv[4:]]))


def markdown(args: argparse.Namespace, argv: list[str], rows: dict[str, dict[str, Any]],
             same: bool) -> str:
    lines = [
        f"## MoE at DP=2, with and without expert parallelism (bench/moe.py), "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}", "",
        f"Machine: {machine()}. `python bench/moe.py {shlex.join(argv)}`: random Mixtral, "
        f"{args.layers} layers, hidden {args.hidden}, 8 experts x {args.intermediate} "
        f"(top-2), float32; `dpserve serve --data-parallel-size 2 --threads-per-engine 1` "
        f"(+ `--enable-expert-parallel` for dp2-ep); {args.num_prompts} requests at "
        f"concurrency {args.concurrency}, {args.prompt_len} -> {args.output_len} tokens "
        f"(ignore_eos, greedy).", "",
        "| row | output tok/s | requests | RSS rank 0 / 1 (MiB) | expert MiB rank 0 / 1 |",
        "| --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        res: BenchResult = r["result"]
        rss = " / ".join(f"{r['rss'].get(k, float('nan')):.0f}" for k in (0, 1))
        exp = " / ".join(f"{r['experts'].get(k, 0) / 2**20:.0f}" for k in (0, 1))
        lines.append(f"| {name} | {res.output_throughput:.1f} | {res.completed} ok, "
                     f"{res.failed} failed | {rss} | {exp} |")
    lines += ["", f"Greedy completions of both rows equal: {'yes' if same else 'NO'}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    model = build_model(args.model_dir, args.hidden, args.intermediate, args.layers)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    config = BenchConfig(model=str(model), num_prompts=args.num_prompts,
                         concurrency=args.concurrency, prompt_len=args.prompt_len,
                         output_len=args.output_len, vocab_size=vocab, warmup=args.warmup)
    logs = Path(tempfile.mkdtemp(prefix="dpserve-moe-"))
    rows = {}
    for name, options in ROWS:
        _log(f"running {name} (logs in {logs}) ...")
        rows[name] = run_row(args, model, options, config, logs / f"{name}.log")
        res = rows[name]["result"]
        _log(f"  {res.output_throughput:.1f} output tok/s, {res.completed} ok, "
             f"{res.failed} failed; RSS {rows[name]['rss']}; experts {rows[name]['experts']}")
    same = rows["dp2"]["texts"] == rows["dp2-ep"]["texts"]
    md = markdown(args, argv, rows, same)
    print(md)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + md)
    ok = same and all(r["result"].failed == 0 and r["result"].not_sent == 0
                      for r in rows.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
