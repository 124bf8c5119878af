"""`--quantization int8`: the int8 kernel's accuracy, which weights the model quantises,
greedy agreement with float32 on tiny models, serving through the openai client, and
clear errors for what is not supported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch
from helpers import serve

from dpserve import LLM, SamplingParams
from dpserve.checkpoint.loader import iter_weights
from dpserve.config import ConfigError, EngineArgs
from dpserve.cpu_features import cpu_flags
from dpserve.model import cpu_kernels, quant
from dpserve.model.llama import LlamaForCausalLM

PROMPTS = [f"Prompt number {i}: the quick brown fox {i * 7}" for i in range(16)]
TOKENS = 16


@pytest.fixture(params=["machine", "fbgemm"])
def kernel(request, monkeypatch):
    """The int8 kernel this machine picks (vnni with AVX512-VNNI, else fbgemm), and
    fbgemm forced (as on a CPU without VNNI, or DPSERVE_CPU_KERNELS=0)."""
    if request.param == "fbgemm":
        monkeypatch.setenv("DPSERVE_CPU_KERNELS", "0")
        return "fbgemm"
    return "vnni" if _vnni_built() else "fbgemm"


def _vnni_built() -> bool:
    """Whether dpserve's kernels are built with AVX512-VNNI: the CPU has it and they
    are built for it (DPSERVE_KERNEL_MARCH unset or native)."""
    march = os.environ.get(cpu_kernels.MARCH_ENV) or "native"
    return "avx512_vnni" in cpu_flags() and march == "native"


# Shapes the VNNI kernel pads (out not a multiple of 16, in not a multiple of 4) and
# row counts around its 8-row tiles.
@pytest.mark.parametrize("out_in", [(96, 64), (37, 70), (960, 576)])
def test_int8_linear_close_to_float32(kernel, out_in):
    torch.manual_seed(0)
    n, k = out_in
    w, b = torch.randn(n, k) * 0.05, torch.randn(n)
    qw = quant.quantize_weight(w, b)
    assert qw.kernel == kernel
    for rows in (1, 3, 8, 9, 37):
        x = torch.randn(rows, k)
        ref = x @ w.T + b
        got = quant.linear_int8(x, qw)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        err = float((got - ref).norm() / ref.norm())
        # measured 0.003-0.008 (VNNI, per-row scales) / up to 0.012 (fbgemm, 7 bits)
        assert err < 0.02, (rows, err)
    assert quant.linear_int8(torch.zeros(2, k), qw).sub(b).abs().max() < 1e-5


@pytest.mark.skipif(not _vnni_built(), reason="per-row scales are the VNNI kernel's; this "
                    "CPU (or DPSERVE_KERNEL_MARCH) takes fbgemm (the `kernel` fixture's tests)")
def test_int8_vnni_scales_each_row_on_its_own():
    """A row 1,000 times larger than the next leaves the small row as exact as alone
    (per-row activation scales); per-tensor scales (fbgemm) would flatten it."""
    assert quant.quantize_weight(torch.ones(16, 16)).kernel == "vnni"
    torch.manual_seed(1)
    w = torch.randn(64, 128) * 0.05
    x = torch.randn(2, 128)
    x[0] *= 1000
    got = quant.linear_int8(x, quant.quantize_weight(w))
    ref = x @ w.T
    err = float((got[1] - ref[1]).norm() / ref[1].norm())
    assert err < 0.02, err


def test_quantize_weights_int8_where_chosen(tiny_qwen2, kernel):
    """qkv, o, gate_up in int8; down too where activations are quantised per row
    (vnni), float32 under fbgemm's one range per step (its outlier channels)."""
    cfg = EngineArgs(model=str(tiny_qwen2), quantization="int8").create_config().model
    model = LlamaForCausalLM(cfg.hf_config, torch.float32, "cpu")
    model.load_weights(iter_weights(Path(cfg.path)))
    per_layer = 4 if kernel == "vnni" else 3
    assert model.quantize_weights() == per_layer * len(model.layers)
    layer = model.layers[0]
    assert isinstance(layer.attn.qkv_weight, quant.Int8Weight)
    assert layer.attn.qkv_bias is None  # qwen2's q/k/v bias is inside the int8 weight
    assert isinstance(layer.attn.o_weight, quant.Int8Weight)
    assert isinstance(layer.mlp.gate_up_weight, quant.Int8Weight)
    down = layer.mlp.down_weight
    assert (isinstance(down, quant.Int8Weight) and down.kernel == "vnni") if kernel == "vnni" \
        else isinstance(down, torch.Tensor)
    assert isinstance(model.lm_head, torch.Tensor)


def test_smoothing_down_is_exact_in_float(tiny_llama):
    """`smooth_into_up` rescales up's rows and down's columns: the MLP computes the
    same in float32, while down's input channels come out flatter."""
    from dpserve.model.llama import smooth_into_up

    cfg = EngineArgs(model=str(tiny_llama)).create_config().model
    model = LlamaForCausalLM(cfg.hf_config, torch.float32, "cpu")
    model.load_weights(iter_weights(Path(cfg.path)))
    mlp = model.layers[0].mlp
    with torch.no_grad():
        inter = mlp.down_weight.shape[1]
        mlp.gate_up_weight[inter:inter + 4] *= 50  # outlier channels of down's input
        x = torch.randn(7, model.dims.hidden)
        ref = mlp(x)
        before = mlp.down_weight.abs().amax(dim=0).std()
        smooth_into_up(mlp)
        err = float((mlp(x) - ref).norm() / ref.norm())
        assert err < 1e-5, err  # float32 rounding only
        assert mlp.down_weight.abs().amax(dim=0).std() != before


def test_int8_lm_head_in_bfloat16_matches_float32_head(tiny_llama):
    """`head_dtype=bfloat16` (the engine's choice under int8 on CPUs with native
    bfloat16): the LM head is packed in bfloat16, takes the float32 hidden states
    and returns float32 logits close to the float32 head's."""
    cfg = EngineArgs(model=str(tiny_llama), quantization="int8").create_config().model
    models = []
    for head_dtype in (torch.float32, torch.bfloat16):
        model = LlamaForCausalLM(cfg.hf_config, torch.float32, "cpu")
        model.load_weights(iter_weights(Path(cfg.path)))
        model.quantize_weights(head_dtype=head_dtype)
        models.append(model)
    assert models[1].lm_head.dtype == torch.bfloat16
    if cpu_kernels.available():  # steps of a few rows: the kernel on a plain bfloat16 copy
        assert models[1].lm_head_plain.dtype == torch.bfloat16
    for rows in (5, 40):  # the kernel's rows, and oneDNN's
        hidden = torch.randn(rows, models[0].dims.hidden)
        ref, got = (m.compute_logits(hidden) for m in models)
        assert got.dtype == torch.float32 and got.shape == ref.shape
        err = float((got - ref).norm() / ref.norm())
        assert 0 < err < 0.02, err  # bfloat16 rounding: measured about 0.003


def _greedy(model: str, quantization: str | None) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    with LLM(model, quantization=quantization) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params,
                                                                     use_tqdm=False)]


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_int8_greedy_mostly_agrees_with_float32(arch, request):
    """Random tiny models have many near-tied logits, so greedy paths part early
    at times: measured (16 prompts x 16 tokens) 14-15 of 16 first tokens equal and
    7 tokens before the first difference on average; the bounds leave a margin."""
    model = str(request.getfixturevalue(arch))
    base, q = _greedy(model, None), _greedy(model, "int8")
    firsts = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), TOKENS)
              for x, y in zip(base, q, strict=True)]
    assert sum(f > 0 for f in firsts) >= 12, firsts
    assert sum(firsts) / len(firsts) >= 4, firsts


@pytest.mark.procs
def test_serve_int8_with_openai_client(tiny_llama):
    model = str(tiny_llama)
    with serve(model, "--quantization", "int8") as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        done = client.completions.create(model=model, prompt="Hello world", max_tokens=8,
                                         temperature=0)
        assert done.choices[0].finish_reason in ("length", "stop")
        assert 0 < done.usage.completion_tokens <= 8
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
            temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)


@pytest.mark.procs
def test_unknown_quantization_is_a_clear_error(tiny_llama):
    with pytest.raises(ConfigError, match="quantization must be int8"):
        EngineArgs(model=str(tiny_llama), quantization="int4").create_config()
    proc = subprocess.run([sys.executable, "-m", "dpserve.cli", "serve", str(tiny_llama),
                           "--quantization", "int4"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert "--quantization: invalid choice: 'int4'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_int8_rejected_where_unsupported(tiny_llama, tmp_path):
    from dpserve.testing.tiny_model import make_tiny_model

    with pytest.raises(ConfigError, match="quantization int8 needs dtype float32"):
        EngineArgs(model=str(tiny_llama), quantization="int8",
                   dtype="bfloat16").create_config()
    moe = make_tiny_model(tmp_path / "moe", "mixtral")
    with pytest.raises(ConfigError, match="not supported for MixtralForCausalLM"):
        EngineArgs(model=str(moe), quantization="int8").create_config()
