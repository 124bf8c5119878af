"""GFLOP/s of int8 linear kernels against the float32 oneDNN pre-packed path.

Scope: one process, SmolLM2-135M's linear shapes (merged QKV, O, merged gate/up,
down, LM head) at a few row counts. Each kernel computes y = x @ W.T for a float32
x and returns float32:

* fp32-onednn: the engine's default (`layers.prepack` + `layers.linear`).
* fbgemm-dyn: `quantized::linear_dynamic` (per-channel qint8 weights, activations
  quantised per tensor on the fly, inside the op).
* onednn-dyn: `onednn::qlinear_pointwise` with weights from `onednn::qlinear_prepack`;
  the activation is quantised to uint8 per tensor in Python first (counted).
* w8-only: `torch._weight_int8pack_mm` (int8 weights, float activations).
* dpserve-int8: `dpserve.model.quant` as the engine runs it (if importable).

The machine may be shared: every figure is the best of --repeat timings of
--iters calls each, so it is an upper bound of what an idle machine gives.

    .venv/bin/python bench/int8_kernels.py [--rows 1 16 256 2048] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from dpserve.model.layers import linear, prepack

SHAPES = {  # name -> (out, in) for SmolLM2-135M
    "qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
    "lm_head": (49152, 576),
}


def per_channel_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] float -> (int8 [out, in], scales [out] float32), symmetric."""
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.float()


def make_kernels(w: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    q, scale = per_channel_int8(w)
    kernels: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    packed = prepack(w)
    kernels["fp32-onednn"] = lambda x: linear(x, packed, None, True)

    qw = torch.quantize_per_channel(w, scale.double(), torch.zeros(w.shape[0], dtype=torch.long),
                                    0, torch.qint8)
    torch.backends.quantized.engine = "x86"
    fb = torch.ops.quantized.linear_prepack(qw, None)
    kernels["fbgemm-dyn"] = lambda x: torch.ops.quantized.linear_dynamic(x, fb, False)

    if hasattr(torch.ops.onednn, "qlinear_prepack"):
        dn = torch.ops.onednn.qlinear_prepack(q, None)
        zeros = torch.zeros(w.shape[0], dtype=torch.int64)

        def onednn_dyn(x: torch.Tensor) -> torch.Tensor:
            lo, hi = torch.aminmax(x)
            lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
            xs = max((hi - lo) / 255.0, 1e-8)
            zp = int(round(-lo / xs))
            qx = torch.clamp(torch.round(x / xs) + zp, 0, 255).to(torch.uint8)
            return torch.ops.onednn.qlinear_pointwise(qx, xs, zp, dn, scale, zeros, None, 1.0,
                                                      0, torch.float32, "none", [], "")
        kernels["onednn-dyn"] = onednn_dyn

    kernels["w8-only"] = lambda x: torch._weight_int8pack_mm(x, q, scale)
    try:
        from dpserve.model import quant
        qt = quant.quantize_weight(w)
        kernels["dpserve-int8"] = lambda x: quant.linear_int8(x, qt)
    except (ImportError, AttributeError):
        pass
    return kernels


def best_seconds(fn: Callable[[], object], iters: int, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256, 2048])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.05,
                    help="seconds of calls per timing (sets iters)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}; GFLOP/s, best of {args.repeat}")
    names: list[str] = []
    rows_out: list[tuple[str, int, dict[str, float]]] = []
    with torch.inference_mode():
        for shape in args.shapes:
            out_f, in_f = SHAPES[shape]
            w = torch.randn(out_f, in_f) * 0.02
            kernels = make_kernels(w)
            names = list(kernels)
            for rows in args.rows:
                x = torch.randn(rows, in_f)
                flops = 2.0 * rows * out_f * in_f
                res = {}
                for name, fn in kernels.items():
                    once = best_seconds(lambda fn=fn, x=x: fn(x), 1, 1)
                    iters = max(1, min(200, int(args.budget / max(once, 1e-6))))
                    res[name] = flops / best_seconds(lambda fn=fn, x=x: fn(x), iters,
                                                     args.repeat) / 1e9
                rows_out.append((shape, rows, res))
                print(f"{shape:8s} {rows:5d} " + "  ".join(f"{n} {v:7.1f}"
                                                         for n, v in res.items()), flush=True)
    print("\n| shape | rows | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    for shape, rows, res in rows_out:
        print(f"| {shape} | {rows} | " + " | ".join(f"{res[n]:.1f}" for n in names) + " |")


if __name__ == "__main__":
    main()
