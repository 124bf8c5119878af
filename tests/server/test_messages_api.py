"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through `dpserve
serve` at DP=2, with the official `anthropic` client (and the `openai` one for the
same conversation on the chat endpoint: greedy outputs and token counts must agree).

One server for the module: a tiny random checkpoint (its ChatML template has no
tools, so tools, calls and results take the documented fallback rendering), an API
key (the anthropic client sends it as `x-api-key`), a small body limit for the 413.
The client's `create` no longer takes temperature: it goes in `extra_body`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from helpers import serve

pytestmark = pytest.mark.procs

KEY = "messages-test-key"
BODY_LIMIT = 100_000
GREEDY = {"temperature": 0}
HELLO = [{"role": "user", "content": "Hello"}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
        "required": ["city"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": CITY}
CLOCK = {"name": "get_time", "input_schema": {"type": "object", "properties": {},
                                              "additionalProperties": False}}


def _openai_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": tool["name"], "parameters": tool["input_schema"],
        **({"description": tool["description"]} if "description" in tool else {})}}


@pytest.fixture(scope="module")
def server(tiny_llama):
    with serve(str(tiny_llama), "--data-parallel-size", "2", "--api-key", KEY,
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--max-request-body-bytes", str(BODY_LIMIT), timeout=180) as (_, url):
        chat = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        messages = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)
        yield url, messages, chat, chat.models.list().data[0].id


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def _prompt_tokens(usage: Any) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens


def test_text_is_the_chat_endpoints(server) -> None:
    _, client, chat, model = server
    out = client.messages.create(model=model, max_tokens=8, system="Be brief.",
                                 messages=HELLO, metadata={"user_id": "u-1"},
                                 extra_body=GREEDY)
    ref = chat.chat.completions.create(
        model=model, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, *HELLO])
    assert out.id.startswith("msg_") and (out.type, out.role, out.model) == (
        "message", "assistant", model)
    assert [b.type for b in out.content] == ["text"]
    assert out.content[0].text == ref.choices[0].message.content
    assert out.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        ref.choices[0].finish_reason] and out.stop_sequence is None
    assert out.usage.output_tokens == ref.usage.completion_tokens
    assert _prompt_tokens(out.usage) == ref.usage.prompt_tokens


def test_stop_sequences(server) -> None:
    _, client, _, model = server
    full = _text(client.messages.create(model=model, max_tokens=16, messages=HELLO,
                                        extra_body=GREEDY))
    found = re.search("[A-Za-z0-9]{2}", full[1:])
    assert found, f"premise: no two letters or digits to stop at in {full!r}"
    stop = found.group()
    out = client.messages.create(model=model, max_tokens=16, messages=HELLO,
                                 stop_sequences=["never-seen-this", stop], extra_body=GREEDY)
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", stop)
    assert _text(out) == full[:full.index(stop)]


def test_tool_use_then_a_tool_result(server) -> None:
    _, client, chat, model = server
    question = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.messages.create(model=model, max_tokens=100, tools=[WEATHER, CLOCK],
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   messages=question, extra_body=GREEDY)
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
    call = first.content[0]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, CITY)
    # The next turn: the call and its result (as text blocks), no further calls.
    turn = [*question,
            {"role": "assistant", "content": [{"type": "tool_use", "id": call.id,
                                               "name": call.name, "input": call.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": [{"type": "text", "text": "21 C"}]}]}]
    second = client.messages.create(model=model, max_tokens=8, tools=[WEATHER, CLOCK],
                                    tool_choice={"type": "none"}, messages=turn,
                                    extra_body=GREEDY)
    assert [b.type for b in second.content] == ["text"]
    assert second.stop_reason in ("end_turn", "max_tokens")
    # The same turn on the chat endpoint: the same prompt, the same greedy text.
    ref = chat.chat.completions.create(
        model=model, max_tokens=8, temperature=0, tool_choice="none",
        tools=[_openai_tool(WEATHER), _openai_tool(CLOCK)],
        messages=[*question,
                  {"role": "assistant", "content": None, "tool_calls": [{
                      "id": call.id, "type": "function", "function": {
                          "name": call.name, "arguments": json.dumps(call.input)}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": "21 C"}])
    assert _text(second) == ref.choices[0].message.content
    assert _prompt_tokens(second.usage) == ref.usage.prompt_tokens
    assert _prompt_tokens(second.usage) > _prompt_tokens(first.usage) + 10


def test_stream_events_and_final_message(server) -> None:
    _, client, _, model = server
    whole = client.messages.create(model=model, max_tokens=8, messages=HELLO,
                                   extra_body=GREEDY)
    events = list(client.messages.create(model=model, max_tokens=8, messages=HELLO,
                                         stream=True, extra_body=GREEDY))
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"} and len(types) > 6
    start = events[0].message
    assert start.id.startswith("msg_") and start.content == [] and start.stop_reason is None
    assert start.usage.input_tokens == _prompt_tokens(whole.usage)
    assert "".join(e.delta.text for e in events[2:-3]) == _text(whole)
    assert events[-2].delta.stop_reason == whole.stop_reason
    with client.messages.stream(model=model, max_tokens=8, messages=HELLO,
                                extra_body=GREEDY) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(texts) > 1 and "".join(texts) == _text(whole) == _text(final)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert _prompt_tokens(final.usage) == _prompt_tokens(whole.usage)


def test_tool_use_streamed(server) -> None:
    _, client, _, model = server
    # A named tool: its input is streamed as it is generated.
    with client.messages.stream(model=model, max_tokens=100, tools=[WEATHER, CLOCK],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=HELLO, extra_body={"temperature": 1.0}) as stream:
        deltas = [e for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert len(deltas) > 1 and {d.delta.type for d in deltas} == {"input_json_delta"}
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    jsonschema.validate(final.content[0].input, CITY)
    assert json.loads("".join(d.delta.partial_json for d in deltas)) == final.content[0].input
    # "any", one call: the block comes whole at the end.
    events = list(client.messages.create(
        model=model, max_tokens=200, tools=[WEATHER, CLOCK], messages=HELLO, stream=True,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 1.0}))
    blocks = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in blocks] == ["tool_use"] and blocks[0].input == {}
    assert events[-2].delta.stop_reason == "tool_use"
    arguments = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    jsonschema.validate(json.loads(arguments),
                        {"get_weather": CITY, "get_time": CLOCK["input_schema"]}[blocks[0].name])
    # Left out, tool_choice is "auto" on this server (hermes): text without a call is
    # the reply, streamed whole once complete (the parser needs all of it).
    plain = client.messages.create(model=model, max_tokens=8, tools=[WEATHER], messages=HELLO,
                                   extra_body=GREEDY)
    with client.messages.stream(model=model, max_tokens=8, tools=[WEATHER], messages=HELLO,
                                extra_body=GREEDY) as stream:
        deltas = [e for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert [b.type for b in plain.content] == [b.type for b in final.content] == ["text"]
    assert len(deltas) == 1 and _text(final) == _text(plain)
    assert final.stop_reason == plain.stop_reason != "tool_use"


def test_count_tokens(server) -> None:
    _, client, chat, model = server
    system = [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]
    plain = client.messages.count_tokens(model=model, system=system, messages=HELLO)
    ref = chat.chat.completions.create(
        model=model, max_tokens=1, messages=[{"role": "system", "content": "Be\nbrief."},
                                             *HELLO])
    assert plain.input_tokens == ref.usage.prompt_tokens
    with_tools = client.messages.count_tokens(model=model, system=system, messages=HELLO,
                                              tools=[WEATHER, CLOCK])
    out = client.messages.create(model=model, max_tokens=1, system=system, messages=HELLO,
                                 tools=[WEATHER, CLOCK])
    assert with_tools.input_tokens == _prompt_tokens(out.usage) > plain.input_tokens + 20


def test_output_config_json_schema(server) -> None:
    _, client, _, model = server
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    out = client.messages.create(model=model, max_tokens=100, messages=HELLO,
                                 output_config={"format": {"type": "json_schema",
                                                           "schema": schema}},
                                 extra_body={"temperature": 1.0})
    assert out.stop_reason == "end_turn", out
    jsonschema.validate(json.loads(_text(out)), schema)


def _error(e: anthropic.APIStatusError, kind: str) -> str:
    """The message of an error body in Anthropic's shape, of type `kind`."""
    assert e.body["type"] == "error" and e.body["error"]["type"] == kind, e.body
    return e.body["error"]["message"]


def test_errors_in_anthropics_shape(server) -> None:
    url, client, _, model = server
    r = httpx.post(url + "/v1/messages", headers={"x-api-key": KEY},
                   json={"model": model, "messages": HELLO})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"] == {"type": "invalid_request_error",
                                 "message": "max_tokens: Field required"}
    for content, field in [
            ([{"type": "text", "text": "hi"}, {"type": "image", "source": {}}],
             "messages.0.content.1.type"),
            ([{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
             "messages.0.content.0.type"),
            ([{"type": "tool_result", "tool_use_id": 3}], "messages.0.content.0.tool_use_id")]:
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model=model, max_tokens=4,
                                   messages=[{"role": "user", "content": content}])
        assert _error(e.value, "invalid_request_error").startswith(field), e.value.body
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model, max_tokens=4, messages=HELLO,
                               stop_sequences=["a", "b", "c", "d", "e"])
    assert _error(e.value, "invalid_request_error").startswith("stop_sequences: ")
    for call in (lambda: client.messages.create(model="nope", max_tokens=4, messages=HELLO),
                 lambda: client.messages.count_tokens(model="nope", messages=HELLO)):
        with pytest.raises(anthropic.NotFoundError) as e:
            call()
        assert "nope" in _error(e.value, "not_found_error")
    with pytest.raises(anthropic.APIStatusError) as e:
        client.messages.create(model=model, max_tokens=4,
                               messages=[{"role": "user", "content": "x" * BODY_LIMIT}])
    assert e.value.status_code == 413
    assert "--max-request-body-bytes" in _error(e.value, "request_too_large")
    # The OpenAI routes keep their own shape.
    r = httpx.post(url + "/v1/chat/completions", headers={"x-api-key": KEY},
                   json={"model": "nope", "messages": HELLO})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_api_key_as_x_api_key_or_bearer(server) -> None:
    url, _, _, model = server
    wrong = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=model, max_tokens=2, messages=HELLO)
    assert "x-api-key" in _error(e.value, "authentication_error")
    r = httpx.post(url + "/v1/messages/count_tokens", json={"model": model, "messages": HELLO})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=model, messages=HELLO).input_tokens > 0
    # One auth layer: x-api-key opens the OpenAI routes too; a wrong one does not.
    assert httpx.get(url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    r = httpx.get(url + "/v1/models", headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
