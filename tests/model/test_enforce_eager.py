"""Start-up kernel compilation and `--enforce-eager` (DPSERVE_ENFORCE_EAGER=1).

By default an engine compiles every bucketed linear kernel while it loads the
model (`LlamaForCausalLM.warm_up_linears`), so serving never waits for a compile
and memory reaches its plateau before the first request; `--enforce-eager`
skips that. The test suite sets the variable for its engines (tests/conftest.py);
these tests clear it.
"""

from __future__ import annotations

import logging

import pytest
import torch

from dpserve.config import EngineArgs
from dpserve.model import cpu_kernels
from dpserve.model.layers import bucket_rows
from dpserve.model.runner import ModelRunner


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("DPSERVE_ENFORCE_EAGER", raising=False)


def _runner_log(model: str, caplog, **kwargs) -> str:
    caplog.clear()
    config = EngineArgs(model=model, max_model_len=256, max_num_batched_tokens=64,
                        max_num_seqs=4, **kwargs).create_config()
    with caplog.at_level(logging.INFO, logger="dpserve.model.runner"):
        ModelRunner(config)
    return caplog.text


def test_the_flag_and_the_variable_reach_the_config(tiny_llama, no_env, monkeypatch):
    model = str(tiny_llama)
    assert not EngineArgs(model=model).create_config().model.enforce_eager
    assert EngineArgs(model=model, enforce_eager=True).create_config().model.enforce_eager
    monkeypatch.setenv("DPSERVE_ENFORCE_EAGER", "1")
    assert EngineArgs(model=model).create_config().model.enforce_eager


def test_kernels_compile_at_start_up_unless_eager(tiny_llama, no_env, caplog):
    model = str(tiny_llama)
    log = _runner_log(model, caplog)
    # Four distinct packed shapes in a Llama layer (QKV, O, gate/up, down) at every
    # bucket up to the step budget, and the LM head up to the sampled rows (4), past
    # the rows dpserve's kernel takes where it is built (those never reach oneDNN).
    floor = cpu_kernels.kernel_rows(torch.float32) if cpu_kernels.available() else 0
    buckets = len({bucket_rows(n) for n in range(floor + 1, 65)})
    head = len({bucket_rows(n) for n in range(floor + 1, 5)})
    assert f"kernels for {4 * buckets + head} (shape, rows) pairs compiled" in log, log
    assert "compiled" not in _runner_log(model, caplog, enforce_eager=True)
