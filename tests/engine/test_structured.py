"""Structured output: specs and their validation, the sampler's bitmask, and the
engine (in-process: preemption and migration keep the matcher right) on a tiny random
model, whose unconstrained output is garbage: whatever parses is the grammar's doing."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from dpserve.engine.core import EngineCore
from dpserve.entrypoints.llm import LLM
from dpserve.protocol import EngineCoreRequest
from dpserve.sampling_params import SamplingParams
from dpserve.structured import StructuredOutputs
from dpserve.structured.grammar import validate
from dpserve.structured.manager import apply_bitmask

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


def test_spec_needs_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputs(choice=[])
    assert StructuredOutputs(json={"type": "integer"}).json == '{"type": "integer"}'


@pytest.mark.parametrize(("spec", "message"), [
    (StructuredOutputs(json='{"type": "object", "properties": {"a": {"type": "strin"}}}'),
     "invalid JSON schema at properties/a/type"),
    (StructuredOutputs(json="{not json"), "not valid JSON"),
    (StructuredOutputs(regex="[a-"), "invalid regular expression: .*Unclosed"),
    (StructuredOutputs(grammar="root ::= undefined_rule"), "invalid grammar: .*not defined"),
])
def test_invalid_specs_name_the_problem(spec: StructuredOutputs, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate(spec)


def test_valid_specs_pass() -> None:
    for spec in (StructuredOutputs(json=json.dumps(SCHEMA)), StructuredOutputs(regex="[0-9]+"),
                 StructuredOutputs(choice=['a "quoted" one', "b"]),
                 StructuredOutputs(json_object=True),
                 StructuredOutputs(grammar='root ::= "x" | "y"')):
        validate(spec)


def test_apply_bitmask_only_touches_constrained_rows() -> None:
    logits = torch.zeros(3, 70)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)  # 96 bits for a vocabulary of 70
    bitmask[0, 0] = 1 << 5
    bitmask[0, 2] = 1 << 1  # token 65
    apply_bitmask(logits, bitmask, torch.tensor([1]))
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [5, 65]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama))


def _texts(outs) -> list[str]:
    return [c.text for o in outs for c in o.outputs]


def test_offline_every_kind_matches(llm: LLM) -> None:
    def run(spec: StructuredOutputs, n: int = 3) -> list:
        params = SamplingParams(n=n, temperature=1.0, max_tokens=200, structured_outputs=spec)
        return [c for o in llm.generate(["Hello", "The fox"], params, use_tqdm=False)
                for c in o.outputs]

    for c in run(StructuredOutputs(json=json.dumps(SCHEMA))):
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)
    for c in run(StructuredOutputs(regex="[a-c]{3}-[0-9]{2}")):
        assert re.fullmatch("[a-c]{3}-[0-9]{2}", c.text), c.text
    for c in run(StructuredOutputs(choice=["yes", "no", "maybe"])):
        assert c.text in ("yes", "no", "maybe")
    for c in run(StructuredOutputs(grammar='root ::= "x" ("y" | "z")+ "!"')):
        assert c.finish_reason == "length" or re.fullmatch("x[yz]+!", c.text), c.text
    # Without a constraint the same model writes no JSON: the grammar does the work.
    free = llm.generate(["Hello"], SamplingParams(n=4, temperature=1.0, max_tokens=30),
                        use_tqdm=False)
    assert not any(_parses(t) for t in _texts(free))


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


@pytest.mark.slow  # 8 x 150 tokens with preemptions (7-19 s here)
def test_preemption_keeps_the_matcher(tiny_llama) -> None:
    """A KV cache of 12 blocks (192 tokens) for 8 requests of ~100 tokens: requests are
    preempted and recomputed; every output still validates."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "minItems": 30, "maxItems": 30}
    llm = LLM(str(tiny_llama), num_kv_blocks=12)
    params = SamplingParams(temperature=1.0, max_tokens=150,
                            structured_outputs=StructuredOutputs(json=json.dumps(schema)))
    outs = llm.generate([f"prompt {i}" for i in range(8)], params, use_tqdm=False)
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    for c in (o.outputs[0] for o in outs):
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), schema)


def test_migrated_request_feeds_prior_tokens(llm: LLM) -> None:
    """A request that arrives with output tokens from another engine continues the
    grammar from there (prior tokens are fed to its matcher)."""
    spec = StructuredOutputs(json=json.dumps(SCHEMA))
    params = SamplingParams(temperature=1.0, max_tokens=200, seed=7, structured_outputs=spec)
    full = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
    core: EngineCore = llm.engine
    prompt = llm.tokenizer.encode("Hello")
    prior = list(full.token_ids[:5])
    core.add_request(EngineCoreRequest(
        request_id="migrated", prompt_token_ids=prompt, sampling_params=SamplingParams(
            temperature=0.0, max_tokens=200, structured_outputs=spec),
        eos_token_id=llm.eos_token_id, prior_output_token_ids=prior))
    tokens: list[int] = []
    for _ in range(500):
        outs = [o for o in core.step() if o.request_id == "migrated"]
        tokens += [t for o in outs for t in o.new_token_ids]
        if any(o.finish_reason is not None for o in outs):
            break
    text = llm.tokenizer.decode(prior + tokens, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_strings_are_valid_utf8_and_json(tiny_llama) -> None:
    """Random walks over every token the grammar allows (no model): xgrammar alone lets
    UTF-16 surrogates and, in length-bounded strings, control characters through; the
    narrowed character classes keep every decoded string valid and within maxLength."""
    import random

    import xgrammar as xgr
    from transformers import AutoTokenizer

    from dpserve.structured.grammar import compile_spec

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)))
    rng = random.Random(0)
    for schema in ({"type": "string", "maxLength": 2}, {"type": "string", "maxLength": 30}):
        compiled = compile_spec(compiler, StructuredOutputs(json=json.dumps(schema)))
        for _ in range(300):
            matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[tok.eos_token_id])
            mask = xgr.allocate_token_bitmask(1, len(tok))
            ids = []
            while not matcher.is_terminated():
                matcher.fill_next_token_bitmask(mask, 0)
                bits = ((mask[0].view(-1, 1) >> torch.arange(32)) & 1).flatten()[:len(tok)]
                ids.append(rng.choice(bits.nonzero().flatten().tolist()))
                assert matcher.accept_token(ids[-1])
            text = tok.decode(ids, skip_special_tokens=True)
            assert "\ufffd" not in text, (text, tok.convert_ids_to_tokens(ids))
            jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow  # 6 x 200 tokens, 16-token chunks (5-7 s here)
def test_chunked_prefill_and_prefix_cache(tiny_llama) -> None:
    """Prompts of ~100 tokens prefilled in chunks of 16 tokens, the same prompt twice
    (the second from the prefix cache): the grammar starts at the first sampled token."""
    llm = LLM(str(tiny_llama), max_num_batched_tokens=16, max_num_seqs=4)
    prompt = "Data parallel serving runs several replicas of one model. " * 2
    params = SamplingParams(n=2, temperature=1.0, max_tokens=200,
                            structured_outputs=StructuredOutputs(json=json.dumps(SCHEMA)))
    outs = llm.generate([prompt, prompt, "short"], params, use_tqdm=False)
    assert outs[1].num_cached_tokens > 0 or outs[0].num_cached_tokens > 0
    for c in (c for o in outs for c in o.outputs):
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)
