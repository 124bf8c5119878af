"""The Responses API with the official `openai` client, against one real server:
`dpserve serve --data-parallel-size 2 --api-server-count 2` (tiny random model).

What a client sees is checked against the chat endpoint for the same conversation
(greedy, so equal text): create, the chain of `previous_response_id` (resolved by
whichever API server a follow-up lands on: both are made to serve one), function
tools and a function_call_output turn, text.format json_schema, the stream's events,
max_output_tokens -> incomplete, retrieve / delete / input_items / cancel and their
errors; then that the stored responses outlive SIGKILLed API servers (both killed
and restarted in turn: no process that stored them is left).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import stat
import time

import httpx
import jsonschema
import openai
import psutil
import pytest
from helpers import descendants, held_by, metric_sum, output, proc_named, serve, wait_until

pytestmark = [pytest.mark.procs]

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "n"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"], "additionalProperties": False}}
GREEDY = {"temperature": 0, "max_output_tokens": 12}
MAX_STORED_BYTES = 20000


@pytest.fixture(scope="module")
def server(tiny_llama):
    model = str(tiny_llama)
    with serve(model, "--data-parallel-size", "2", "--api-server-count", "2",
               "--threads-per-engine", "1", "--max-model-len", "1024",
               "--max-stored-response-bytes", str(MAX_STORED_BYTES), timeout=180) as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               timeout=60)
        yield proc, url, client, model
    # The launcher's private state directory (found by test_store_file_is_private) is gone.
    for directory in STATE_DIRS:
        assert not os.path.exists(directory), directory


STATE_DIRS: list[str] = []


def chat_text(client: openai.OpenAI, model: str, messages: list[dict], **kw) -> tuple[str, str]:
    """(text, finish_reason) of the greedy chat completion of `messages`."""
    r = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                       max_tokens=kw.pop("max_tokens", 12), **kw)
    return r.choices[0].message.content or "", r.choices[0].finish_reason


def test_create_equals_chat_and_chains_on_both_api_servers(server) -> None:
    proc, url, client, model = server
    first = client.responses.create(model=model, input="Tell me about Oslo.",
                                    instructions="Answer briefly.", **GREEDY)
    text, _ = chat_text(client, model, [{"role": "system", "content": "Answer briefly."},
                                        {"role": "user", "content": "Tell me about Oslo."}])
    assert first.id.startswith("resp_") and first.object == "response"
    assert first.output_text == text and first.output[0].type == "message"
    assert first.usage.output_tokens > 0
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
    # A follow-up gets the stored conversation, not its instructions (OpenAI's rule).
    expected, _ = chat_text(client, model, [
        {"role": "user", "content": "Tell me about Oslo."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And Bergen?"}])
    before = _finished_by_api_server(url)
    no_reuse = httpx.Limits(max_keepalive_connections=0)  # each follow-up: a new connection

    async def follow_ups(n: int) -> list[dict]:
        async with httpx.AsyncClient(timeout=60, limits=no_reuse) as http:
            resps = await asyncio.gather(*(http.post(url + "/v1/responses", json={
                "model": model, "input": "And Bergen?", "previous_response_id": first.id,
                **GREEDY}) for _ in range(n)))
        return [r.json() for r in resps]

    deadline = time.monotonic() + 60
    while True:  # until each API server has answered some (the kernel picks one per connection)
        for body in asyncio.run(follow_ups(6)):
            assert body["output_text"] == expected, body
            assert body["previous_response_id"] == first.id
        after = _finished_by_api_server(url)
        if all(after[i] > before[i] for i in ("0", "1")):
            break
        assert time.monotonic() < deadline, (before, after)


def _finished_by_api_server(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers={"Connection": "close"}, timeout=10).text
    found = {i: 0.0 for i in ("0", "1")}
    for i, value in re.findall(r'api_server_requests_finished_total\{[^}]*api_server="(\d)"'
                               r'[^}]*\} (\S+)', text):
        found[i] += float(value)
    return found


def test_retrieve_delete_input_items_and_errors(server) -> None:
    _, url, client, model = server
    r = client.responses.create(model=model, input=[
        {"role": "user", "content": "Hi"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a city."}]}],
        metadata={"case": "a"}, **GREEDY)
    got = client.responses.retrieve(r.id)
    assert (got.id, got.output_text, got.status, got.metadata) == (
        r.id, r.output_text, r.status, {"case": "a"})
    items = client.responses.input_items.list(r.id, order="asc")
    assert [(i.role, i.content[0].text) for i in items.data] == [
        ("user", "Hi"), ("assistant", "Hello."), ("user", "Name a city.")]
    assert [i.id for i in client.responses.input_items.list(r.id).data] == [
        i.id for i in reversed(items.data)]  # newest first by default
    with pytest.raises(openai.BadRequestError, match="Cannot cancel"):
        client.responses.cancel(r.id)  # finished
    client.responses.delete(r.id)
    for call in (client.responses.retrieve, client.responses.delete,
                 client.responses.cancel, client.responses.input_items.list):
        with pytest.raises(openai.NotFoundError):
            call(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model, input="x", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input=[{"role": "user", "content": "a"},
                                                    {"type": "image", "url": "x"}])
    assert e.value.body["param"] == "input[1].type"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input=[{"type": "function_call_output",
                                                     "output": "x"}])
    assert e.value.body["param"] == "input[0].call_id"
    with pytest.raises(openai.APIStatusError) as e:  # over --max-stored-response-bytes
        client.responses.create(model=model, input="word " * MAX_STORED_BYTES)
    assert e.value.status_code == 413 and "--max-stored-response-bytes" in str(e.value)
    unstored = client.responses.create(model=model, input="Hi", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_call_then_its_output(server) -> None:
    _, _, client, model = server
    r = client.responses.create(model=model, input="Weather in Oslo?", tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"},
                                temperature=0, max_output_tokens=40)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    turn = client.responses.create(model=model, previous_response_id=r.id, tools=[WEATHER],
                                   input=[{"type": "function_call_output",
                                           "call_id": call.call_id, "output": "sunny"}],
                                   **GREEDY)
    expected, _ = chat_text(client, model, [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}],
        tools=[{"type": "function", "function": {"name": "get_weather",
                                                 "parameters": WEATHER["parameters"]}}])
    assert turn.output[0].type == "message" and turn.output_text == expected
    assert [i.type for i in client.responses.input_items.list(turn.id).data] == [
        "function_call_output"]


def test_json_schema_and_max_output_tokens(server) -> None:
    _, _, client, model = server
    r = client.responses.create(model=model, input="A pet as JSON.", temperature=0,
                                max_output_tokens=64, text={"format": {
                                    "type": "json_schema", "name": "pet", "schema": SCHEMA,
                                    "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    messages = [{"role": "user", "content": "Count to ten."}]
    text, finish = chat_text(client, model, messages, max_tokens=4)
    assert finish == "length"  # the premise: 4 tokens cut this answer short
    short = client.responses.create(model=model, input="Count to ten.", temperature=0,
                                    max_output_tokens=4)
    assert short.status == "incomplete" and short.output_text == text
    assert short.incomplete_details.reason == "max_output_tokens"
    assert client.responses.retrieve(short.id).status == "incomplete"


def test_stream_events_and_final_response(server) -> None:
    _, _, client, model = server
    # A JSON answer ends by itself (completed), unlike the tiny model's free text.
    ask = dict(model=model, input="A pet as JSON.", temperature=0, max_output_tokens=64,
               text={"format": {"type": "json_schema", "name": "pet", "schema": SCHEMA}})
    plain = client.responses.create(**ask)
    with client.responses.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == deltas == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == plain.output_text
    # Cut short: the stream ends with response.incomplete (the client has no final one).
    with client.responses.stream(model=model, input="Count.", **GREEDY) as stream:
        last = list(stream)[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    # A tool call streams as a function_call item.
    with client.responses.stream(model=model, input="Weather?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 temperature=0, max_output_tokens=40) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    jsonschema.validate(json.loads(final.output[0].arguments), WEATHER["parameters"])


def test_cancel_background_and_streamed_responses(server) -> None:
    """The engines are stopped (SIGSTOP) so both responses are surely in progress
    when the cancels come; then their engine requests end aborted, long before
    their 200 tokens."""
    proc, url, client, model = server
    generated = metric_sum(url, "dpserve:generation_tokens_total")
    engines = [proc_named(descendants(proc.pid), f"EngineCore_{r}") for r in (0, 1)]
    long = dict(model=model, input="A long story.", temperature=0, max_output_tokens=200)
    for engine in engines:
        engine.send_signal(signal.SIGSTOP)
    try:
        r = client.responses.create(background=True, **long)
        assert r.status == "in_progress" and r.background
        cancelled = client.responses.cancel(r.id)
        assert cancelled.status == "cancelled"
        assert client.responses.cancel(r.id).status == "cancelled"  # as it is
        stream = iter(client.responses.create(stream=True, **long))
        created = next(stream)
        assert created.type == "response.created"
        assert client.responses.cancel(created.response.id).status == "cancelled"
        # The stream ends while the engines are still stopped: the cancel (on either
        # API server; the one running it reads the mark within CANCEL_POLL_S), not
        # the end of its tokens, ended it (bounded by the client's timeout).
        last = list(stream)[-1]
    finally:
        for engine in engines:
            engine.send_signal(signal.SIGCONT)
    assert (last.type, last.response.status) == ("response.incomplete", "cancelled")
    # Both engine requests are gone from the engines, long before their 200 tokens.
    wait_until(lambda: held_by(url, 0) + held_by(url, 1) == 0, 30, "both engines empty")
    assert metric_sum(url, "dpserve:generation_tokens_total") - generated < 400
    for rid in (r.id, created.response.id):
        assert client.responses.retrieve(rid).status == "cancelled"
    assert client.responses.retrieve(r.id).output == []


def test_stored_responses_outlive_killed_api_servers(server) -> None:
    proc, _, client, model = server
    r = client.responses.create(model=model, input="Remember Oslo.", **GREEDY)
    for i in (0, 1):  # every process that stored or read it is gone, one at a time
        victim = proc_named(descendants(proc.pid), f"APIServer_{i}")
        victim.send_signal(signal.SIGKILL)
        wait_until(lambda v=victim, i=i: _restarted(proc, v, i), 60, f"APIServer_{i} restarted")
    assert proc.poll() is None
    assert client.responses.retrieve(r.id).output_text == r.output_text
    follow = client.responses.create(model=model, input="Where?", previous_response_id=r.id,
                                     **GREEDY)
    expected, _ = chat_text(client, model, [
        {"role": "user", "content": "Remember Oslo."},
        {"role": "assistant", "content": r.output_text}, {"role": "user", "content": "Where?"}])
    assert follow.output_text == expected


def _restarted(proc, victim: psutil.Process, i: int) -> bool:
    names = [p for p in descendants(proc.pid)
             if p.is_running() and p.name() == f"dpserve::APIServer_{i}"]
    return (bool(names) and names[0].pid != victim.pid
            and f"APIServer_{i} restarted" in output(proc))


def test_store_file_is_private(server) -> None:
    """Both API servers hold the one store file, 0600 in a 0700 directory."""
    proc, _, client, model = server
    client.responses.create(model=model, input="Hi", **GREEDY)
    held = [{f.path for f in proc_named(descendants(proc.pid), f"APIServer_{i}").open_files()
             if f.path.endswith("responses.sqlite")} for i in (0, 1)]
    assert held[0] == held[1] and len(held[0]) == 1
    (path,) = held[0]
    STATE_DIRS.append(os.path.dirname(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700


def test_response_store_file_outlives_the_server(tiny_llama, tmp_path) -> None:
    """--response-store PATH: a response stored by one server is found by the next
    (one API server in the launcher's process)."""
    model, path = str(tiny_llama), str(tmp_path / "responses.sqlite")
    args = ("--threads-per-engine", "1", "--response-store", path)
    with serve(model, *args) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = client.responses.create(model=model, input="Hi", **GREEDY)
    with serve(model, *args) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert client.responses.retrieve(r.id).output_text == r.output_text
