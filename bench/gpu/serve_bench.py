"""The served parts of bench/gpu/run.sh: `dpserve serve` under `dpserve bench serve` load.

* `serve --model M`: one server (bfloat16, one engine), README's W16 (64 requests,
  128 prompt -> 64 output tokens, 16 at a time) and a larger load (256 requests,
  512 -> 128, 64 at a time), each against its floor (transformers' own batched
  `generate`, from parts.py hf-floor) and its ceiling (the roofline: every decode
  step reads all weights and the KV of every running request once, at the card's
  measured copy bandwidth; every prompt token costs 2 FLOPs per parameter at the
  measured matrix-product rate). CUDA graphs for decode steps are not built in
  dpserve (decode steps run eagerly): the figures are without them.
* `dp2 --model M`: `--data-parallel-size 2` on one GPU, twice: as a user starts it
  (the model's max_model_len, the default gpu_memory_utilization; no load), then
  capped at 1,024 tokens per request under W16. For each, how the memory split
  between the two engines (each engine's KV blocks from the log; each engine
  process's GPU memory from nvidia-smi; RSS on CPU), or why it did not start.

Servers are started and stopped as bench/dp_scaling.py does (`ServeProcess`: own
session, /health polled with the process watched, SIGTERM then the whole tree
killed), logs under --logs. `--cpu`: the dry run's tiny sizes on the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dp_scaling import ServeProcess, _descendants, _free_port, _on_sigterm  # noqa: E402
from parts import CPU_WORKLOADS, WORKLOADS, _write  # noqa: E402

from dpserve.benchmark.serve import BenchConfig, BenchResult, run_benchmark  # noqa: E402

START_TIMEOUT_S = 240.0
DEFAULTS_START_TIMEOUT_S = 75.0  # dp2's first server: it may fail to start (docstring)


def _server_options(args: argparse.Namespace, *extra: str, capped: bool = True
                    ) -> tuple[str, ...]:
    """bfloat16 on the run's device; `capped`: 1,024 tokens per request (the loads
    need 640), so the KV cache is sized by max_num_seqs requests of that length."""
    device = "cpu" if args.cpu else "cuda"
    cap = ("--max-model-len", "1024") if capped else ()
    return ("--device", device, "--dtype", "bfloat16", *cap, *extra)


def _model_dims(model: str) -> dict[str, int]:
    """Parameters (from the safetensors headers), the bytes they take in bfloat16 (as
    served here), and KV bytes per token in bfloat16."""
    from safetensors import safe_open

    hf = json.loads((Path(model) / "config.json").read_text())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    kv = hf["num_hidden_layers"] * 2 * hf["num_key_value_heads"] * head_dim * 2
    params = 0
    for path in Path(model).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                params += math.prod(f.get_slice(name).get_shape())
    return {"params": params, "weight_bytes": 2 * params, "kv_bytes_per_token": kv,
            "vocab_size": hf["vocab_size"]}


def ceiling(dims: dict[str, int], bw: dict[str, float], load: tuple[int, int, int, int]
            ) -> dict[str, float]:
    """The roofline's best output tok/s for a closed-loop load (module docstring)."""
    num, plen, olen, conc = load
    gb_s, tflop_s = bw["copy_gb_s_read_plus_write"], bw["bf16_matmul_tflop_s"]
    per_step = dims["weight_bytes"] + conc * (plen + olen / 2) * dims["kv_bytes_per_token"]
    decode_s = (num / conc) * olen * per_step / (gb_s * 1e9)
    prefill_s = 2 * dims["params"] * num * plen / (tflop_s * 1e12)
    return {"decode_floor_s": decode_s, "prefill_floor_s": prefill_s,
            "output_tok_s": num * olen / (decode_s + prefill_s)}


def _figures(res: BenchResult) -> dict[str, Any]:
    lat = lambda x: None if x is None else {"p50": x.p50, "p99": x.p99}  # noqa: E731
    return {"completed": res.completed, "failed": res.failed, "not_sent": res.not_sent,
            "duration_s": res.duration_s, "output_tok_s": res.output_throughput,
            "request_s": res.request_throughput, "ttft_ms": lat(res.ttft_ms),
            "itl_ms": lat(res.itl_ms), "e2e_ms": lat(res.e2e_ms)}


def _load(url: str, vocab: int, load: tuple[int, int, int, int]) -> BenchConfig:
    num, plen, olen, conc = load
    return BenchConfig(base_url=url, num_prompts=num, prompt_len=plen, output_len=olen,
                       concurrency=conc, vocab_size=vocab, timeout=120.0, max_duration=150.0)


def _run_loads(server: ServeProcess, loads: dict[str, tuple], vocab: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, load in loads.items():
        res = asyncio.run(run_benchmark(_load(server.url, vocab, load)))
        server.check_alive()
        out[name] = _figures(res)
        print(f"{name}: {res.output_throughput:.0f} output tok/s, {res.completed} ok, "
              f"{res.failed} failed", flush=True)
    return out


def cmd_serve(args: argparse.Namespace) -> int:
    loads = CPU_WORKLOADS if args.cpu else WORKLOADS
    dims = _model_dims(args.model)
    bw = json.loads(Path(args.bandwidth).read_text()) if args.bandwidth else None
    floor = json.loads(Path(args.hf_floor).read_text()) if args.hf_floor else {}
    server = ServeProcess(args.model, _free_port(), _server_options(args),
                          Path(args.logs) / f"serve-{args.name}.log")
    figs: dict[str, Any] = {"model": args.model, **dims, "cuda_graphs": "not built (eager)"}
    with server:
        figs["ready_s"] = server.start(START_TIMEOUT_S)
        measured = _run_loads(server, loads, dims["vocab_size"])
    for name, load in loads.items():
        row = measured[name]
        row["load"] = dict(zip(("requests", "prompt_len", "output_len", "concurrency"), load))
        row["floor_transformers_tok_s"] = (floor.get(name) or {}).get("output_tok_s")
        if bw:
            row["ceiling"] = ceiling(dims, bw, load)
            row["share_of_ceiling"] = row["output_tok_s"] / row["ceiling"]["output_tok_s"]
        figs[name] = row
    figs["server_notes"] = server.notes
    _write(args.fig, figs)
    return 0 if all(measured[n]["failed"] == 0 for n in loads) else 1


def _engine_memory(server: ServeProcess, cpu: bool) -> dict[str, Any]:
    """Per engine process: GPU memory from nvidia-smi (MiB), or RSS (MiB) on the CPU."""
    procs = {p.pid: _title(p) for p in _descendants(server.proc.pid)
             if "EngineCore" in _title(p)}
    if cpu:
        return {"measured_by": "RSS", "per_engine_mib": {
            title: psutil.Process(pid).memory_info().rss / 2**20
            for pid, title in procs.items()}}
    smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         timeout=20).stdout
    used = {int(pid): float(mib) for pid, mib in
            (line.split(",") for line in smi.strip().splitlines() if "," in line)}
    return {"measured_by": "nvidia-smi", "per_engine_mib": {
        title: used.get(pid) for pid, title in procs.items()}, "all_processes_mib": used}


def _title(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()).strip() or p.name()
    except psutil.Error:
        return "?"


def _kv_split(log: Path) -> dict[str, list]:
    """Each engine's KV cache as its start-up log line gives it."""
    text = log.read_text(errors="replace")
    return {"kv_blocks_per_engine": [int(n) for n in re.findall(r"KV cache: (\d+) blocks",
                                                                  text)],
            "kv_mib_per_engine": [float(m) for m in re.findall(
                r"KV cache: \d+ blocks x \d+ tokens, ([\d.]+) MiB", text)]}


def _dp2_row(args: argparse.Namespace, name: str, options: tuple[str, ...],
             loads: dict[str, tuple], vocab: int, start_timeout: float) -> dict[str, Any]:
    """One DP=2 server: ready or why not, the loads, each engine's memory, its log."""
    log = Path(args.logs) / f"serve-dp2-{name}.log"
    server = ServeProcess(args.model, _free_port(), options, log)
    row: dict[str, Any] = {"options": " ".join(options)}
    with server:
        try:
            row["ready_s"] = server.start(start_timeout)
        except RuntimeError as e:
            row["error"] = str(e)[-2000:]
            return {**row, **_kv_split(log), "server_notes": server.notes}
        row.update(_run_loads(server, loads, vocab))
        row["memory"] = _engine_memory(server, args.cpu)
    return {**row, **_kv_split(log), "server_notes": server.notes}


def cmd_dp2(args: argparse.Namespace) -> int:
    """DP=2 on one device twice: as a user starts it (the model's max_model_len, the
    default gpu_memory_utilization: how the engines share the card, or why they
    cannot), then capped at 1,024 tokens per request under W16."""
    loads = CPU_WORKLOADS if args.cpu else WORKLOADS
    vocab = _model_dims(args.model)["vocab_size"]
    dp2 = ("--data-parallel-size", "2")
    figs = {"model": args.model,
            "defaults": _dp2_row(args, "defaults", ("--device", "cpu" if args.cpu else "cuda",
                                                    *dp2), {}, vocab,
                                DEFAULTS_START_TIMEOUT_S),
            "capped": _dp2_row(args, "capped", _server_options(args, *dp2),
                               {"W16": loads["W16"]}, vocab, START_TIMEOUT_S)}
    _write(args.fig, figs)
    capped = figs["capped"]
    return 0 if "error" not in capped and capped["W16"]["failed"] == 0 \
        and len(capped["kv_blocks_per_engine"]) == 2 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("serve", "dp2"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--fig", required=True, help="figures JSON to write")
        p.add_argument("--logs", required=True, help="directory for the server's log")
        p.add_argument("--cpu", action="store_true", help="the dry run: tiny sizes, CPU")
        if name == "serve":
            p.add_argument("--name", required=True, help="'default' or 'large'")
            p.add_argument("--bandwidth", help="parts.py bandwidth's figures")
            p.add_argument("--hf-floor", help="parts.py hf-floor's figures")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)  # run.sh's timeout: stop the server first
    return {"serve": cmd_serve, "dp2": cmd_dp2}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
