"""A decode step's layers in one C call (`dpserve/model/one_call.py`,
`decode_layers.c`) against the per-layer Python path, on tiny random checkpoints:
the same logits step by step (float32 and bfloat16; one-token rows and
speculative, decode-shaped rows of several tokens), and the steps and models it
must leave to the per-layer path. transformers' own logits are checked in
test_model (test_decodes_after_prefill runs through this path)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_model import Driver, engine_config, make_requests

import dpserve.model.llama as llama
from dpserve.model import cpu_kernels
from dpserve.model.runner import ModelRunner
from dpserve.testing.tiny_model import make_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not cpu_kernels.available(), reason="dpserve's CPU kernels are not built here (no C "
    "compiler): the one-call path cannot run")]


def _driver(path, dtype: str) -> Driver:
    config = engine_config(path)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=dtype))
    runner = ModelRunner(config)
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return Driver(runner)


def _shape(dtype: str, spec: bool) -> list[int]:
    """Tokens per request in each decode step: up to three one-token rows (`spec`:
    the first a decode-shaped run of two, a speculative row), as many rows as
    dpserve's streaming kernel takes on this CPU (float32: 4 with AVX-512, bfloat16:
    31; 1 on an AVX2-only CPU, where a speculative row never runs in one call)."""
    rows = min(3, cpu_kernels.kernel_rows(getattr(torch, dtype)))
    return [2] + [1] * (rows - 1) if spec else [1] * rows


def _run(path, dtype: str, spec: bool) -> tuple[list[torch.Tensor], int]:
    """Logits of a prefill and five decode steps (`_shape`), and how many steps ran in
    one call."""
    driver = _driver(path, dtype)
    shape = _shape(dtype, spec)
    reqs = make_requests(driver.runner.vocab_size, [15 + 10 * n for n in shape])
    got = [driver.step([(r, r.num_tokens - 5 * n) for r, n in zip(reqs, shape)])[1]]
    for _ in range(5):
        got.append(driver.step(list(zip(reqs, shape)), decode_shaped=len(reqs))[1])
    return got, driver.runner.model.one_call_steps


@pytest.fixture(scope="module")
def tiny_llama_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("spec", [False, True], ids=["one-token rows", "speculative rows"])
def test_one_call_equals_the_per_layer_path(tiny_llama_path, monkeypatch, dtype, spec):
    one_call, steps = _run(tiny_llama_path, dtype, spec)
    fits = sum(_shape(dtype, spec)) <= cpu_kernels.kernel_rows(getattr(torch, dtype))
    assert steps == (5 if fits else 0)  # the premise: every decode step in one call
    monkeypatch.setattr(llama, "run_layers", lambda *args: False)
    per_layer, steps = _run(tiny_llama_path, dtype, spec)
    assert steps == 0
    # Only silu is computed differently (decode_layers.c's exp): float32 agrees to
    # rounding; a bfloat16 intermediate may round one way or the other.
    tol = {"float32": 1e-5, "bfloat16": 3e-2}[dtype]
    for a, b in zip(one_call, per_layer, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=0)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_models_and_steps_it_leaves_to_the_per_layer_path(tiny_llama_path, tmp_path):
    # Biases (Qwen2's QKV): the layers offer no tensors, every step runs per layer.
    _, steps = _run(make_tiny_model(tmp_path / "qwen2", "qwen2"), "float32", spec=False)
    assert steps == 0
    # More rows than the streaming kernel takes: oneDNN's linears, per layer.
    driver = _driver(tiny_llama_path, "float32")
    rows = cpu_kernels.kernel_rows(torch.float32) + 1
    reqs = make_requests(driver.runner.vocab_size, [9] * rows)
    driver.step([(r, 7) for r in reqs])
    driver.step([(r, 1) for r in reqs])
    assert driver.runner.model.one_call_steps == 0
    driver.step([(r, 1) for r in reqs[:rows - 1]])  # few enough now
    assert driver.runner.model.one_call_steps == 1
