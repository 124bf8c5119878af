"""`--dtype auto` on CPU: bfloat16 where the CPU multiplies it natively, float32
elsewhere; and a bfloat16 engine (pre-packed oneDNN linears) serving sensible
greedy text. The CPU's flags are faked (a fake /proc/cpuinfo reading) where the
choice itself is checked, so the test means the same on every machine."""

from __future__ import annotations

import pytest

from dpserve import LLM, SamplingParams, cpu_features
from dpserve.config import EngineArgs

PROMPTS = ["The capital of France is", "Water boils at a temperature of",
           "The largest planet in the solar system is", "One, two, three, four,"]


@pytest.fixture
def fake_flags(monkeypatch):
    """Pretend the CPU has the given flags, with DPSERVE_CPU_BF16 unset."""
    monkeypatch.delenv(cpu_features.CPU_BF16_ENV, raising=False)

    def use(*flags: str) -> None:
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    return use


@pytest.mark.parametrize("flags, expected", [
    (("avx2", "avx512f", "avx512_bf16"), "bfloat16"),
    (("avx2", "amx_tile", "amx_bf16"), "bfloat16"),
    (("avx2", "avx512f", "avx512_vnni"), "float32"),
    ((), "float32"),
])
def test_auto_dtype_follows_native_bfloat16(fake_flags, tiny_llama, flags, expected):
    fake_flags(*flags)
    assert EngineArgs(model=str(tiny_llama), device="cpu").create_config().model.dtype \
        == expected


def test_auto_dtype_stays_float32_when_asked_or_quantized(fake_flags, tiny_llama,
                                                           monkeypatch):
    fake_flags("avx512_bf16")
    model = str(tiny_llama)
    assert EngineArgs(model=model, quantization="int8").create_config().model.dtype \
        == "float32"  # the int8 kernels take float32 activations
    assert EngineArgs(model=model, dtype="float32").create_config().model.dtype == "float32"
    monkeypatch.setenv(cpu_features.CPU_BF16_ENV, "0")
    assert EngineArgs(model=model).create_config().model.dtype == "float32"


def _greedy(dtype: str) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(dtype=dtype) as llm:
        return [list(o.outputs[0].token_ids)
                for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.slow  # the default model, twice
def test_bfloat16_engine_tracks_float32_on_the_default_model():
    """bfloat16 rounds every activation, so greedy paths may part after a while;
    the first tokens of plain factual prompts must still be float32's."""
    full, half = _greedy("float32"), _greedy("bfloat16")
    assert [t[0] for t in half] == [t[0] for t in full], (half, full)
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
             for x, y in zip(full, half)]
    assert sum(agree) >= 2 * len(agree), agree
