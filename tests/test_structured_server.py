"""Structured output through `dpserve serve` at DP=2, with the official openai client.

The model is a tiny random checkpoint: unconstrained it writes garbage, so every
parse and schema check here is the grammar's doing. The KV cache is small
(32 blocks of 16 tokens per engine) so that the concurrent requests of the
property test are preempted and recomputed mid-grammar.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.helpers import metric_sum, serve

pytestmark = pytest.mark.procs

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}},
    "required": ["name", "n", "ok"], "additionalProperties": False}


class Pet(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog"]


@pytest.fixture(scope="module")
def server(tiny_llama):
    with serve(str(tiny_llama), "--data-parallel-size", "2", "--num-kv-blocks", "32",
               timeout=180) as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               timeout=120)
        yield url, client, client.models.list().data[0].id


def test_chat_parse_with_a_pydantic_model(server) -> None:
    _, client, model = server
    completion = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "A pet, please."}],
        response_format=Pet, temperature=1.0, max_tokens=100, n=3)
    assert len(completion.choices) == 3
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Pet), choice.message.content


def test_streamed_json_schema(server) -> None:
    _, client, model = server
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Go"}], stream=True, n=2,
        temperature=1.0, max_tokens=100, response_format={
            "type": "json_schema",
            "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}})
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert sorted(texts) == [0, 1] and set(finish.values()) == {"stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object(server) -> None:
    _, client, model = server
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "JSON"}], n=4, seed=3,
        temperature=1.0, max_tokens=150, response_format={"type": "json_object"})
    for c in out.choices:
        assert c.message.content.startswith("{"), c.message.content
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)


def test_completions_choice_regex_and_guided_fields(server) -> None:
    _, client, model = server
    choices = ["red", "green", "blue"]
    out = client.completions.create(model=model, prompt="Colour:", n=4, temperature=1.0,
                                    max_tokens=20, extra_body={"structured_outputs": {
                                        "choice": choices}})
    assert all(c.text in choices for c in out.choices), [c.text for c in out.choices]
    out = client.completions.create(model=model, prompt=["a", "b"], temperature=1.0,
                                    max_tokens=20,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{3}-[xy]"}})
    assert all(re.fullmatch("[0-9]{3}-[xy]", c.text) for c in out.choices)
    out = client.completions.create(model=model, prompt="x", temperature=1.0, max_tokens=100,
                                    extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)
    out = client.completions.create(model=model, prompt="x", max_tokens=20, stream=True,
                                    extra_body={"guided_choice": ["yes", "no"]})
    assert "".join(c.choices[0].text for c in out if c.choices) in ("yes", "no")


@pytest.mark.parametrize(("extra", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format", "invalid JSON schema at properties/a/type"),
    ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs",
     "invalid regular expression"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "invalid grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one of"),
])
def test_bad_constraints_get_400(server, extra: dict[str, Any], param: str,
                                 message: str) -> None:
    url, client, model = server
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=5, extra_body=extra)
    assert message in e.value.message and e.value.body["param"] == param, e.value.body
    # The server is fine afterwards.
    assert client.completions.create(model=model, prompt="x", max_tokens=2).choices


# ---- property test: generated schemas x sampled outputs --------------------------------


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["integer", "boolean", "null", "enum", "string", "pattern", "const",
                       "anyof"])
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if kind == "enum":
        return {"enum": rng.sample(["alpha", "beta", "gamma", "delta", "x y", 'q"t'],
                                   rng.randint(1, 4))}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "pattern":
        return {"type": "string", "pattern": "^[a-f]{1,4}[0-9]?$"}
    if kind == "const":
        return {"const": rng.choice(["on", 3, True])}
    if kind == "anyof":
        return {"anyOf": [{"type": "boolean"}, {"type": "integer", "minimum": 0,
                                                "maximum": 9}]}
    return {"type": kind}


def _schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    roll = rng.random()
    if depth >= 2 or roll < 0.3:
        return _leaf(rng)
    if roll < 0.5:
        return {"type": "array", "items": _schema(rng, depth + 1),
                "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    props = {f"k{i}": _schema(rng, depth + 1) for i in range(rng.randint(1, 4))}
    required = sorted(rng.sample(sorted(props), rng.randint(0, len(props))))
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def test_generated_schemas_validate_under_preemption(server) -> None:
    """30 generated schemas x 2 samples at temperature 1, all at once on 2 engines with
    small KV caches: requests are preempted mid-grammar, and every output validates."""
    url, _, model = server
    rng = random.Random(14)
    schemas = [_schema(rng, depth=1 if i % 3 else 0) for i in range(30)]
    preempted_before = metric_sum(url, "dpserve:num_preemptions_total")

    async def one(client: openai.AsyncOpenAI, i: int) -> list[tuple[str, str | None]]:
        out = await client.completions.create(
            model=model, prompt=f"Item {i}: " + "the quick brown fox jumps over the dog " * 4,
            n=2, temperature=1.0,
            max_tokens=300, extra_body={"structured_outputs": {"json": schemas[i]}})
        return [(c.text, c.finish_reason) for c in out.choices]

    async def run() -> list[list[tuple[str, str | None]]]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=300,
                                      max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(schemas))))

    results = asyncio.run(run())
    for schema, outs in zip(schemas, results, strict=True):
        for text, finish in outs:
            assert finish == "stop", (schema, text)
            jsonschema.validate(json.loads(text), schema)
    assert metric_sum(url, "dpserve:num_preemptions_total") > preempted_before
