"""dpserve against vLLM's CPU build, side by side in one run on this machine.

Both servers serve the same Hugging Face directory (the default model, under
--peers-root beside vLLM's virtualenv; both are set up outside this repository) in
float32 on all cores; vLLM in its fastest setting here (--enforce-eager). The
same plain OpenAI client (the peers' bench_client.py: streaming completions,
random-word prompts, ignore_eos) drives both:

* W1: 16 requests one at a time, 128 prompt and 64 output tokens;
* W16: 64 requests, 16 at a time, 128 prompt and 64 output tokens;
* C64: 256 requests, 64 at a time, 128 prompt and 64 output tokens (the heavy load).

`--load-generator vllm` drives both with vLLM's own `vllm bench serve` instead
(random dataset, the same token counts, ignore_eos, its JSON result read back).

Servers alternate (dpserve, vLLM, dpserve, vLLM, ... for --repeats rounds), each
started fresh (start to ready timed), and the median of the rounds is reported
with the ratio dpserve / vLLM for every figure.

    .venv/bin/python bench/vs_vllm.py [--repeats 2] [--dpserve-options "..."] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dp_scaling import ServeProcess, _free_port, _log, _on_sigterm, machine  # noqa: E402

WORKLOADS = {"W1": (16, 1), "W16": (64, 16), "C64": (256, 64)}  # name -> (requests, concurrency)
FIGURES = [("output_tok_per_s", "output tok/s", True), ("ttft_ms_p50", "TTFT p50 ms", False),
           ("itl_ms_p50", "ITL p50 ms", False), ("tpot_ms_mean", "TPOT mean ms", False)]
PEERS_DIR = Path(__file__).resolve().parents[2] / "shared" / "peers"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers-root", default=os.environ.get("PEERS_ROOT",
                                                          str(Path.home() / "peers")))
    p.add_argument("--peers-dir", default=str(PEERS_DIR), help="Where bench_client.py is.")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workloads", default="W1,W16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dpserve-options", default="--dtype float32")
    p.add_argument("--vllm-options", default="--dtype float32 --enforce-eager")
    p.add_argument("--only", choices=["dpserve", "vllm"], default=None)
    p.add_argument("--load-generator", choices=["bench_client", "vllm"], default="bench_client",
                   help="peers/bench_client.py, or vLLM's own `vllm bench serve`")
    p.add_argument("--out", default=None, help="Append the markdown section to this file.")
    return p.parse_args(argv)


def server_argv(kind: str, args: argparse.Namespace, model: Path, port: int) -> list[str]:
    root = Path(args.peers_root)
    if kind == "vllm":
        return ["env", "VLLM_CPU_KVCACHE_SPACE=2", "VLLM_HOST_IP=127.0.0.1",
                # one rank: every core; several (--data-parallel-size): $VLLM_CPU_OMP_THREADS_BIND
                # as vLLM reads it, e.g. "0|1" for one core per rank
                "VLLM_CPU_OMP_THREADS_BIND="
                + os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}"),
                str(root / "vllm-venv" / "bin" / "vllm"), "serve", str(model),
                "--host", "127.0.0.1", "--port", str(port), *shlex.split(args.vllm_options)]
    return [sys.executable, "-m", "dpserve.cli", "serve", str(model), "--host", "127.0.0.1",
            "--port", str(port), *shlex.split(args.dpserve_options)]


def run_client(args: argparse.Namespace, url: str, model: Path, workload: str) -> dict:
    if args.load_generator == "vllm":
        return run_vllm_bench(args, url, model, workload)
    num, concurrency = WORKLOADS[workload]
    python = Path(args.peers_root) / "vllm-venv" / "bin" / "python"  # has aiohttp
    cmd = [str(python), str(Path(args.peers_dir) / "bench_client.py"), "--base-url", url,
           "--model", str(model), "-n", str(num), "-c", str(concurrency),
           "-p", str(args.prompt_len), "-m", str(args.output_len), "--warmup", "2",
           "--max-duration", "900"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1000)
    if done.returncode:
        raise RuntimeError(f"bench_client failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["errors"]:
        raise RuntimeError(f"{result['errors']} failed requests: {result['error_samples']}")
    return result


def run_vllm_bench(args: argparse.Namespace, url: str, model: Path, workload: str) -> dict:
    """`vllm bench serve` against `url`; its figures under bench_client.py's names."""
    num, concurrency = WORKLOADS[workload]
    with tempfile.TemporaryDirectory(prefix="dpserve-vllm-bench-") as tmp:
        cmd = [str(Path(args.peers_root) / "vllm-venv" / "bin" / "vllm"), "bench", "serve",
               "--backend", "openai", "--base-url", url, "--model", str(model),
               "--tokenizer", str(model), "--dataset-name", "random",
               "--random-input-len", str(args.prompt_len),
               "--random-output-len", str(args.output_len), "--ignore-eos",
               "--num-prompts", str(num), "--max-concurrency", str(concurrency),
               "--num-warmups", "2", "--disable-tqdm", "--save-result",
               "--result-dir", tmp, "--result-filename", "result.json"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1000)
        if done.returncode:
            raise RuntimeError(f"vllm bench serve failed: {done.stderr[-2000:]}")
        raw = json.loads((Path(tmp) / "result.json").read_text())
    failed = raw.get("num_prompts", num) - raw.get("completed", 0)
    if failed:
        raise RuntimeError(f"vllm bench serve: {failed} of {num} requests failed")
    return {"output_tok_per_s": raw["output_throughput"], "ttft_ms_p50": raw["median_ttft_ms"],
            "itl_ms_p50": raw["median_itl_ms"], "tpot_ms_mean": raw["mean_tpot_ms"],
            "errors": 0}


def one_round(args: argparse.Namespace, kind: str, model: Path, tmp: Path) -> dict:
    port = _free_port()
    server = ServeProcess(None, port, (), tmp / f"{kind}.log")
    server.argv = server_argv(kind, args, model, port)
    out: dict = {}
    with server:
        out["ready_s"] = server.start(900)
        _log(f"  {kind} ready in {out['ready_s']:.1f} s")
        for workload in args.workloads.split(","):
            out[workload] = run_client(args, server.url, model, workload)
            server.check_alive()
            _log(f"  {kind} {workload}: {out[workload]['output_tok_per_s']} tok/s, "
                 f"TTFT p50 {out[workload]['ttft_ms_p50']} ms, "
                 f"ITL p50 {out[workload]['itl_ms_p50']} ms")
    return out


def markdown(args: argparse.Namespace, rounds: dict[str, list[dict]], argv: list[str]) -> str:
    kinds = [k for k in ("dpserve", "vllm") if rounds.get(k)]
    med = {k: {} for k in kinds}
    for k in kinds:
        med[k]["ready_s"] = statistics.median(r["ready_s"] for r in rounds[k])
        for w in args.workloads.split(","):
            for key, _, _ in FIGURES:
                values = [r[w][key] for r in rounds[k] if r[w].get(key) is not None]
                med[k][(w, key)] = statistics.median(values) if values else None
    lines = [f"\n## dpserve vs vLLM CPU, side by side (bench/vs_vllm.py), "
             f"{datetime.datetime.now().isoformat(sep=' ', timespec='minutes')}\n",
             f"- machine: {machine()}",
             f"- command: `python bench/vs_vllm.py {shlex.join(argv)}`",
             f"- both serve {args.peers_root}/models/smollm2-135m-instruct; dpserve "
             f"`{args.dpserve_options}`, vLLM 0.32 CPU `{args.vllm_options}`; client: "
             f"{'vllm bench serve' if args.load_generator == 'vllm' else 'peers/bench_client.py'}, "
             f"{args.prompt_len} prompt / {args.output_len} output "
             f"tokens, ignore_eos; median of {args.repeats} alternating rounds\n",
             "| workload | figure | dpserve | vLLM | dpserve / vLLM |", "|---|---|---:|---:|---:|"]

    def cell(v):
        return "n/a" if v is None else f"{v:.1f}"

    for w in args.workloads.split(","):
        for key, label, _ in FIGURES:
            d = med.get("dpserve", {}).get((w, key))
            v = med.get("vllm", {}).get((w, key))
            ratio = f"{d / v:.2f}x" if d and v else "n/a"
            lines.append(f"| {w} | {label} | {cell(d)} | {cell(v)} | {ratio} |")
    d, v = med.get("dpserve", {}).get("ready_s"), med.get("vllm", {}).get("ready_s")
    lines.append(f"| start | start to ready, s | {cell(d)} | {cell(v)} | "
                 f"{f'{d / v:.2f}x' if d and v else 'n/a'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)  # a timeout still stops the server
    model = Path(args.peers_root) / "models" / "smollm2-135m-instruct"
    if not (model / "config.json").is_file():
        sys.exit(f"bench/vs_vllm.py: no model at {model}: run "
                 f"../shared/peers/setup_vllm_cpu.sh first")
    tmp = Path(tempfile.mkdtemp(prefix="dpserve-vs-vllm-"))
    kinds = [args.only] if args.only else ["dpserve", "vllm"]
    rounds: dict[str, list[dict]] = {k: [] for k in kinds}
    for i in range(args.repeats):
        for kind in kinds:
            _log(f"round {i + 1}/{args.repeats}: {kind}")
            rounds[kind].append(one_round(args, kind, model, tmp))
    (tmp / "rounds.json").write_text(json.dumps(rounds, indent=1))
    text = markdown(args, rounds, argv)
    print(text)
    _log(f"raw results: {tmp / 'rounds.json'}")
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
