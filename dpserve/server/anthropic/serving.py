"""Anthropic's Messages API over the chat path: a Messages request is translated to a
chat request, run by `OpenAIServing.start_chat` (limits, sampling parameters, tools
and their constraints, the chat template, admission, the engine), and its outputs
are formatted as Anthropic's message or stream events. No HTTP here.

Translation (`to_chat_request`):

* `system` (a string or text blocks, joined by newlines) -> the first system message.
* A user message's text blocks -> one user message; each `tool_result` block -> a
  `tool` message (`tool_call_id` = `tool_use_id`; its content as text) in block order.
* An assistant message's text blocks -> its content, its `tool_use` blocks -> its
  `tool_calls` (arguments: `input` as JSON).
* `tools` (`name`, `description`, `input_schema`) -> function tools; `tool_choice`
  auto / any / tool {name} / none -> "auto" / "required" / the named function /
  "none" (auto parses the chat template's call format, as on the chat endpoint; left
  out, it is the chat default), `disable_parallel_tool_use` -> parallel_tool_calls.
* `max_tokens`, `stop_sequences` -> stop, `temperature`, `top_p`, `top_k`,
  `metadata.user_id` -> user, `output_config.format` (json_schema) ->
  response_format (structured output, as on the chat endpoint).

Any other block type (image, document, thinking, ...) or a block where it cannot
be (tool_use from the user, tool_result from the assistant) is a 400 naming it
by Anthropic's path, e.g. `messages.0.content.1.type`. Errors the chat path
raises name the chat field; those are renamed to the Messages field (stop ->
stop_sequences, response_format -> output_config.format).

Output: the finished text is parsed for tool calls as on the chat endpoint
(`tool_message`); finish "stop" with a stop string -> `stop_sequence`, "length" ->
`max_tokens`, tool calls -> `tool_use`, else `end_turn`. A tool call's arguments
that are not a JSON object (cut by max_tokens) give `input` {}. Streams send text
and a named tool's arguments as they are generated; "auto" and "any" calls are
known only once the output is complete, so their blocks come at the end.

Not here: the schemas and event frames (`dpserve.server.anthropic.protocol`),
routes and the error shape (`dpserve.server.anthropic.routes`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from dpserve.frontend.errors import RequestError
from dpserve.server.anthropic.protocol import (
    ContentBlock,
    CountTokensRequest,
    CountTokensResponse,
    InputMessage,
    Message,
    MessagesRequest,
    TextBlock,
    ToolUseBlock,
    Usage,
    block_start,
    block_stop,
    error_event,
    json_delta,
    message_delta,
    message_start,
    message_stop,
    text_delta,
)
from dpserve.server.caller import ANONYMOUS, Caller
from dpserve.server.errors import APIError, to_api_error
from dpserve.server.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ResponseFormat,
    UsageInfo,
)
from dpserve.server.openai.serving import ChatRun, OpenAIServing
from dpserve.server.openai.streams import collect, merge
from dpserve.server.openai.tool_serving import tool_message
from dpserve.server.openai.tools import loads_or_text, new_call_id

# Chat fields whose errors name the Messages field instead.
_RENAMES = {"stop": "stop_sequences", "response_format": "output_config.format"}
_BLOCKS = "text, tool_use (assistant) and tool_result (user)"


class AnthropicServing:
    """POST /v1/messages and /v1/messages/count_tokens over the chat path of `chat`."""

    def __init__(self, chat: OpenAIServing) -> None:
        self.chat = chat

    async def create_message(self, req: MessagesRequest, caller: Caller = ANONYMOUS,
                             ) -> Message | AsyncIterator[str]:
        """The message, or its stream's SSE frames (`req.stream`); `caller`: as in
        `OpenAIServing.create_completion` (no session: `metadata.user_id`'s, if any)."""
        try:
            run = await self.chat.start_chat(to_chat_request(req), caller, id_prefix="msg_")
        except (RequestError, APIError) as e:
            raise _renamed(e) from None
        stops = req.stop_sequences or []
        if req.stream:
            return _stream(run, stops)
        choices, usage = await collect(run.streams, 1)
        c = choices[0]
        content, stop_reason, stop_sequence = _content("".join(c.text), c.finish_reason,
                                                       c.stop_reason, run, stops)
        return Message(id=run.request_id, model=run.model, content=content,
                       stop_reason=stop_reason, stop_sequence=stop_sequence,
                       usage=_chat_usage(usage))

    async def count_tokens(self, req: CountTokensRequest) -> CountTokensResponse:
        """The prompt's length as `create_message` would render it."""
        try:
            ids = await self.chat.chat_prompt_ids(to_chat_request(req))
        except (RequestError, APIError) as e:
            raise _renamed(e) from None
        return CountTokensResponse(input_tokens=len(ids))


# ---- request -> chat request -----------------------------------------------------------


def to_chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages request is run as (module docstring)."""
    messages = []
    if req.system:
        messages.append(ChatMessage(role="system", content=_system_text(req.system)))
    for i, m in enumerate(req.messages):
        messages += _chat_messages(i, m)
    fields: dict[str, Any] = {"model": req.model, "messages": messages}
    fields.update(_tool_fields(req))
    if isinstance(req, MessagesRequest):
        fields.update(max_tokens=req.max_tokens, stop=req.stop_sequences,
                      temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                      user=req.metadata.user_id if req.metadata else None)
        fmt = req.output_config.format if req.output_config else None
        if fmt is not None:
            fields["response_format"] = ResponseFormat(type="json_schema",
                                                       json_schema={"schema": fmt.schema_})
    return ChatCompletionRequest(**fields)


def _system_text(system: str | list[ContentBlock]) -> str:
    if isinstance(system, str):
        return system
    for j, block in enumerate(system):
        if block.type != "text" or block.text is None:
            raise RequestError(f"system.{j}.type: system blocks must be text blocks, got "
                               f"{block.type!r}", param=f"system.{j}.type")
    return "\n".join(block.text or "" for block in system)


def _chat_messages(i: int, m: InputMessage) -> list[ChatMessage]:
    """One Messages message as chat messages (tool results become `tool` messages)."""
    if isinstance(m.content, str):
        return [ChatMessage(role=m.role, content=m.content)]
    out: list[ChatMessage] = []
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(m.content):
        where = f"messages.{i}.content.{j}"
        if block.type == "text":
            text.append(_field(block.text, str, f"{where}.text"))
        elif block.type == "tool_use" and m.role == "assistant":
            calls.append({"id": _field(block.id, str, f"{where}.id"), "type": "function",
                          "function": {"name": _field(block.name, str, f"{where}.name"),
                                       "arguments": json.dumps(_field(
                                           block.input, dict, f"{where}.input"))}})
        elif block.type == "tool_result" and m.role == "user":
            if text:  # text before a result stays before it
                out.append(ChatMessage(role="user", content="".join(text)))
                text = []
            out.append(ChatMessage(role="tool", content=_result_text(block, where),
                                   tool_call_id=_field(block.tool_use_id, str,
                                                       f"{where}.tool_use_id")))
        else:
            raise RequestError(f"{where}.type: {block.type!r} blocks are not supported in "
                               f"a {m.role} message; this server takes {_BLOCKS}",
                               param=f"{where}.type")
    if text or calls or not out:
        out.append(ChatMessage(role=m.role, content="".join(text),
                               tool_calls=calls or None))
    return out


def _result_text(block: ContentBlock, where: str) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    for k, part in enumerate(block.content):
        if part.type != "text" or part.text is None:
            raise RequestError(f"{where}.content.{k}.type: a tool_result's content must be "
                               f"text blocks, got {part.type!r}",
                               param=f"{where}.content.{k}.type")
    return "".join(part.text or "" for part in block.content)


def _field(value: Any, kind: type, name: str) -> Any:
    if not isinstance(value, kind):
        what = "an object" if kind is dict else "a string"
        raise RequestError(f"{name}: must be {what}", param=name)
    return value


def _tool_fields(req: CountTokensRequest) -> dict[str, Any]:
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.type not in (None, "custom"):
            raise RequestError(f"tools.{i}.type: server tools ({t.type!r}) are not "
                               f"supported; give name, description and input_schema",
                               param=f"tools.{i}.type")
        if t.input_schema is None:
            raise RequestError(f"tools.{i}.input_schema: required",
                               param=f"tools.{i}.input_schema")
        fn = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            fn["description"] = t.description
        tools.append({"type": "function", "function": fn})
    choice = req.tool_choice
    if choice is None:
        return {"tools": tools or None}
    if choice.type == "tool" and choice.name is None:
        raise RequestError("tool_choice.name: required with type 'tool'",
                           param="tool_choice.name")
    chat_choice = {"auto": "auto", "any": "required", "none": "none"}.get(
        choice.type, {"type": "function", "function": {"name": choice.name}})
    parallel = False if choice.disable_parallel_tool_use else None
    return {"tools": tools or None, "tool_choice": chat_choice,
            "parallel_tool_calls": parallel}


def _renamed(e: RequestError | APIError) -> RequestError | APIError:
    """`e`, naming the Messages field where the chat path named its chat field."""
    param = e.param or ""
    new = _RENAMES.get(param)
    if new is None:
        return e
    message = str(e) if isinstance(e, RequestError) else e.message
    if message.startswith(f"{param}:"):
        message = new + message[len(param):]
    if isinstance(e, APIError):
        return APIError(e.status_code, message, e.type, new, e.code, e.headers)
    return RequestError(message, param=new, code=e.code)


# ---- outputs -> Messages ------------------------------------------------------------------


def _usage(prompt_tokens: int, cached: int, output_tokens: int) -> Usage:
    return Usage(input_tokens=prompt_tokens - cached, cache_read_input_tokens=cached,
                 output_tokens=output_tokens)


def _chat_usage(usage: UsageInfo) -> Usage:
    details = usage.prompt_tokens_details
    return _usage(usage.prompt_tokens, details.cached_tokens if details else 0,
                  usage.completion_tokens)


def _stop(finish: str | None, stop_reason: int | str | None, stops: list[str],
          ) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished output."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "stop" and isinstance(stop_reason, str) and stop_reason in stops:
        return "stop_sequence", stop_reason
    return "end_turn", None


def _content(text: str, finish: str | None, stop_reason: int | str | None, run: ChatRun,
             stops: list[str]) -> tuple[list[TextBlock | ToolUseBlock], str, str | None]:
    """(content blocks, stop_reason, stop_sequence) of a finished output."""
    message, finish = tool_message(text, finish, run.plan)
    content: list[TextBlock | ToolUseBlock] = []
    if message.content:
        content.append(TextBlock(text=message.content))
    for call in message.tool_calls or []:
        args = loads_or_text(call.function.arguments)
        content.append(ToolUseBlock(id=_tool_use_id(call.id), name=call.function.name or "",
                                    input=args if isinstance(args, dict) else {}))
    return (content, *_stop(finish, stop_reason, stops))


def _tool_use_id(call_id: str | None) -> str:
    return "toolu_" + (call_id or "").removeprefix("call_")


async def _stream(run: ChatRun, stops: list[str]) -> AsyncIterator[str]:
    """The SSE frames of a streamed message (module docstring)."""
    yield message_start(Message(id=run.request_id, model=run.model, content=[],
                                usage=_usage(run.num_prompt_tokens, 0, 0)))
    try:
        if run.plan is None or run.plan.mode in ("none", "named"):
            frames = _live_block(run, stops)
        else:
            frames = _blocks_at_end(run, stops)
        async with aclosing(frames):
            async for frame in frames:
                yield frame
    except Exception as e:  # noqa: BLE001 - the status is sent: report in the stream
        error = to_api_error(e)
        yield error_event(error.status_code, error.message)
        return
    yield message_stop()


async def _live_block(run: ChatRun, stops: list[str]) -> AsyncIterator[str]:
    """One block streamed as generated: text, or the named tool's arguments."""
    named = run.plan is not None and run.plan.mode == "named"
    started, finish, stop_reason = False, None, None
    prompt = cached = output = 0
    async with aclosing(merge(run.streams)) as merged:
        async for _, out in merged:
            if out.finished:
                prompt, cached = len(out.prompt_token_ids), out.num_cached_tokens
            for c in out.outputs:
                output += len(c.token_ids)
                finish, stop_reason = c.finish_reason or finish, c.stop_reason
                if not c.text:
                    continue
                if not started:
                    started = True
                    yield block_start(0, ToolUseBlock(
                        id=_tool_use_id(new_call_id()), name=run.plan.name or "", input={})
                        if named and run.plan else TextBlock(text=""))
                yield json_delta(0, c.text) if named else text_delta(0, c.text)
    if started:
        yield block_stop(0)
    if named and finish == "stop":
        finish = "tool_calls"
    yield message_delta(*_stop(finish, stop_reason, stops), _usage(prompt, cached, output))


async def _blocks_at_end(run: ChatRun, stops: list[str]) -> AsyncIterator[str]:
    """"auto" / "any" tool calls: every block once the output is complete."""
    choices, usage = await collect(run.streams, 1)
    c = choices[0]
    content, stop_reason, stop_sequence = _content("".join(c.text), c.finish_reason,
                                                   c.stop_reason, run, stops)
    for index, block in enumerate(content):
        if isinstance(block, TextBlock):
            yield block_start(index, TextBlock(text=""))
            yield text_delta(index, block.text)
        else:
            yield block_start(index, block.model_copy(update={"input": {}}))
            yield json_delta(index, json.dumps(block.input))
        yield block_stop(index)
    yield message_delta(stop_reason, stop_sequence, _chat_usage(usage))
