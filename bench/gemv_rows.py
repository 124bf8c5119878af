"""Which kernel a step of R rows should run: every projection of the default model's
layers (QKV, O, gate/up, down x 30, random weights of its shapes) through dpserve's
kernel (`cpu_kernels.gemv` on the plain matrices), oneDNN's packed linear in the
same dtype, and, for bfloat16, oneDNN's packed linear in float32 (the activations
converted there and back, as `layers.linear` does for a model packed in float32).
The best of N passes per row count, in ms (and GFLOP/s), torch's threads as set.

    .venv/bin/python bench/gemv_rows.py --dtype bfloat16 --rows 1,2,4,8,16,24,32,64

`cpu_kernels.kernel_rows` and `layers.float32_packing_pays` are set from its
figures (BENCHMARKS.md, the CPU kernels).
"""

from __future__ import annotations

import argparse
import time

import torch

from dpserve.model import cpu_kernels
from dpserve.model.layers import linear, prepack

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30


def best_ms(run, passes: int) -> float:
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--rows", default="1,2,4,8,16,24,32,64")
    p.add_argument("--passes", type=int, default=5)
    args = p.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("bench/gemv_rows.py: dpserve's CPU kernels are not built here")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    plain = [(torch.randn(o, i) * 0.02).to(dtype) for o, i in SHAPES]
    ways = {"kernel": (plain, False), f"oneDNN {args.dtype}": ([prepack(w) for w in plain], True)}
    if dtype == torch.bfloat16:
        ways["oneDNN float32"] = ([prepack(w.float()) for w in plain], True)
    print(f"{args.dtype}, {torch.get_num_threads()} threads, {len(SHAPES)} projections; "
          f"kernel_rows here: {cpu_kernels.kernel_rows(dtype)}")
    print("| rows | " + " | ".join(f"{w} ms (GFLOP/s)" for w in ways) + " |")
    print("|---:|" + "---:|" * len(ways))
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {i: torch.randn(rows, i).to(dtype) for _, i in SHAPES}
        flop = sum(2 * rows * o * i for o, i in SHAPES)
        cells = []
        for name, (weights, packed) in ways.items():
            if name == "kernel" and rows > cpu_kernels.MAX_ROWS:
                cells.append("")
                continue
            if packed:
                def run(weights=weights, xs=xs):
                    for w, (_, i) in zip(weights, SHAPES, strict=True):
                        linear(xs[i], w, None, True)
            else:
                def run(weights=weights, xs=xs):
                    for w, (_, i) in zip(weights, SHAPES, strict=True):
                        cpu_kernels.gemv(xs[i], w)
            ms = best_ms(run, args.passes)
            cells.append(f"{ms:.1f} ({flop / ms / 1e6:.0f})")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
