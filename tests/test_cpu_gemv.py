"""The streaming decode kernel (`dpserve/model/cpu_gemv.py`, `gemv.c`): built with
the host compiler, equal to a float64 reference in every dtype pairing, used by a
real model's decode rows, cached per source, and a clear fallback to oneDNN when
it cannot be built or is turned off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpserve import LLM, SamplingParams
from dpserve.model import cpu_gemv
from dpserve.model.layers import linear, prepack

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("w_dtype", DTYPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_gemv_matches_float64_reference(w_dtype, x_dtype, rows):
    torch.manual_seed(rows)
    # 200 inputs: three full 64-lane blocks and a tail; 77 outputs: uneven per thread
    w = (torch.randn(77, 200) * 0.05).to(w_dtype)
    x = torch.randn(rows, 200).to(x_dtype)
    got = cpu_gemv.gemv(x, w)
    ref = x.double() @ w.double().T
    assert got.dtype == x_dtype and got.shape == (rows, 77)
    err = float((got.double() - ref).abs().max() / ref.abs().max())
    bound = 1e-5 if x_dtype == torch.float32 else 8e-3  # bfloat16 output: 8 bits
    assert err < bound, err


def test_gemv_keeps_inf_and_nan_in_bfloat16():
    w = torch.ones(3, 64, dtype=torch.bfloat16)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    x[0, 0] = float("inf")
    assert torch.isinf(cpu_gemv.gemv(x, w)).all()
    x[0, 0] = float("nan")
    assert torch.isnan(cpu_gemv.gemv(x, w)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_takes_the_kernel_up_to_max_rows_and_onednn_after(dtype):
    torch.manual_seed(0)
    w, b = (torch.randn(96, 64) * 0.05).to(dtype), torch.randn(96).to(dtype)
    packed = prepack(w)
    for rows in (1, cpu_gemv.MAX_ROWS, cpu_gemv.MAX_ROWS + 1, 16):
        x = torch.randn(rows, 64).to(dtype)
        ref = (x.double() @ w.double().T + b.double())
        got = linear(x, packed, b, True, plain=w)
        err = float((got.double() - ref).abs().max() / ref.abs().max())
        assert got.shape == (rows, 96) and err < (1e-5 if dtype == torch.float32 else 8e-3)
    # The kernel's rows read `plain`: a different plain matrix shows in the result.
    x = torch.randn(1, 64).to(dtype)
    assert torch.equal(linear(x, packed, None, True, plain=torch.zeros_like(w)),
                       torch.zeros(1, 96, dtype=dtype))


def test_build_is_cached_by_source(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_gemv.CACHE_ENV, str(tmp_path))
    first = cpu_gemv.build()
    assert first.parent == tmp_path and first.exists()
    stamp = first.stat().st_mtime_ns
    assert cpu_gemv.build() == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left


def test_build_without_compiler_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_gemv.CACHE_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match="no-such-cc"):
        cpu_gemv.build(compiler=str(tmp_path / "no-such-cc"))
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: error: out of luck' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(RuntimeError, match="out of luck"):
        cpu_gemv.build(compiler=str(broken))
    assert not list(tmp_path.glob("*.so"))


def test_model_decode_uses_kernel_and_agrees_with_onednn(tiny_llama):
    """A real engine keeps the plain weights and its greedy tokens equal those of
    an engine with the kernel off (DPSERVE_CPU_GEMV=0, oneDNN for every step)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The quick brown fox", "Data parallel serving is"]
    with LLM(str(tiny_llama), dtype="float32") as llm:  # DP=1: the engine is in process
        assert llm.engine.runner.model.plain_bytes() > 0
        with_kernel = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                    use_tqdm=False)]
    script = (
        "import json, sys\n"
        "from dpserve import LLM, SamplingParams\n"
        "from dpserve.model import cpu_gemv\n"
        "assert not cpu_gemv.available()\n"
        "p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)\n"
        f"with LLM({str(tiny_llama)!r}, dtype='float32') as llm:\n"
        f"    outs = llm.generate({prompts!r}, p, use_tqdm=False)\n"
        "print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))\n")
    env = {**os.environ, cpu_gemv.GEMV_ENV: "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    without = json.loads(done.stdout.strip().splitlines()[-1])
    assert [list(t) for t in with_kernel] == without


def test_engine_serves_when_kernel_cannot_build(tiny_llama, tmp_path):
    """No usable compiler: one warning, and the engine generates with oneDNN."""
    script = (
        "from dpserve import LLM, SamplingParams\n"
        "from dpserve.model import cpu_gemv\n"
        "assert not cpu_gemv.available()\n"
        f"with LLM({str(tiny_llama)!r}, dtype='float32') as llm:\n"
        "    out = llm.generate(['hello'], SamplingParams(max_tokens=4, ignore_eos=True),\n"
        "                       use_tqdm=False)\n"
        "assert len(out[0].outputs[0].token_ids) == 4\n"
        "print('served')\n")
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"),
           cpu_gemv.CACHE_ENV: str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "served" in done.stdout
    assert "CPU decode kernel unavailable" in done.stderr and "no-such-cc" in done.stderr
    assert not Path(tmp_path / "cache").exists() or not list(Path(tmp_path / "cache").glob("*.so"))
