"""Tool-calling logic (no model): plans, the constraint schema, parsers, the fallback
rendering of tools, calls and results for templates without tool support."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest

from dpserve.frontend.errors import RequestError
from dpserve.server.openai.tools import (
    detect_tool_parser,
    parse_tool_calls,
    plan_tools,
    render_messages,
    template_supports_tools,
    tool_constraint,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def _req(tools=None, tool_choice=None, parallel_tool_calls=None) -> SimpleNamespace:
    return SimpleNamespace(tools=tools, tool_choice=tool_choice,
                           parallel_tool_calls=parallel_tool_calls)


def test_plans() -> None:
    assert plan_tools(_req(), None) is None
    assert plan_tools(_req([WEATHER]), None).mode == "none"  # no parser: shown only
    assert plan_tools(_req([WEATHER]), "hermes").mode == "auto"
    named = plan_tools(_req([WEATHER, CLOCK], {"type": "function",
                                               "function": {"name": "get_time"}}), None)
    assert (named.mode, named.name) == ("named", "get_time")
    for bad, message in [(_req([WEATHER], "auto"), "--tool-call-parser"),
                         (_req([WEATHER], {"function": {"name": "x"}}), "not in tools"),
                         (_req([WEATHER], "sometimes"), "tool_choice must be"),
                         (_req(None, "required"), "needs tools"),
                         (_req([{"type": "function"}], "required"), r"tools\[0\]")]:
        with pytest.raises(RequestError, match=message):
            plan_tools(bad, None)


def test_required_schema_accepts_calls_of_any_tool() -> None:
    plan = plan_tools(_req([WEATHER, CLOCK], "required", parallel_tool_calls=False), None)
    schema = json.loads(tool_constraint(plan).json)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}}], schema)
    jsonschema.validate([{"name": "get_time", "arguments": {}}], schema)
    for bad in ([], [{"name": "nope", "arguments": {}}],
                [{"name": "get_time", "arguments": {}}] * 2,  # parallel_tool_calls=False
                [{"name": "get_weather", "arguments": {}}]):  # city missing
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = plan_tools(_req([WEATHER], {"function": {"name": "get_weather"}}), None)
    assert json.loads(tool_constraint(named).json) == WEATHER["function"]["parameters"]


def test_parsers() -> None:
    hermes = plan_tools(_req([WEATHER]), "hermes")
    content, calls = parse_tool_calls(hermes, 'Let me see.\n<tool_call>{"name": "get_weather", '
                                      '"arguments": {"city": "Oslo"}}</tool_call>')
    assert content == "Let me see." and calls == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert parse_tool_calls(hermes, "just text") == ("just text", [])
    llama = plan_tools(_req([WEATHER]), "llama3_json")
    content, calls = parse_tool_calls(llama, '<|python_tag|>{"name": "get_weather", '
                                      '"parameters": {"city": "A"}}; {"name": "get_time", '
                                      '"parameters": {}}')
    assert content is None and [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert parse_tool_calls(llama, '{"not": "a call"}') == ('{"not": "a call"}', [])
    single = plan_tools(_req([WEATHER], parallel_tool_calls=False), "llama3_json")
    assert len(parse_tool_calls(single, '{"name": "a", "parameters": {}}; '
                                        '{"name": "b", "parameters": {}}')[1]) == 1


# The parts of chat templates that say how a model writes its calls (as in Qwen2.5 /
# Hermes, Mistral and Llama 3.1 templates), each inside a template that renders tools.
TOOLS_LOOP = "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"


def test_the_parser_is_the_chat_templates_format() -> None:
    assert detect_tool_parser(TOOLS_LOOP + "<tool_call>\n{...}\n</tool_call>")[0] == "hermes"
    assert detect_tool_parser(TOOLS_LOOP + "{{ '[TOOL_CALLS]' }}")[0] == "mistral"
    assert detect_tool_parser(TOOLS_LOOP + "<|python_tag|>")[0] == "llama3_json"
    assert detect_tool_parser(TOOLS_LOOP + "ipython ... \"parameters\"")[0] == "llama3_json"
    # No tools in the template: dpserve renders them Hermes-style itself.
    assert detect_tool_parser("{% for m in messages %}{{ m.content }}{% endfor %}")[0] \
        == "hermes"
    assert detect_tool_parser(None)[0] == "hermes"
    parser, why = detect_tool_parser(TOOLS_LOOP + "<function_call>")  # unknown: refused
    assert parser is None and "--tool-call-parser" in why
    with pytest.raises(RequestError, match="--tool-call-parser"):
        plan_tools(_req([WEATHER], "auto"), parser)
    assert plan_tools(_req([WEATHER]), parser).mode == "none"  # left out: shown only


def test_mistral_calls() -> None:
    mistral = plan_tools(_req([WEATHER, CLOCK]), "mistral")
    array = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, ' \
            '{"name": "get_time", "arguments": {}}]'
    for text in (array, "[TOOL_CALLS]" + array,
                 '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}'):
        content, calls = parse_tool_calls(mistral, text)
        assert content is None and calls == [
            {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            {"name": "get_time", "arguments": "{}"}], text
    for text in ("[1, 2]", "plain [text]", "[TOOL_CALLS]get_weather[ARGS]{broken"):
        assert parse_tool_calls(mistral, text) == (text, []), text


def test_fallback_rendering() -> None:
    assert template_supports_tools("{% if tools %}...{% endif %}")
    assert not template_supports_tools("{{ m['content'] }}")
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}]
    out = render_messages(messages, [WEATHER["function"]], native=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and "<tools>" in out[0]["content"]
    assert '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>{"name": "get_weather", "arguments": '
                                 '{"city": "Oslo"}}</tool_call>')
    assert out[3]["content"] == "<tool_response>\n21 C\n</tool_response>"
    assert render_messages(messages, [WEATHER["function"]], native=True) is messages
