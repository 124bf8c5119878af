"""What this CPU can do for the default model: a roofline from measurements.

Measures, with the engine's thread count:
* GEMM GFLOP/s for each of the model's linear shapes (merged QKV, O, merged
  gate/up, down, LM head) at 1, 16, 256 and 2,048 rows, with MKL (`F.linear`)
  and oneDNN pre-packed weights (what the engine runs on CPU);
* memory bandwidth: a read-only sum and a copy over buffers far larger than the
  caches, best of several runs;
* one-row linears as a decode step runs them, each weight read from memory (30
  copies of each shape, cycled, as the 30 layers are): the GB/s of weights read
  by oneDNN pre-packed and by dpserve's streaming kernel (`cpu_kernels`, what the
  engine runs for one-row steps where it builds).

From them it derives two floors for the serve workloads:
* `kernel floor`: the time the measured linears alone need (best of the two
  libraries per shape and batch), no attention, sampler, scheduler or HTTP;
* `roofline`: per step, the larger of (FLOPs / the best GFLOP/s measured at that
  batch) and (weight bytes / read bandwidth).
and turns them into the best output tok/s for W16 (64 requests, 128 prompt
tokens, 64 output tokens, 16 at a time) and the best inter-token latency of one
stream (W1). Given measured figures (`--w16-tok-s`, `--w1-itl-ms`), it prints
each workload's share of its limit.

    .venv/bin/python bench/roofline.py [--dtype float32|bfloat16] [--threads 2] \
        [--w16-tok-s 153] [--w1-itl-ms 30]

(`--dtype bfloat16`: weights and activations in bfloat16, as `--dtype auto` runs on
a CPU with native bfloat16; weight bytes halve.)
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

# SmolLM2-135M (the default model): 30 layers, hidden 576, 9 query heads and 3
# KV heads of 64, intermediate 1536, vocabulary 49,152; QKV and gate/up merged
# as the engine holds them.
LAYERS = 30
SHAPES = {  # name -> (out, in)
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
BATCHES = (1, 16, 256, 2048)


def _time(fn, min_time: float = 0.3, min_reps: int = 5) -> float:
    """Best (least) seconds per call, after a warm-up, over at least `min_time` seconds:
    a floor, and the figure least disturbed by other work on the machine."""
    for _ in range(3):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def gemm_table(dtype: torch.dtype) -> dict[str, dict[int, dict[str, float]]]:
    """shape -> rows -> {"mkl_s", "onednn_s", "mkl_gflops", "onednn_gflops"}."""
    torch.manual_seed(0)
    table: dict[str, dict[int, dict[str, float]]] = {}
    for name, (out_f, in_f) in SHAPES.items():
        weight = (torch.randn(out_f, in_f) * 0.02).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        table[name] = {}
        for rows in BATCHES:
            x = torch.randn(rows, in_f).to(dtype)
            mkl = _time(lambda x=x, w=weight: F.linear(x, w))
            dnn = _time(lambda x=x, w=packed: torch.ops.mkldnn._linear_pointwise(
                x, w, None, "none", [], ""))
            flops = 2.0 * rows * out_f * in_f
            table[name][rows] = {"mkl_s": mkl, "onednn_s": dnn,
                                 "mkl_gflops": flops / mkl / 1e9,
                                 "onednn_gflops": flops / dnn / 1e9}
    return table


def streamed_one_row(dtype: torch.dtype) -> dict[str, dict[str, float]]:
    """layer shape -> {"onednn_gbs", "gemv_gbs"}: weight GB/s of one-row products with
    the weights coming from memory (LAYERS copies cycled), as in a decode step."""
    from dpserve.model import cpu_kernels

    torch.manual_seed(0)
    out: dict[str, dict[str, float]] = {}
    for name, (out_f, in_f) in SHAPES.items():
        copies = 2 if name == "lm_head" else LAYERS  # the head alone outgrows the caches
        weights = [(torch.randn(out_f, in_f) * 0.02).to(dtype) for _ in range(copies)]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
        x = torch.randn(1, in_f).to(dtype)
        nbytes = copies * out_f * in_f * dtype.itemsize
        dnn = _time(lambda x=x, ws=packed: [
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in ws])
        out[name] = {"onednn_gbs": nbytes / dnn / 1e9}
        if cpu_kernels.available():
            gemv = _time(lambda x=x, ws=weights: [cpu_kernels.gemv(x, w) for w in ws])
            out[name]["gemv_gbs"] = nbytes / gemv / 1e9
    return out


def bandwidth(mbytes: int = 512) -> dict[str, float]:
    """GB/s: a read-only sum and a copy (read + write counted) over `mbytes` MB."""
    n = mbytes * 2**20 // 4
    a = torch.ones(n)
    b = torch.empty(n)
    read = _time(lambda: a.sum(), min_time=1.0)
    copy = _time(lambda: b.copy_(a), min_time=1.0)
    return {"read_gbs": n * 4 / read / 1e9, "copy_gbs": 2 * n * 4 / copy / 1e9}


def _best_s(table, name: str, rows: int) -> float:
    entry = table[name][rows]
    return min(entry["mkl_s"], entry["onednn_s"])


def _interp_s(table, name: str, rows: int) -> float:
    """Seconds for `rows` rows: linear in rows between the measured batch sizes."""
    sizes = sorted(table[name])
    if rows in table[name]:
        return _best_s(table, name, rows)
    lo = max((s for s in sizes if s <= rows), default=sizes[0])
    hi = min((s for s in sizes if s >= rows), default=sizes[-1])
    if lo == hi:
        return _best_s(table, name, lo) * rows / lo
    t_lo, t_hi = _best_s(table, name, lo), _best_s(table, name, hi)
    return t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo)


def step_floors(table, bw: dict[str, float], rows: int, head_rows: int,
                elem_bytes: int) -> dict[str, float]:
    """Two floors for one forward of `rows` tokens sampling `head_rows` of them."""
    layer_names = ("qkv", "o", "gate_up", "down")
    kernel = LAYERS * sum(_interp_s(table, n, rows) for n in layer_names)
    kernel += _interp_s(table, "lm_head", head_rows)
    flops = 2.0 * rows * LAYERS * sum(o * i for n, (o, i) in SHAPES.items() if n != "lm_head")
    flops += 2.0 * head_rows * SHAPES["lm_head"][0] * SHAPES["lm_head"][1]
    # Peak compute: the best rate at the largest batch (compute-bound there; the small
    # batches' rates are inflated by weights that stay in cache between calls).
    peak = max(max(shape[BATCHES[-1]]["mkl_gflops"], shape[BATCHES[-1]]["onednn_gflops"])
               for shape in table.values()) * 1e9
    weight_bytes = float(elem_bytes) * sum(o * i * (1 if n == "lm_head" else LAYERS)
                             for n, (o, i) in SHAPES.items())
    roof = max(flops / peak, weight_bytes / (bw["read_gbs"] * 1e9))
    return {"kernel_s": kernel, "roofline_s": roof}


def workload_limits(table, bw, elem_bytes: int, prompt: int = 128, output: int = 64,
                    num: int = 64, concurrency: int = 16,
                    chunk: int = 2048) -> dict[str, float]:
    """Best output tok/s for W16 and best inter-token latency for one stream."""
    prefill_tokens = num * prompt
    full, rest = divmod(prefill_tokens, chunk)
    chunk_floors = step_floors(table, bw, chunk, chunk // prompt, elem_bytes)
    prefill = {k: full * v for k, v in chunk_floors.items()}
    if rest:
        for k, v in step_floors(table, bw, rest, max(1, rest // prompt), elem_bytes).items():
            prefill[k] += v
    decode_steps = num * (output - 1) / concurrency
    decode = step_floors(table, bw, concurrency, concurrency, elem_bytes)
    one = step_floors(table, bw, 1, 1, elem_bytes)
    out: dict[str, float] = {}
    for k in ("kernel_s", "roofline_s"):
        total = prefill[k] + decode_steps * decode[k]
        out[f"w16_tok_s_{k[:-2]}"] = num * output / total
        out[f"w1_itl_ms_{k[:-2]}"] = one[k] * 1e3
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--w16-tok-s", type=float, help="a measured W16 output tok/s")
    p.add_argument("--w1-itl-ms", type=float, help="a measured W1 inter-token p50 (ms)")
    p.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    table = gemm_table(dtype)
    bw = bandwidth()
    limits = workload_limits(table, bw, dtype.itemsize)
    streamed = streamed_one_row(dtype)
    if args.json:
        print(json.dumps({"gemm": table, "bandwidth": bw, "limits": limits,
                          "one_row_streamed": streamed}, indent=1))
    print(f"{args.dtype}, threads {args.threads}; bandwidth: read {bw['read_gbs']:.1f} GB/s, "
          f"copy {bw['copy_gbs']:.1f} GB/s\n")
    print("| shape (out x in) | rows | MKL GFLOP/s | oneDNN packed GFLOP/s |")
    print("|---|---:|---:|---:|")
    for name, (o, i) in SHAPES.items():
        for rows in BATCHES:
            e = table[name][rows]
            print(f"| {name} ({o}x{i}) | {rows} | {e['mkl_gflops']:.1f} | "
                  f"{e['onednn_gflops']:.1f} |")
    print("\nOne row, weights read from memory (GB/s of weights; the read bandwidth is the "
          "ceiling):\n")
    print("| shape | oneDNN packed | dpserve cpu_kernels |")
    print("|---|---:|---:|")
    for name, e in streamed.items():
        gemv = f"{e['gemv_gbs']:.1f}" if "gemv_gbs" in e else "not built"
        print(f"| {name} | {e['onednn_gbs']:.1f} | {gemv} |")
    print("\n| limit | kernel floor | roofline |")
    print("|---|---:|---:|")
    print(f"| W16 output tok/s | {limits['w16_tok_s_kernel']:.1f} | "
          f"{limits['w16_tok_s_roofline']:.1f} |")
    print(f"| W1 inter-token ms | {limits['w1_itl_ms_kernel']:.2f} | "
          f"{limits['w1_itl_ms_roofline']:.2f} |")
    if args.w16_tok_s:
        print(f"\nW16 measured {args.w16_tok_s:.1f} tok/s = "
              f"{100 * args.w16_tok_s / limits['w16_tok_s_kernel']:.0f}% of the kernel floor, "
              f"{100 * args.w16_tok_s / limits['w16_tok_s_roofline']:.0f}% of the roofline")
    if args.w1_itl_ms:
        print(f"W1 measured {args.w1_itl_ms:.1f} ms = "
              f"{100 * limits['w1_itl_ms_kernel'] / args.w1_itl_ms:.0f}% of the kernel floor, "
              f"{100 * limits['w1_itl_ms_roofline'] / args.w1_itl_ms:.0f}% of the roofline")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
