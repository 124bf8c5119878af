"""Tool calls in chat responses: history messages in, tool_calls out, and the stream.

Streams follow OpenAI's shape: per call a first delta with `index`, `id`, `type`
and `function.name` (arguments ""), then deltas of `function.arguments`; the
choice ends with finish_reason `tool_calls`. A named function's arguments are
streamed as they are generated; `required` and `auto` calls are known only once
the output is complete (the whole array, or the parser's markers), so their
deltas come at the end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from dpserve.outputs import CompletionOutput
from dpserve.sampling_params import SamplingParams
from dpserve.server.errors import to_api_error
from dpserve.server.openai.protocol import (
    ChatCompletionChunk,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    FunctionCall,
    ToolCall,
)
from dpserve.server.openai.streams import collect, sse, sse_lines
from dpserve.server.openai.tools import ToolPlan, loads_or_text, new_call_id, parse_tool_calls


def history_message(role: str, content: str, m: ChatMessage, native: bool) -> dict[str, Any]:
    """One request message as the template (or the fallback rendering) reads it."""
    msg: dict[str, Any] = {"role": role, "content": content}
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            fn = dict(c.get("function") or {})
            args = fn.get("arguments")
            if native and isinstance(args, str):  # templates write arguments | tojson
                fn["arguments"] = loads_or_text(args)
            calls.append({"id": c.get("id"), "type": "function", "function": fn})
        msg["tool_calls"] = calls
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.name is not None and role == "tool":
        msg["name"] = m.name
    return msg


def tool_message(text: str, finish_reason: str | None, plan: ToolPlan | None,
                 ) -> tuple[ChatResponseMessage, str | None]:
    """(the assistant message, finish_reason) of a finished choice."""
    if plan is None or plan.mode == "none":
        return ChatResponseMessage(content=text), finish_reason
    content, calls = parse_tool_calls(plan, text)
    if not calls:
        return ChatResponseMessage(content=text), finish_reason
    return ChatResponseMessage(content=content, tool_calls=[
        ToolCall(id=new_call_id(), function=FunctionCall(name=c["name"],
                                                         arguments=c["arguments"]))
        for c in calls]), ("tool_calls" if finish_reason == "stop" else finish_reason)


async def chat_tool_stream(request_id: str, streams: list[AsyncIterator[Any]],
                           params: SamplingParams, include_usage: bool,
                           plan: ToolPlan, model: str) -> AsyncIterator[str]:
    """The SSE lines of a chat stream whose choices may be tool calls (`model`: the
    name the chunks carry)."""
    def chunk(index: int, delta: DeltaMessage, finish: str | None = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=model, choices=[
            ChatStreamChoice(index=index, delta=delta, finish_reason=finish)]))

    for i in range(len(streams) * params.n):  # OpenAI sends the role first
        yield chunk(i, DeltaMessage(role="assistant", content=""))
    if plan.mode == "named":
        async for line in _named_stream(request_id, streams, params,
                                        include_usage, plan, model):
            yield line
        return
    try:
        choices, usage = await collect(streams, params.n)
    except Exception as e:  # noqa: BLE001 - the status is sent: report in the stream
        yield _error_line(e)
        yield "data: [DONE]\n\n"
        return
    for i, c in enumerate(choices):
        message, finish = tool_message("".join(c.text), c.finish_reason, plan)
        if message.content:
            yield chunk(i, DeltaMessage(content=message.content))
        for k, call in enumerate(message.tool_calls or []):
            yield chunk(i, DeltaMessage(tool_calls=[ToolCall(
                index=k, id=call.id, function=FunctionCall(name=call.function.name,
                                                           arguments=""))]))
            yield chunk(i, DeltaMessage(tool_calls=[ToolCall(
                index=k, type=None, function=FunctionCall(arguments=call.function.arguments))]))
        yield chunk(i, DeltaMessage(), finish)
    if include_usage:
        yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[],
                                       usage=usage))
    yield "data: [DONE]\n\n"


def _error_line(e: Exception) -> str:
    error = to_api_error(e)
    return sse(ErrorResponse(error=ErrorInfo(message=error.message, type=error.type,
                                              param=error.param, code=error.code)))


async def _named_stream(request_id: str, streams: list[AsyncIterator[Any]],
                        params: SamplingParams, include_usage: bool,
                        plan: ToolPlan, model: str) -> AsyncIterator[str]:
    started: set[int] = set()

    def chunk(index: int, c: CompletionOutput) -> ChatCompletionChunk:
        call = ToolCall(index=0, type=None, function=FunctionCall(arguments=c.text))
        if index not in started:
            started.add(index)
            call = ToolCall(index=0, id=new_call_id(), function=FunctionCall(
                name=plan.name, arguments=c.text))
        finish = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
        return ChatCompletionChunk(id=request_id, model=model, choices=[
            ChatStreamChoice(index=index, delta=DeltaMessage(tool_calls=[call]),
                             finish_reason=finish)])

    def usage_chunk(usage: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, model=model, choices=[],
                                   usage=usage)

    async for line in sse_lines(streams, params.n, chunk, usage_chunk, include_usage):
        yield line
