"""One-row streaming linears as a decode step runs them: every weight of the default
model's shape (QKV, O, gate/up, down x 30 layers, and the LM head), random, through
`cpu_kernels.gemv` with one row, the best of N passes (ms and GB/s of weights read).

Run it under two source trees one after the other, alternately, to compare two
kernel builds on one machine (each tree builds its own library, keyed by its
sources):

    for i in 1 2; do for t in OLD NEW; do PYTHONPATH=$t .venv/bin/python \\
        bench/gemv_ab.py --dtype bfloat16 --passes 25; done; done
"""

from __future__ import annotations

import argparse
import time

import torch

from dpserve.model import cpu_kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--passes", type=int, default=25)
    args = p.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("bench/gemv_ab.py: dpserve's CPU kernels are not built here")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    weights = [(torch.randn(o, i) * 0.02).to(dtype) for o, i in SHAPES]
    xs = {i: torch.randn(1, i).to(dtype) for _, i in SHAPES}
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    best = float("inf")
    for _ in range(args.passes):
        start = time.perf_counter()
        for w in weights:
            cpu_kernels.gemv(xs[w.shape[1]], w)
        best = min(best, time.perf_counter() - start)
    print(f"{args.dtype}: {nbytes / 1e6:.0f} MB of weights, best {best * 1e3:.2f} ms, "
          f"{nbytes / best / 1e9:.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
