"""Structured output through `dpserve serve` at DP=2, with the official openai client.

The model is a tiny random checkpoint: unconstrained it writes garbage, so every
parse and schema check here is the grammar's doing. The property test's
server has small KV caches (24 blocks of 16 tokens per engine), so its concurrent
requests are preempted and recomputed mid-grammar.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from helpers import metric_sum, serve_all, stopping
from pydantic import BaseModel, Field

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


# A tool-trained chat template (Hermes style, as Qwen2.5's): it shows the model the
# tools and writes calls in <tool_call> tags, so "auto" needs no flag.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}</tools>\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": ..."
    "}</tool_call>.<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}"
    "\n{{ m['content'] or '' }}{% for c in m.get('tool_calls') or [] %}<tool_call>"
    "{{ c['function'] | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# A template that renders tools in a format no parser knows: "auto" is refused.
UNKNOWN_TOOLS_TEMPLATE = (
    "{% if tools %}Functions: {{ tools | tojson }}\n{% endif %}{% for m in messages %}"
    "{{ m['role'] }}: {{ m['content'] or '' }}\n{% endfor %}assistant:")


@pytest.fixture(scope="module")
def servers(tiny_llama, tmp_path_factory):
    """The shared server (a tool-trained template, no tool flags) and the property
    test's (small KV caches; a template with tools in an unknown format), started at
    once (their start-ups overlap)."""
    model = str(tiny_llama)
    templates = tmp_path_factory.mktemp("templates")
    (templates / "hermes.jinja").write_text(HERMES_TEMPLATE)
    (templates / "unknown.jinja").write_text(UNKNOWN_TOOLS_TEMPLATE)
    with serve_all([model, "--data-parallel-size", "2", "--num-kv-blocks", "64",
                    "--chat-template", str(templates / "hermes.jinja")],
                   [model, "--data-parallel-size", "2", "--num-kv-blocks", "24",
                    "--chat-template", str(templates / "unknown.jinja")],
                   timeout=180) as started:
        yield dict(zip(("shared", "small_kv"), started))


@pytest.fixture(scope="module")
def server(servers):
    _, url = servers["shared"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return url, client, client.models.list().data[0].id


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
    # Those that ended their object are whole JSON objects; at least one did (the
    # premise: else this checks no object at all).
    stopped = [c.message.content for c in out.choices if c.finish_reason == "stop"]
    assert stopped, "premise did not hold: no choice closed its object within 150 tokens"
    for content in stopped:
        assert isinstance(json.loads(content), dict), content


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


@pytest.mark.slow
def test_generated_schemas_validate_under_preemption(servers) -> None:
    """30 generated schemas x 2 samples at temperature 1, all at once on 2 engines with
    KV caches of 24 blocks (384 tokens): requests are preempted mid-grammar, and every
    output validates."""
    with stopping(servers["small_kv"]) as (_, url):
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        _generated_schemas(url, model)
        _auto_needs_a_known_call_format(openai.OpenAI(base_url=url + "/v1", api_key="unused",
                                                   max_retries=0, timeout=60), model)


def _generated_schemas(url: str, model: str) -> None:
    rng = random.Random(14)
    schemas = [_schema(rng, depth=1 if i % 3 else 0) for i in range(30)]
    preempted_before = metric_sum(url, "dpserve:num_preemptions_total")

    async def one(client: openai.AsyncOpenAI, i: int) -> list[tuple[str, str | None]]:
        out = await client.completions.create(
            model=model, prompt=f"Item {i}: " + "the quick brown fox jumps over the dog " * 4,
            n=2, temperature=1.0,
            max_tokens=250, extra_body={"structured_outputs": {"json": schemas[i]}})
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


# ---- tool calling -------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "tz": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["tz"],
        "additionalProperties": False}}}
SMALL = {"type": "function", "function": {"name": "f"}}
TOOLS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


def _check_call(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[call.function.name])


def test_tool_choice_required_then_the_tool_result(server) -> None:
    _, client, model = server
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    out = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, CLOCK],
                                         tool_choice="required", temperature=1.0,
                                         max_tokens=300, n=3)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls and choice.message.content is None
        for call in choice.message.tool_calls:
            _check_call(call)
    first = out.choices[0].message
    messages += [first.model_dump(exclude_none=True),
                 *({"role": "tool", "tool_call_id": c.id, "content": '{"temp": 21}'}
                   for c in first.tool_calls)]
    again = client.chat.completions.create(model=model, messages=messages,
                                           tools=[WEATHER, CLOCK], tool_choice="none",
                                           max_tokens=5)
    assert again.choices[0].message.tool_calls is None
    assert isinstance(again.choices[0].message.content, str)
    # The calls and the result are in the prompt (the fallback rendering for this template).
    assert again.usage.prompt_tokens > out.usage.prompt_tokens + 10


def test_named_tool_streamed(server) -> None:
    _, client, model = server
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True,
        temperature=1.0, max_tokens=100)
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert all(c.index == 0 and c.id is None for c in calls[1:])
    arguments = "".join(c.function.arguments or "" for c in calls)
    jsonschema.validate(json.loads(arguments), TOOLS["get_weather"])
    assert deltas[-1].finish_reason == "tool_calls"


def test_required_streamed_one_call(server) -> None:
    _, client, model = server
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Time?"}], tools=[WEATHER, CLOCK],
        tool_choice="required", parallel_tool_calls=False, stream=True, temperature=1.0,
        max_tokens=300)
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    finish = None
    for chunk in stream:
        for d in chunk.choices:
            for call in d.delta.tool_calls or []:
                if call.function.name:
                    names[call.index] = call.function.name
                args[call.index] = args.get(call.index, "") + (call.function.arguments or "")
            finish = d.finish_reason or finish
    assert list(names) == [0] and finish == "tool_calls"
    jsonschema.validate(json.loads(args[0]), TOOLS[names[0]])


def _auto_needs_a_known_call_format(client: openai.OpenAI, model: str) -> None:
    """(On a server whose chat template renders tools in a format no parser knows,
    started without --tool-call-parser.)"""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                       tools=[SMALL], tool_choice="auto", max_tokens=5)
    assert "--tool-call-parser" in e.value.message
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], tools=[SMALL],
            tool_choice={"type": "function", "function": {"name": "nope"}}, max_tokens=5)
    # Without tool_choice and without a parser the tools are shown, nothing is parsed.
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                         tools=[SMALL], max_tokens=5)
    assert out.choices[0].message.tool_calls is None


HERMES_CALL = (r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,5}", '
               r'"unit": "[cf]"\}\}</tool_call>')


def test_auto_tool_choice_parses_hermes_calls(server) -> None:
    """On a server started with no tool flags, whose chat template writes Hermes calls:
    the model is made to write a Hermes call (a regex) or plain text; auto parses."""
    _, client, model = server
    messages = [{"role": "user", "content": "Weather?"}]
    out = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER, CLOCK], tool_choice="auto",
        max_tokens=200, extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "get_weather"
    _check_call(choice.message.tool_calls[0])
    out = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], max_tokens=10,
        extra_body={"structured_outputs": {"regex": "[a-z]{3}"}})  # auto: the default
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.tool_calls is None
    assert re.fullmatch("[a-z]{3}", out.choices[0].message.content)
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], stream=True, max_tokens=200,
        extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert calls[0].function.name == "get_weather" and deltas[-1].finish_reason == "tool_calls"
    jsonschema.validate(json.loads("".join(c.function.arguments or "" for c in calls)),
                        TOOLS["get_weather"])
