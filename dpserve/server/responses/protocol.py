"""The Responses API's shapes, and their translation to and from the chat request.

Scope:

* `ResponsesRequest`: the body of `POST /v1/responses` (parsed strictly, unknown
  fields ignored as elsewhere).
* `input_items(input)`: `input` (a string, or a list of items: messages with
  `input_text` / `output_text` parts or a string, `function_call`,
  `function_call_output`) -> the normalised items that are stored and listed by
  `/input_items`; a bad item is a 400 naming it (`input[2].type`).
* `chat_body(req, history)`: the `ChatCompletionRequest` the request runs as:
  `instructions` as the system message (never carried over a chain, as OpenAI
  documents), the chain's items, then this request's; function tools, `tool_choice`,
  `text.format` (json_schema / json_object -> `response_format`), the sampling fields.
* `output_from_chat(message)` / `new_response(...)` / `usage(...)`: a chat result ->
  the Responses output items and response object.

Not here: running it (`dpserve.server.responses.routes`), the stream's events
(`dpserve.server.responses.stream`), storing it (`dpserve.server.responses.store`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict

from dpserve.frontend.errors import RequestError
from dpserve.server.openai.protocol import ChatCompletionRequest, ChatResponseMessage, UsageInfo

_ROLES = ("user", "system", "developer", "assistant")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": ..., ...}}
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- input ---------------------------------------------------------------------------


def input_items(given: str | list[Any]) -> list[dict[str, Any]]:
    """The request's `input` as normalised items (module docstring); 400 naming a bad one."""
    if isinstance(given, str):
        return [_message("user", [{"type": "input_text", "text": given}])]
    if not given:
        raise RequestError("input must not be empty", param="input")
    return [_item(item, f"input[{i}]") for i, item in enumerate(given)]


def _item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise RequestError(f"{where} must be an object", param=where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise RequestError(f"{where}.role must be one of {list(_ROLES)}, got {role!r}",
                               param=f"{where}.role")
        return _message(role, _parts(item.get("content"), f"{where}.content", role))
    if kind == "function_call":
        _strings(item, where, ("call_id", "name", "arguments"))
        return {"type": "function_call", "id": item.get("id") or new_id("fc"),
                "call_id": item["call_id"], "name": item["name"],
                "arguments": item["arguments"], "status": "completed"}
    if kind == "function_call_output":
        _strings(item, where, ("call_id", "output"))
        return {"type": "function_call_output", "id": item.get("id") or new_id("fco"),
                "call_id": item["call_id"], "output": item["output"], "status": "completed"}
    raise RequestError(f"{where}.type {kind!r} is not supported; use 'message', "
                       f"'function_call' or 'function_call_output'", param=f"{where}.type")


def _strings(item: dict[str, Any], where: str, names: tuple[str, ...]) -> None:
    for name in names:
        if not isinstance(item.get(name), str):
            raise RequestError(f"{where}.{name} must be a string", param=f"{where}.{name}")


def _parts(content: Any, where: str, role: str) -> list[dict[str, Any]]:
    kind = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        return [{"type": kind, "text": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of content parts",
                           param=where)
    parts = []
    for j, part in enumerate(content):
        if (not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text")
                or not isinstance(part.get("text"), str)):
            raise RequestError(f"{where}[{j}] must be an input_text or output_text part "
                               f"with a text string (only text is supported)",
                               param=f"{where}[{j}]")
        parts.append({"type": part["type"], "text": part["text"]})
    return parts


def _message(role: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": new_id("msg"), "role": role, "content": content,
            "status": "completed"}


# ---- the chat request ----------------------------------------------------------------


def chat_messages(instructions: str | None, items: list[dict[str, Any]]
                  ) -> list[dict[str, Any]]:
    """Items (stored or new, input or output) -> chat messages, in order."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        if item["type"] == "message":
            text = "".join(p["text"] for p in item["content"])
            messages.append({"role": item["role"], "content": text})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # calls of one turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": item["output"]})
    return messages


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request `req` runs as, after `history` (the chain's and its own items)."""
    body: dict[str, Any] = {
        "model": req.model, "messages": chat_messages(req.instructions, history),
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "user": req.user, "stream": req.stream and not req.background,
        "tools": [_chat_tool(t, i) for i, t in enumerate(req.tools or [])] or None,
        "tool_choice": _chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text)}
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    return ChatCompletionRequest.model_validate(body)


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise RequestError(f"tools[{i}].type must be 'function' (only function tools are "
                           f"supported)", param=f"tools[{i}].type")
    if not isinstance(tool.get("name"), str):
        raise RequestError(f"tools[{i}].name must be a string", param=f"tools[{i}].name")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice  # "auto" | "none" | "required"; others: tools.py's 400
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise RequestError('tool_choice must be "none", "auto", "required" or {"type": '
                       '"function", "name": ...}', param="tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise RequestError("text.format.schema must be a JSON schema object",
                               param="text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"),
                                                       "schema": fmt["schema"]}}
    raise RequestError("text.format.type must be 'text', 'json_object' or 'json_schema'",
                       param="text.format.type")


# ---- the response --------------------------------------------------------------------


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": new_id("msg"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed"
              ) -> dict[str, Any]:
    return {"type": "function_call", "id": new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_from_chat(message: ChatResponseMessage) -> list[dict[str, Any]]:
    """A chat choice's message -> output items: its text (unless it is only calls),
    then one function_call item per call."""
    calls = message.tool_calls or []
    out = [message_item(message.content or "")] if message.content or not calls else []
    out += [call_item(c.id or new_id("call"), c.function.name or "",
                      c.function.arguments or "") for c in calls]
    return out


def usage(u: UsageInfo | None) -> dict[str, Any] | None:
    if u is None:
        return None
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens_details": {"reasoning_tokens": 0}}


def status_of(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """(status, incomplete_details) of a finished choice."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "incomplete", {"reason": "aborted"}
    return "completed", None


def new_response(req: ResponsesRequest, response_id: str, model: str, status: str,
                 output: list[dict[str, Any]] | None = None, **fields: Any) -> dict[str, Any]:
    """The response object (OpenAI's fields; `fields`: usage, incomplete_details, error)."""
    return with_output({
        "id": response_id, "object": "response", "created_at": int(time.time()),
        "background": req.background, "error": None,
        "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "model": model,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "store": req.store,
        "temperature": req.temperature, "top_p": req.top_p,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
        "truncation": "disabled", "usage": None, "user": req.user,
        "metadata": req.metadata or {}}, output or [], status, **fields)


def with_output(response: dict[str, Any], output: list[dict[str, Any]], status: str,
                **fields: Any) -> dict[str, Any]:
    """`response` with its output (and the `output_text` convenience), status and `fields`."""
    text = "".join(p["text"] for item in output if item["type"] == "message"
                   for p in item["content"] if p["type"] == "output_text")
    return {**response, "status": status, "output": output, "output_text": text, **fields}
