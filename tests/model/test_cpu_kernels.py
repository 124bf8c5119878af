"""dpserve's CPU kernels (`dpserve/model/cpu_kernels.py`, `gemv.c`,
`decode_attention.c`, `fused_ops.c`): built with the host compiler, equal to float64
references in every dtype pairing (and to torch's ops where those round the same),
used by a real engine, cached per source, and a clear fallback to torch's kernels
when they cannot be built or are turned off."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dpserve import LLM, SamplingParams
from dpserve.model import cpu_kernels
from dpserve.model.attention import build_attention_metadata, write_kv
from dpserve.model.layers import RMSNorm, apply_rotary, linear, prepack

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("w_dtype", DTYPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17, 32])
def test_gemv_matches_float64_reference(w_dtype, x_dtype, rows):
    torch.manual_seed(rows)
    # 200 inputs: three full 64-lane blocks and a tail; 77 outputs: uneven per thread,
    # and from two rows 4 x 4 tiles with a last row of w and a last group of x left
    w = (torch.randn(77, 200) * 0.05).to(w_dtype)
    x = torch.randn(rows, 200).to(x_dtype)
    got = cpu_kernels.gemv(x, w)
    ref = x.double() @ w.double().T
    assert got.dtype == x_dtype and got.shape == (rows, 77)
    err = float((got.double() - ref).abs().max() / ref.abs().max())
    bound = 1e-5 if x_dtype == torch.float32 else 8e-3  # bfloat16 output: 8 bits
    assert err < bound, err


def test_gemv_keeps_inf_and_nan_in_bfloat16():
    w = torch.ones(11, 64, dtype=torch.bfloat16)  # four rows at a time, and the rest
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    x[0, 0] = float("inf")
    assert torch.isinf(cpu_kernels.gemv(x, w)).all()
    x[0, 0] = float("nan")
    assert torch.isnan(cpu_kernels.gemv(x, w)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_takes_the_kernel_up_to_max_rows_and_onednn_after(dtype):
    torch.manual_seed(0)
    w, b = (torch.randn(96, 64) * 0.05).to(dtype), torch.randn(96).to(dtype)
    packed = prepack(w)
    limit = cpu_kernels.kernel_rows(dtype)
    assert 1 <= limit <= cpu_kernels.MAX_ROWS
    for rows in (1, limit, limit + 1, 40):
        x = torch.randn(rows, 64).to(dtype)
        ref = (x.double() @ w.double().T + b.double())
        got = linear(x, packed, b, True, plain=w)
        err = float((got.double() - ref).abs().max() / ref.abs().max())
        assert got.shape == (rows, 96) and err < (1e-5 if dtype == torch.float32 else 8e-3)
    # Up to the limit the kernel reads `plain` (a different plain matrix shows in the
    # result), past it oneDNN reads the packed one.
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, 64).to(dtype)
        got = linear(x, packed, None, True, plain=torch.zeros_like(w))
        assert torch.equal(got, torch.zeros(rows, 96, dtype=dtype)) == (rows <= limit)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 200), (300, 576)])
def test_add_rms_norm_matches_float64_and_torch(dtype, rows, hidden):
    """200: vectors and a scalar tail; 300 rows: threads share the rows."""
    torch.manual_seed(rows)
    norm = RMSNorm(hidden, 1e-5, dtype, "cpu")
    norm.weight.data = torch.randn(hidden).to(dtype)
    residual, delta = torch.randn(rows, hidden).to(dtype), torch.randn(rows, hidden).to(dtype)
    summed = (residual.double() + delta.double()).to(dtype)  # the sum rounds to the dtype
    x = summed.double()
    ref = x / (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * norm.weight.double()
    got_res = residual.clone()
    got = norm.add_forward(got_res, delta, fused=True)
    assert torch.equal(got_res, summed) and got.dtype == dtype
    err = float((got.double() - ref).abs().max() / ref.abs().max())
    assert err < (1e-6 if dtype == torch.float32 else 8e-3), err
    torch_res = residual.clone()
    by_torch = norm.add_forward(torch_res, delta, fused=False)
    if dtype == torch.bfloat16:  # each rounding as torch's: the same bits
        assert torch.equal(got, by_torch)
    plain = norm(summed, fused=True)  # no delta: the residual is left as it is
    assert torch.equal(plain, got)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 40)])
def test_rotary_kv_matches_float64_and_writes_the_cache(dtype, heads, kv_heads, head_dim):
    """head_dim 40: half a head is one vector and a tail. q, k rotated as apply_rotary
    does, k and v at their slots of the cache, other slots untouched; the rows of
    qkv strided (a slice of a wider matrix)."""
    torch.manual_seed(head_dim)
    tokens, half = 7, head_dim // 2
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width + 8).to(dtype)[:, :width]
    angles = torch.randint(0, 500, (tokens, 1)).double() * torch.rand(half).double()
    cos64, sin64 = angles.cos()[:, None, :], angles.sin()[:, None, :]
    cos, sin = cos64.to(dtype).contiguous(), sin64.to(dtype).contiguous()
    cache = torch.full((2, 5, 4, kv_heads, head_dim), 7.0, dtype=dtype)
    slots = torch.tensor([3, 0, 19, 8, 9, 12, 1])
    got = cpu_kernels.rotary_kv(qkv, heads, kv_heads, cos, sin, slots, cache)
    x = qkv[:, :(heads + kv_heads) * head_dim].double().view(tokens, -1, head_dim)
    c, s = cos.double(), sin.double()
    ref = torch.cat([x[..., :half] * c - x[..., half:] * s,
                     x[..., half:] * c + x[..., :half] * s], dim=-1)
    err = float((got.double() - ref).abs().max() / ref.abs().max())
    assert got.shape == (tokens, heads + kv_heads, head_dim)
    assert err < (1e-6 if dtype == torch.float32 else 8e-3), err
    expected = torch.full_like(cache, 7.0)
    write_kv(expected, got[:, heads:], qkv[:, (heads + kv_heads) * head_dim:].reshape(
        tokens, kv_heads, head_dim), slots)
    assert torch.equal(cache, expected)
    by_torch = apply_rotary(qkv[:, :(heads + kv_heads) * head_dim].reshape(tokens, -1, head_dim),
                            cos, sin)
    assert float((got.double() - by_torch.double()).abs().max()) <= (
        1e-6 if dtype == torch.float32 else 2 ** -5 * float(by_torch.abs().max()))


def test_rotary_kv_refuses_a_slot_outside_the_cache():
    qkv = torch.randn(2, 3 * 16)
    cos = sin = torch.ones(2, 1, 8)
    cache = torch.zeros(2, 2, 4, 1, 16)
    for bad in ([0, 8], [-1, 0]):
        with pytest.raises(ValueError, match="outside the cache"):
            cpu_kernels.rotary_kv(qkv, 1, 1, cos, sin, torch.tensor(bad), cache)
    assert not cache.any()  # nothing written


@pytest.mark.procs  # runs the C compiler
def test_build_is_cached_by_source(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    first = cpu_kernels.build()
    assert first.parent == tmp_path and first.exists()
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels.build() == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left


@pytest.mark.procs  # runs the C compiler
def test_build_without_compiler_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match="no-such-cc"):
        cpu_kernels.build(compiler=str(tmp_path / "no-such-cc"))
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: error: out of luck' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(RuntimeError, match="out of luck"):
        cpu_kernels.build(compiler=str(broken))
    assert not list(tmp_path.glob("*.so"))


@pytest.mark.procs  # a fresh Python process
def test_engine_uses_kernels_and_agrees_with_torch_kernels(tiny_llama):
    """A real engine keeps the plain weights, builds decode steps for the attention
    kernel, and its greedy tokens equal those of an engine with the kernels off
    (DPSERVE_CPU_KERNELS=0: oneDNN linears, gathered K/V and SDPA)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The quick brown fox", "Data parallel serving is"]
    with LLM(str(tiny_llama), dtype="float32") as llm:  # DP=1: the engine is in process
        assert llm.engine.runner.model.plain_bytes() > 0
        meta = build_attention_metadata(np.array([1]), np.array([4]), np.zeros((1, 1), np.int64),
                                        1, 16, torch.float32, torch.device("cpu"))
        assert meta.decode_kernel and meta.decode_chunks[0].mask is None and meta.fused_ops
        with_kernel = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                    use_tqdm=False)]
    script = (
        "import json, sys\n"
        "from dpserve import LLM, SamplingParams\n"
        "from dpserve.model import cpu_kernels\n"
        "assert not cpu_kernels.available()\n"
        "p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)\n"
        f"with LLM({str(tiny_llama)!r}, dtype='float32') as llm:\n"
        f"    outs = llm.generate({prompts!r}, p, use_tqdm=False)\n"
        "print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))\n")
    env = {**os.environ, cpu_kernels.KERNELS_ENV: "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    without = json.loads(done.stdout.strip().splitlines()[-1])
    assert [list(t) for t in with_kernel] == without


@pytest.mark.procs  # a fresh Python process
def test_engine_serves_when_kernel_cannot_build(tiny_llama, tmp_path):
    """No usable compiler: one warning, and the engine generates with torch's kernels."""
    script = (
        "from dpserve import LLM, SamplingParams\n"
        "from dpserve.model import cpu_kernels\n"
        "assert not cpu_kernels.available()\n"
        f"with LLM({str(tiny_llama)!r}, dtype='float32') as llm:\n"
        "    out = llm.generate(['hello'], SamplingParams(max_tokens=4, ignore_eos=True),\n"
        "                       use_tqdm=False)\n"
        "assert len(out[0].outputs[0].token_ids) == 4\n"
        "print('served')\n")
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"),
           cpu_kernels.CACHE_ENV: str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "served" in done.stdout
    assert "CPU kernels unavailable" in done.stderr and "no-such-cc" in done.stderr
    assert done.stderr.count("CPU kernels unavailable") == 1
    assert not Path(tmp_path / "cache").exists() or not list(Path(tmp_path / "cache").glob("*.so"))


def _reference_decode(q, cache, tables, lens):
    """float64 attention of each row's query over its first lens[r] cached tokens."""
    rows, heads, d = q.shape
    _, _, block_size, kv_heads, _ = cache.shape
    group, out = heads // kv_heads, torch.empty(rows, heads, d, dtype=torch.float64)
    for r in range(rows):
        pos = torch.arange(int(lens[r]))
        slots = tables[r][pos // block_size] * block_size + pos % block_size
        k = cache[0].reshape(-1, kv_heads, d)[slots].double()  # [L, kv_heads, d]
        v = cache[1].reshape(-1, kv_heads, d)[slots].double()
        for h in range(heads):
            scores = (k[:, h // group] @ q[r, h].double()) / d ** 0.5
            out[r, h] = torch.softmax(scores, 0) @ v[:, h // group]
    return out.reshape(rows, heads * d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_decode_attention_matches_float64_reference(dtype, heads, kv_heads):
    torch.manual_seed(heads)
    num_blocks, block_size, d = 40, 16, 64
    cache = torch.randn(2, num_blocks, block_size, kv_heads, d).to(dtype)
    lens = torch.tensor([1, 16, 17, 100, 200, 5], dtype=torch.int64)
    width = int(-(-lens.max() // block_size))
    tables = torch.stack([torch.randperm(num_blocks)[:width] for _ in lens])  # shuffled blocks
    # q as the model holds it: a slice of [rows, heads + kv_heads, d] (strided rows)
    q = torch.randn(len(lens), heads + kv_heads, d).to(dtype)[:, :heads]
    out = torch.empty(len(lens), heads * d, dtype=dtype)
    cpu_kernels.decode_attention(q, cache, tables.contiguous(), lens, out)
    ref = _reference_decode(q, cache, tables, lens)
    err = float((out.double() - ref).abs().max())
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


def test_decode_attention_refuses_a_table_too_short():
    cache = torch.zeros(2, 4, 16, 1, 64)
    q = torch.zeros(1, 1, 64)
    with pytest.raises(RuntimeError, match="past its table"):
        cpu_kernels.decode_attention(q, cache, torch.zeros(1, 1, dtype=torch.int64),
                                     torch.tensor([17]), torch.empty(1, 64))
    with pytest.raises(RuntimeError, match="past its table"):  # a block id outside the cache
        cpu_kernels.decode_attention(q, cache, torch.tensor([[7]]), torch.tensor([3]),
                                     torch.empty(1, 64))


def test_attention_shapes_past_the_kernel_fall_back_to_sdpa(monkeypatch):
    """head_dim 8 (not a multiple of 16): metadata built for the kernel still gives
    the gather + SDPA result (its mask built from seq_lens), not an error."""
    from dpserve.model.attention import paged_attention

    assert not cpu_kernels.supports_attention(4, 2, 8) and cpu_kernels.supports_attention(9, 3, 64)
    torch.manual_seed(0)
    cache = torch.randn(2, 8, 16, 2, 8)
    table = np.array([[3, 1, 0], [5, 6, 2]], dtype=np.int64)
    args = (np.array([1, 1]), np.array([20, 40]), table, 2, 16, torch.float32,
            torch.device("cpu"))
    with_kernel = build_attention_metadata(*args)
    assert with_kernel.decode_kernel and with_kernel.decode_chunks[0].mask is None
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    without = build_attention_metadata(*args)
    assert not without.decode_kernel and without.decode_chunks[0].mask is not None
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    got = paged_attention(q, k, v, cache.clone(), with_kernel)
    ref = paged_attention(q, k, v, cache.clone(), without)
    torch.testing.assert_close(got, ref)


@pytest.mark.procs
@pytest.mark.slow  # a nested pytest, its kernels compiled afresh
def test_kernels_built_without_avx512_pass_the_same_checks(tmp_path):
    """DPSERVE_KERNEL_MARCH=x86-64-v3 (AVX2; armv8-a on ARM): the library holds no
    512-bit instruction (16-float vectors become pairs of 256-bit ones, int8 falls
    back to fbgemm) and passes this file's kernel checks and test_quant's, an engine
    included, as on a CPU without AVX-512 (not the build, fallback and server tests,
    which do not depend on the instructions built)."""
    march = {"x86_64": "x86-64-v3", "aarch64": "armv8-a"}[platform.machine()]
    here = Path(__file__).parent  # tests/model: this file and test_quant.py
    env = {**os.environ, cpu_kernels.MARCH_ENV: march, cpu_kernels.CACHE_ENV: str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         "--basetemp", str(tmp_path / "pytest"), str(here / "test_cpu_kernels.py"),
         str(here / "test_quant.py"), "-k", "not without_avx512 and not build_ and not "
         "cannot_build and not serve_int8 and not unknown_quantization"],
        env=env, cwd=here.parents[1], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    libraries = list(tmp_path.glob("dpserve_kernels-*.so"))
    assert len(libraries) == 1, libraries
    if platform.machine() == "x86_64":
        objdump = shutil.which("objdump")
        assert objdump, "objdump (binutils) is needed: make setup installs it with gcc"
        text = subprocess.run([objdump, "-d", str(libraries[0])], capture_output=True,
                              text=True, timeout=60, check=True).stdout
        assert "vpdpbusd" not in text and "%zmm" not in text
        assert "%ymm" in text  # AVX2 code, not scalar
