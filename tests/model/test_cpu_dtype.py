"""`--dtype auto` on CPU: bfloat16 where the CPU multiplies it natively, float32
elsewhere; a bfloat16 engine (pre-packed oneDNN linears) serving sensible greedy
text; and a bfloat16 model's projections packed in float32 for the large steps
where bfloat16 products are not AMX's. The CPU's flags are faked (a fake
/proc/cpuinfo reading) where the choice itself is checked, so the test means the
same on every machine."""

from __future__ import annotations

import pytest
import torch

from dpserve import LLM, SamplingParams, cpu_features
from dpserve.config import EngineArgs
from dpserve.model import cpu_kernels, layers

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


# Long enough that its prefill is a step past the kernel's rows (oneDNN's, packed).
LONG_PROMPT = ("Here is a list of the planets of the solar system in order from the sun: "
               "Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus and Neptune. The "
               "largest of them is")


def _greedy(dtype: str, monkeypatch, packing: str = "0") -> list[list[int]]:
    """Greedy tokens of PROMPTS and LONG_PROMPT; `packing`: DPSERVE_CPU_FLOAT32_GEMM."""
    monkeypatch.setenv(layers.FLOAT32_PACKING_ENV, packing)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(dtype=dtype) as llm:  # DP=1: the engine is in process
        in_float32 = llm.engine.runner.model.float32_packed_bytes()
        assert (in_float32 > 0) == (packing == "1" and dtype == "bfloat16"), in_float32
        outs = llm.generate([*PROMPTS, LONG_PROMPT], params, use_tqdm=False)
        assert len(outs[-1].prompt_token_ids) > cpu_kernels.kernel_rows(torch.bfloat16)
        return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow  # the default model, three times
def test_bfloat16_engine_tracks_float32_on_the_default_model(monkeypatch):
    """bfloat16 rounds every activation, so greedy paths may part after a while;
    the first tokens of plain factual prompts must still be float32's, with the
    projections packed in bfloat16 and in float32 (for the large steps)."""
    full = _greedy("float32", monkeypatch)
    for packing in ("0", "1"):
        half = _greedy("bfloat16", monkeypatch, packing)
        assert [t[0] for t in half] == [t[0] for t in full], (packing, half, full)
        agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                 for x, y in zip(full, half)]
        assert sum(agree) >= 2 * len(agree), (packing, agree)


@pytest.mark.parametrize("flags, env, dtype, expected", [
    (("avx512f", "avx512_bf16"), None, torch.bfloat16, True),  # no AMX
    (("avx2",), None, torch.bfloat16, True),  # bfloat16 not native at all
    (("avx512_bf16", "amx_tile", "amx_bf16"), None, torch.bfloat16, False),
    (("avx512_bf16", "amx_tile", "amx_bf16"), "1", torch.bfloat16, True),
    (("avx512_bf16",), "0", torch.bfloat16, False),
    (("avx512_bf16",), None, torch.float32, False),
])
def test_float32_packing_where_bfloat16_products_are_not_amx(monkeypatch, flags, env, dtype,
                                                              expected):
    monkeypatch.setattr(layers, "cpu_flags", lambda: frozenset(flags))
    if env is None:
        monkeypatch.delenv(layers.FLOAT32_PACKING_ENV, raising=False)
    else:
        monkeypatch.setenv(layers.FLOAT32_PACKING_ENV, env)
    assert layers.float32_packing_pays(dtype, "cpu") == expected


def test_a_bfloat16_linear_packed_in_float32_runs_in_float32():
    """A bfloat16 step against a projection packed in float32 computes in float32 (the
    same numbers: bfloat16 is exact in float32), bias included, and returns bfloat16."""
    torch.manual_seed(0)
    w = (torch.randn(96, 64) * 0.05).to(torch.bfloat16)
    b = torch.randn(96).to(torch.bfloat16)
    packed = layers.prepack(w.float())
    for rows in (1, 40, 100):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        got = layers.linear(x, packed, b, True)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
        in_float32 = layers.linear(x.float(), packed, b.float(), True).to(torch.bfloat16)
        assert torch.equal(got, in_float32)
        ref = x.double() @ w.double().T + b.double()
        assert float((got.double() - ref).abs().max() / ref.abs().max()) < 8e-3
