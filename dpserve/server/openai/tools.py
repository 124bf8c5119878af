"""Tool calling for /v1/chat/completions: plans, constraints, rendering, parsing.

* `detect_tool_parser(template)`: which parser reads the model's calls, from the
  chat template (the format it shows the model): `<tool_call>` tags -> hermes,
  `[TOOL_CALLS]` -> mistral, `<|python_tag|>` / ipython with `parameters` ->
  llama3_json; a template that does not render tools gets dpserve's own Hermes-style
  rendering (below), so hermes; a template that renders tools some other way: none.
  `--tool-call-parser NAME` overrides it.
* `plan_tools(req, parser)`: `tools` + `tool_choice` -> a `ToolPlan`: `none` (the
  tools are shown to the model, nothing is parsed), `auto` (the text is parsed for
  calls; refused, naming `--tool-call-parser`, when no parser is known), `required`
  and a named function (the output is constrained by a JSON schema built from the
  tools, so they work with any model and parser). `tool_choice` left out means
  `auto` when the server has a parser, else `none`.
* `tool_constraint(plan)`: `required` -> an array of `{"name", "arguments"}` objects,
  one per call (exactly one when `parallel_tool_calls` is false); named -> the
  function's `parameters` (the output is the arguments object).
* `render_messages`: history messages (assistant `tool_calls`, `tool` results) for
  the chat template. A template that does not mention tools gets the documented
  fallback (Hermes style): the tools in a system message inside `<tools></tools>`,
  each call as `<tool_call>{"name": ..., "arguments": ...}</tool_call>` in the
  assistant's text, each result as a user message inside `<tool_response></tool_response>`.
* `parse_tool_calls(plan, text)`: (content, calls) from a finished output.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from dpserve.frontend.errors import RequestError
from dpserve.structured.spec import StructuredOutputs

PARSERS = ("hermes", "llama3_json", "mistral")

logger = logging.getLogger(__name__)


@dataclass
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]]  # the `function` objects: name, description, parameters
    name: str | None = None  # the named function
    parallel: bool = True
    parser: str | None = None  # auto: one of PARSERS
    ids: list[str] = field(default_factory=list)


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    """`dpserve serve`'s tool-calling flags (vLLM's names)."""
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='Accepted for vLLM compatibility: tool_choice "auto" is on '
                             "whenever a parser is known (--tool-call-parser, else the chat "
                             "template's format).")
    parser.add_argument("--tool-call-parser", default=None, choices=list(PARSERS),
                        help="How the model writes tool calls, for tool_choice \"auto\": "
                             "hermes (<tool_call> tags), llama3_json, mistral ([TOOL_CALLS]). "
                             "Default: the chat template's format (hermes if it shows none).")


def plan_tools(req: Any, parser: str | None) -> ToolPlan | None:
    """The request's tool plan (None: no tools); RequestError for a bad combination."""
    tools = [_function(t, i) for i, t in enumerate(req.tools or [])]
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise RequestError("tool_choice needs tools", param="tool_choice")
        return None
    if choice is None:
        choice = "auto" if parser else "none"
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if not parser:
            raise RequestError('"auto" tool choice needs a tool-call parser, and the chat '
                               "template writes calls in a format this server does not "
                               "recognise: start it with --tool-call-parser (one of "
                               f"{', '.join(PARSERS)})", param="tool_choice")
        return ToolPlan("auto", tools, parallel=parallel, parser=parser)
    if choice == "required":
        return ToolPlan("required", tools, parallel=parallel)
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise RequestError('tool_choice must be "none", "auto", "required" or {"type": '
                           '"function", "function": {"name": ...}}', param="tool_choice")
    if name not in {t["name"] for t in tools}:
        raise RequestError(f"tool_choice names {name!r}, which is not in tools",
                           param="tool_choice")
    return ToolPlan("named", tools, name=name, parallel=False)


def detect_tool_parser(template: str | None) -> tuple[str | None, str]:
    """The parser for tool_choice "auto" that `template` implies, and why (a phrase
    for the start-up log); None: the template renders tools in a format not known."""
    if not template_supports_tools(template):
        return "hermes", "the chat template does not render tools: dpserve shows them " \
                         "Hermes-style (<tool_call> tags)"
    assert template is not None
    if "<tool_call>" in template:
        return "hermes", "the chat template writes <tool_call> tags"
    if "[TOOL_CALLS]" in template:
        return "mistral", "the chat template writes [TOOL_CALLS]"
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return "llama3_json", "the chat template writes Llama 3 JSON calls"
    return None, "the chat template renders tools in a format not recognised " \
                 "(--tool-call-parser names one)"


def choose_tool_parser(given: str | None, template: str | None) -> str | None:
    """The server's parser for tool_choice "auto": `given` (--tool-call-parser), else
    the template's (`detect_tool_parser`; None: "auto" is refused, naming the flag).
    Logged once, with the reason."""
    parser, why = (given, "--tool-call-parser") if given else detect_tool_parser(template)
    logger.info('tool_choice "auto": %s (%s)', f"parser {parser}" if parser else "refused",
                why)
    return parser


def _function(tool: Any, i: int) -> dict[str, Any]:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if (not isinstance(tool, dict) or tool.get("type", "function") != "function"
            or not isinstance(fn, dict) or not isinstance(fn.get("name"), str)):
        raise RequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                           f"{{\"name\": ..., \"parameters\": ...}}}}", param="tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object",
                           param="tools")
    return {k: v for k, v in fn.items() if v is not None}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("parameters") or {"type": "object", "properties": {}}


def tool_constraint(plan: ToolPlan) -> StructuredOutputs | None:
    """The JSON schema `required` and named calls are constrained by."""
    if plan.mode == "named":
        tool = next(t for t in plan.tools if t["name"] == plan.name)
        return StructuredOutputs(json=json.dumps(_parameters(tool)))
    if plan.mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                               "arguments": _parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in plan.tools]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not plan.parallel:
        schema["maxItems"] = 1
    return StructuredOutputs(json=json.dumps(schema))


# ---- history ------------------------------------------------------------------------


def template_supports_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template  # type: ignore[operator]


def render_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    native: bool) -> list[dict[str, Any]]:
    """Messages for the template; `native`: the template renders tools and calls itself."""
    if native:
        return messages
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content":
                        f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>" + json.dumps({"name": c["function"]["name"],
                                            "arguments": loads_or_text(c["function"]["arguments"])})
                + "</tool_call>" for c in m["tool_calls"])
            text = (m.get("content") or "") + ("\n" if m.get("content") else "") + calls
            out.append({"role": m["role"], "content": text})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        listing = "\n".join(json.dumps({"type": "function", "function": t}) for t in tools)
        system = ("You may call one or more functions. The functions:\n<tools>\n"
                  f"{listing}\n</tools>\nFor each call, reply with <tool_call>{{\"name\": "
                  "<function name>, \"arguments\": <arguments object>}</tool_call>.")
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def loads_or_text(text: Any) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError:
        return text


# ---- output -------------------------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, [{"name", "arguments" (JSON text)}]) of a finished output. Text that
    does not parse as calls stays content."""
    calls: list[dict[str, Any]] = []
    content: str | None = text
    if plan.mode == "named":
        return None, [{"name": plan.name, "arguments": text}]
    if plan.mode == "required":
        parsed = loads_or_text(text)
        if isinstance(parsed, list):
            calls = [c for c in parsed if isinstance(c, dict) and "name" in c]
            content = None if calls else text
    elif plan.mode == "auto":
        content, calls = _PARSE[plan.parser or "hermes"](text)
        calls = calls if plan.parallel else calls[:1]  # parallel_tool_calls=false
    return content, [{"name": c["name"], "arguments": json.dumps(
        c.get("arguments", c.get("parameters", {})))} for c in calls]


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    calls = [c for c in (loads_or_text(m) for m in _HERMES.findall(text))
             if isinstance(c, dict) and isinstance(c.get("name"), str)]
    if not calls:
        return text, []
    before = text[:text.find("<tool_call>")].strip()
    return before or None, calls


def _llama3_json(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        calls.append(obj)
        pos = end
        while pos < len(body) and body[pos] in " \n;":
            pos += 1
    return None, calls


_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)\[ARGS\]")


def _mistral(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Mistral's calls: `[TOOL_CALLS]` (a special token: absent from the text when
    special tokens are skipped) then a JSON array of {"name", "arguments"}, or, in
    newer templates, `name[ARGS]{...}` once per call."""
    body = text.strip()
    marked = body.startswith("[TOOL_CALLS]")
    body = body.removeprefix("[TOOL_CALLS]").strip()
    if body.startswith("["):
        calls = loads_or_text(body)
        if isinstance(calls, list) and calls and all(
                isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
            return None, calls
        return text, []
    if not marked:
        return text, []
    calls, pos, decoder = [], 0, json.JSONDecoder()
    while pos < len(body):
        named = _MISTRAL_NAMED.match(body, pos)
        if named is None:
            return text, []
        try:
            arguments, pos = decoder.raw_decode(body, named.end())
        except json.JSONDecodeError:
            return text, []
        calls.append({"name": named.group(1), "arguments": arguments})
        while body.startswith(("[TOOL_CALLS]", " ", "\n"), pos):  # to the next call
            pos += len("[TOOL_CALLS]") if body.startswith("[TOOL_CALLS]", pos) else 1
    return (None, calls) if calls else (text, [])


_PARSE = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral}
