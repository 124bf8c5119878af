"""LoRA adapters in the engine, offline (`LLM(..., enable_lora=True)`), with real PEFT
adapters built for tiny models (random, non-zero A and B) and PEFT's own float32
greedy tokens as the reference.

* Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k norms, the MoE module's dense path),
  targets q, k, v, o, gate, up, down: one batch mixing the base model and two
  adapters (rows of one adapter not adjacent) gives each one's PEFT tokens;
* LRU: max_loras=1 with two adapters, in one batch and alternating, each gets
  its tokens (the scheduler holds back what does not fit); pin_lora keeps one
  resident while others come and go;
* the prefix cache: the same prompt under two adapters gives different tokens,
  and hits only within one adapter;
* remove_lora with a request in flight: it finishes with its tokens, new ones
  are refused, the adapter goes with it;
* bad adapters and names: one clear line each (ValueError, or ConfigError at
  start); an add that fails leaves nothing loaded;
* the default model (GGUF-converted SmolLM2) and TP=2 (slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lora_checks import make_adapter, peft_greedy

from dpserve import LLM, LoRARequest, SamplingParams
from dpserve.config import ConfigError
from dpserve.protocol import EngineCoreRequest
from dpserve.testing.tiny_model import make_tiny_model

MAX_TOKENS = 8
PROMPT = [5, 17, 33, 80, 120, 7, 9]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(dtype="float32", enable_lora=True, num_kv_blocks=64, max_model_len=256)


def ids(prompt: list[int]) -> dict:
    return {"prompt_token_ids": prompt}


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, Path, Path]]:
    """arch -> (base model, adapter a (r=8), adapter b (r=4, rsLoRA))."""
    out = {}
    for arch in ("llama", "qwen2", "qwen3"):
        root = tmp_path_factory.mktemp(f"lora_{arch}")
        base = make_tiny_model(root / "base", arch)
        out[arch] = (base, make_adapter(base, root / "a", rank=8, seed=1),
                     make_adapter(base, root / "b", rank=4, seed=2, use_rslora=True))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_mixed_batch_equals_peft(models, arch):
    base, a, b = models[arch]
    refs = {None: peft_greedy(base, None, PROMPT, MAX_TOKENS),
            "a": peft_greedy(base, a, PROMPT, MAX_TOKENS),
            "b": peft_greedy(base, b, PROMPT, MAX_TOKENS)}
    assert refs["a"] != refs[None] and refs["b"] != refs[None], "the adapters change nothing"
    llm = LLM(str(base), max_loras=2, **ENGINE)
    la, lb = LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))
    order = ["a", None, "b", "a", None]  # a's rows are not adjacent in the step
    reqs = {"a": la, "b": lb, None: None}
    outs = llm.generate([ids(PROMPT)] * len(order), GREEDY, use_tqdm=False,
                        lora_request=[reqs[n] for n in order])
    assert tokens(outs) == [refs[n] for n in order]
    for name in ("a", "b"):  # each alone equals the mixed batch
        alone = llm.generate([ids(PROMPT)], GREEDY, use_tqdm=False, lora_request=reqs[name])
        assert tokens(alone) == [refs[name]]
    listing = {e["name"]: e for e in llm.engine.call_utility("list_loras")}
    assert set(listing) == {"a", "b"} and all(e["requests"] == 0 for e in listing.values())
    assert llm.engine.request_state_sizes()["lora_requests"] == 0
    llm.shutdown()


def test_one_slot_lru_and_pin(models):
    base, a, b = models["llama"]
    root = a.parent
    c = make_adapter(base, root / "c", rank=2, seed=3)
    refs = {p: peft_greedy(base, p, PROMPT, MAX_TOKENS) for p in (a, b, c)}
    llm = LLM(str(base), max_loras=1, **ENGINE)
    reqs = [LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))]
    # One batch with two adapters and one slot: one adapter's requests wait.
    outs = llm.generate([ids(PROMPT)] * 4, GREEDY, use_tqdm=False,
                        lora_request=[reqs[0], reqs[1], reqs[0], reqs[1]])
    assert tokens(outs) == [refs[a], refs[b], refs[a], refs[b]]
    for r in reqs * 2:  # alternating: every call evicts the other
        assert tokens(llm.generate([ids(PROMPT)], GREEDY, use_tqdm=False,
                                   lora_request=r)) == [refs[Path(r.lora_path)]]
    manager = llm.engine.lora.manager
    assert manager.evictions >= 5
    with pytest.raises(ValueError, match="pin"):  # one slot: none may be pinned
        llm.engine.call_utility("pin_lora", "a")
    llm.shutdown()
    # Two slots, one pinned: b and c take turns in the other; a stays resident.
    llm = LLM(str(base), max_loras=2, **ENGINE)
    llm.generate([ids(PROMPT)], GREEDY, use_tqdm=False, lora_request=reqs[0])
    llm.engine.call_utility("pin_lora", "a")
    rc = LoRARequest("c", 3, str(c))
    for r in (reqs[1], rc, reqs[1], rc):
        assert tokens(llm.generate([ids(PROMPT)], GREEDY, use_tqdm=False,
                                   lora_request=r)) == [refs[Path(r.lora_path)]]
        listing = {e["name"]: e for e in llm.engine.call_utility("list_loras")}
        assert listing["a"]["resident"] and listing["a"]["pinned"]
    assert llm.engine.lora.manager.loads == 5  # a once, then b and c twice each
    assert tokens(llm.generate([ids(PROMPT)], GREEDY, use_tqdm=False,
                               lora_request=reqs[0])) == [refs[a]]
    llm.shutdown()


def test_host_cache_evicts_and_reloads(models):
    base, a, b = models["llama"]
    llm = LLM(str(base), max_loras=1, max_cpu_loras=1, **ENGINE)
    reqs = [LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))]
    for r in reqs * 2:  # each turn reads the other adapter from its path again
        assert tokens(llm.generate([ids(PROMPT)], GREEDY, use_tqdm=False, lora_request=r)) \
            == [peft_greedy(base, Path(r.lora_path), PROMPT, MAX_TOKENS)]
        on_host = [e["name"] for e in llm.engine.call_utility("list_loras") if e["on_host"]]
        assert on_host == [r.lora_name]
        assert set(llm.engine.runner.lora.adapters) == {llm.engine.lora.manager.by_name[
            r.lora_name].lora_id}
    llm.shutdown()


def test_prefix_cache_is_per_adapter(models):
    base, a, b = models["llama"]
    prompt = list(range(40, 90))  # 3 full blocks of 16
    llm = LLM(str(base), max_loras=2, **ENGINE)
    ra, rb = LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))

    def run(r):
        before = llm.get_stats().prefix_cache_hits
        out = tokens(llm.generate([ids(prompt)], GREEDY, use_tqdm=False, lora_request=r))[0]
        return out, llm.get_stats().prefix_cache_hits - before

    first_a, hits = run(ra)
    assert hits == 0
    again_a, hits = run(ra)
    assert again_a == first_a and hits == 48  # within one adapter: a hit
    first_b, hits = run(rb)
    assert hits == 0 and first_b != first_a  # another adapter: no shared block
    base_out, hits = run(None)
    assert hits == 0 and base_out not in (first_a, first_b)
    assert first_b == peft_greedy(base, b, prompt, MAX_TOKENS)
    llm.shutdown()


def test_remove_lets_requests_in_flight_finish(models):
    base, a, _ = models["llama"]
    llm = LLM(str(base), max_loras=2, lora_modules=[f"a={a}"], **ENGINE)
    core = llm.engine
    core.add_request(EngineCoreRequest("r1", PROMPT, GREEDY, lora_name="a"))
    out: list[int] = []
    out += [t for o in core.step() for t in o.new_token_ids]  # prefill: running now
    assert core.call_utility("remove_lora", "a")
    with pytest.raises(ValueError, match="'a' is being removed"):
        core.add_request(EngineCoreRequest("r2", PROMPT, GREEDY, lora_name="a"))
    [entry] = core.call_utility("list_loras")
    assert entry["removing"] and entry["requests"] == 1
    while core.has_unfinished_requests():
        out += [t for o in core.step() for t in o.new_token_ids]
    assert out == peft_greedy(base, a, PROMPT, MAX_TOKENS)
    assert core.call_utility("list_loras") == [] and core.runner.lora.adapters == {}
    with pytest.raises(ValueError, match="not loaded"):
        core.add_request(EngineCoreRequest("r3", PROMPT, GREEDY, lora_name="a"))
    core.call_utility("add_lora", "a", str(a))  # the name is free again
    assert [e["name"] for e in core.call_utility("list_loras")] == ["a"]
    llm.shutdown()


def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


def test_bad_adapters_are_refused_in_one_line(models, tmp_path):
    base, a, _ = models["llama"]
    llm = LLM(str(base), max_loras=2, max_lora_rank=4, **ENGINE)
    core = llm.engine
    with pytest.raises(ValueError) as e:  # r=8 over max_lora_rank=4
        core.call_utility("add_lora", "a", str(a))
    assert "LoRA rank 8 exceeds max_lora_rank 4" in _one_line(e)
    with pytest.raises(ValueError) as e:
        core.call_utility("add_lora", "x", str(tmp_path))
    assert "is not a LoRA adapter directory" in _one_line(e)
    head = make_adapter(base, tmp_path / "head", rank=2, targets=("q_proj", "lm_head"))
    with pytest.raises(ValueError) as e:
        core.call_utility("add_lora", "head", str(head))
    assert "target module 'lm_head' is not in the model" in _one_line(e)
    other = make_tiny_model(tmp_path / "other", "llama", hidden_size=32)
    wrong = make_adapter(other, tmp_path / "wrong", rank=2)
    with pytest.raises(ValueError) as e:
        core.call_utility("add_lora", "wrong", str(wrong))
    assert "do not match the base model" in _one_line(e)
    broken = tmp_path / "broken"
    broken.mkdir()
    config = json.loads((a / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**config, "r": 2}))
    (broken / "adapter_model.safetensors").write_bytes(b"\x10\x00not safetensors")
    with pytest.raises(ValueError) as e:
        core.call_utility("add_lora", "broken", str(broken))
    assert "adapter_model.safetensors cannot be read" in _one_line(e)
    # Nothing of the failed adds stays, on the engine or its runner.
    assert core.call_utility("list_loras") == [] and core.runner.lora.adapters == {}
    with pytest.raises(ValueError) as e:
        core.add_request(EngineCoreRequest("r", PROMPT, GREEDY, lora_name="nope"))
    assert "LoRA adapter 'nope' is not loaded" in _one_line(e)
    assert core.request_state_sizes()["requests"] == 0
    with pytest.raises(ValueError, match="not loaded"):
        core.call_utility("remove_lora", "nope")
    llm.shutdown()


def test_moe_expert_targets_are_refused(tmp_path):
    base = make_tiny_model(tmp_path / "moe", "qwen2_moe", moe_intermediate_size=32,
                           shared_expert_intermediate_size=64)
    # peft >= 0.22 adapts fused MoE experts through target_parameters (both gate and up)
    adapter = make_adapter(base, tmp_path / "moe_a", rank=2,
                           targets=("q_proj", "gate_proj", "up_proj"))
    llm = LLM(str(base), max_loras=1, **ENGINE)
    with pytest.raises(ValueError) as e:
        llm.engine.call_utility("add_lora", "m", str(adapter))
    assert "mixture-of-experts layers is not supported" in _one_line(e)
    # Attention-only adapters serve on MoE models.
    attn = make_adapter(base, tmp_path / "moe_attn", rank=2, targets=("q_proj", "v_proj"))
    out = llm.generate([ids(PROMPT)], GREEDY, use_tqdm=False,
                       lora_request=LoRARequest("attn", 1, str(attn)))
    assert tokens(out) == [peft_greedy(base, attn, PROMPT, MAX_TOKENS)]
    llm.shutdown()


def test_lora_options_are_checked(models, tmp_path):
    base, a, _ = models["llama"]
    bad = [(dict(lora_modules=[f"a={a}"]), "lora_modules needs enable_lora"),
           (dict(enable_lora=True, max_loras=2, max_cpu_loras=1),
            "max_cpu_loras must be at least max_loras (2)"),
           (dict(enable_lora=True, max_loras=0), "max_loras must be at least 1"),
           (dict(enable_lora=True, lora_modules=["a"]), "lora_modules: 'a' is not name=path"),
           (dict(enable_lora=True, lora_modules=[f"a={tmp_path}"]),
            "is not a LoRA adapter directory"),
           (dict(enable_lora=True, max_lora_rank=4, lora_modules=[f"a={a}"]),
            "exceeds max_lora_rank 4"),
           (dict(enable_lora=True, lora_modules=[f"a={a}", f"a={a}"]), "given twice")]
    for options, message in bad:
        with pytest.raises(ConfigError) as e:
            LLM(str(base), dtype="float32", **options)
        assert message in _one_line(e)
    config = json.loads((a / "adapter_config.json").read_text())
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes((a / "adapter_model.safetensors")
                                                     .read_bytes())
    with pytest.raises(ConfigError, match="DoRA adapters are not supported"):
        LLM(str(base), dtype="float32", enable_lora=True, lora_modules=[f"d={dora}"])


def test_request_with_adapter_needs_enable_lora(models):
    base, a, _ = models["llama"]
    llm = LLM(str(base), dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        llm.generate([ids(PROMPT)], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("a", 1, str(a)))
    assert llm.engine.request_state_sizes()["requests"] == 0
    llm.shutdown()


@pytest.mark.slow
def test_default_model_equals_peft(tmp_path):
    from dpserve.checkpoint.loader import resolve_model

    base = Path(resolve_model(None))
    adapter = make_adapter(base, tmp_path / "smol", rank=8, scale=0.3,
                           targets=("q_proj", "v_proj", "o_proj", "down_proj"))
    llm = LLM(max_loras=1, **{**ENGINE, "max_model_len": 512})
    prompt = llm.get_tokenizer().encode("The capital of France is")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = peft_greedy(base, adapter, prompt, 12)
    out = llm.generate([ids(prompt)] * 2, params, use_tqdm=False,
                       lora_request=[LoRARequest("smol", 1, str(adapter)), None])
    assert tokens(out) == [ref, peft_greedy(base, None, prompt, 12)]
    assert ref != tokens(out)[1]
    llm.shutdown()


@pytest.mark.slow
@pytest.mark.procs
def test_tensor_parallel_equals_peft(models):
    base, a, b = models["qwen2"]
    llm = LLM(str(base), tensor_parallel_size=2, max_loras=2, **ENGINE)
    reqs = [LoRARequest("a", 1, str(a)), None, LoRARequest("b", 2, str(b))]
    out = llm.generate([ids(PROMPT)] * 3, GREEDY, use_tqdm=False, lora_request=reqs)
    assert tokens(out) == [peft_greedy(base, p, PROMPT, MAX_TOKENS) for p in (a, None, b)]
    with pytest.raises(ValueError, match="is not a LoRA adapter directory"):
        # refused on every worker; the rank lives on
        llm.engine.call_utility("add_lora", "x", str(base))
    assert tokens(llm.generate([ids(PROMPT)], GREEDY, use_tqdm=False,
                               lora_request=reqs[0])) == [tokens(out)[0]]
    llm.shutdown()


def test_cli_flags_and_sleep_wake(models):
    import argparse

    from dpserve.config import EngineArgs

    base, a, b = models["llama"]
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                            "--max-cpu-loras", "3", "--lora-modules", f"a={a}", f"b={b}"])
    args = EngineArgs.from_cli(ns)
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras,
            args.lora_modules) == (True, 2, 8, 3, [f"a={a}", f"b={b}"])
    # --lora-modules loaded at start; a CPU sleep at level 2 reloads the model (and
    # empties the slots): the adapters still give their tokens after waking.
    llm = LLM(str(base), max_loras=2, lora_modules=[f"a={a}", f"b={b}"], **ENGINE)
    assert [e["name"] for e in llm.engine.call_utility("list_loras")] == ["a", "b"]
    refs = [peft_greedy(base, p, PROMPT, MAX_TOKENS) for p in (a, b)]
    reqs = [LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))]
    assert tokens(llm.generate([ids(PROMPT)] * 2, GREEDY, use_tqdm=False,
                               lora_request=reqs)) == refs
    llm.engine.sleep(2)
    llm.engine.wake_up()
    assert not any(e["resident"] for e in llm.engine.call_utility("list_loras"))
    assert tokens(llm.generate([ids(PROMPT)] * 2, GREEDY, use_tqdm=False,
                               lora_request=reqs)) == refs
    llm.shutdown()


@pytest.mark.slow
@pytest.mark.procs
def test_engine_processes_load_and_serve_adapters(models):
    """DP=2: the adapter travels as the request's lora_name and add_lora as a utility
    call to each engine process; a bad one is refused with the engine's line."""
    base, a, b = models["llama"]
    with LLM(str(base), data_parallel_size=2, max_loras=2, **ENGINE) as llm:
        reqs = [LoRARequest("a", 1, str(a)), None, LoRARequest("b", 2, str(b))] * 2
        out = llm.generate([ids(PROMPT)] * 6, GREEDY, use_tqdm=False, lora_request=reqs,
                           data_parallel_rank=[0, 0, 0, 1, 1, 1])
        refs = [peft_greedy(base, p, PROMPT, MAX_TOKENS) for p in (a, None, b)]
        assert tokens(out) == refs * 2
        for rank in (0, 1):
            listing = llm.engine.call_utility("list_loras", rank=rank)
            assert [e["name"] for e in listing] == ["a", "b"]
        with pytest.raises(Exception, match="is not a LoRA adapter directory"):
            llm.generate([ids(PROMPT)], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("x", 3, str(base)))
