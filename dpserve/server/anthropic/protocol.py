"""Anthropic's Messages API on the wire: request and response schemas, stream events,
the error body.

Requests are parsed as the OpenAI ones are (`model_validate_json(body,
strict=True)`: a wrong JSON type is a 400 naming the field); unknown fields
(`cache_control`, `thinking`, `service_tier`, ...) are ignored. Content blocks
are parsed loosely (`ContentBlock`: a `type` and the fields of the types
dpserve reads); which types are allowed where is the translation's check
(`dpserve.server.anthropic.serving`), so a bad one is named by its position.

Stream events are SSE frames `event: NAME\\ndata: {...}\\n\\n` in Anthropic's
order: message_start, per content block content_block_start ->
content_block_delta (text_delta | input_json_delta)... -> content_block_stop,
message_delta (stop_reason, stop_sequence, usage), message_stop; an error
after the status was sent is an `error` event that ends the stream.

Usage is Anthropic's: `input_tokens` are the prompt tokens computed for this
request, `cache_read_input_tokens` those served from the prefix cache (their
sum is the prompt, what /v1/messages/count_tokens says), `output_tokens` the
generated ones.

Not here: the translation to and from the chat request, HTTP.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# HTTP status -> Anthropic's error type (its documented pairs; 503 is its 529's).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               504: "timeout_error"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- requests ------------------------------------------------------------------------


class ContentBlock(_Model):
    """One content block as sent; the fields of each type dpserve reads."""

    type: str
    text: str | None = None  # text
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: Any = None  # tool_use: the arguments object
    tool_use_id: str | None = None  # tool_result: the call it answers
    content: str | list[ContentBlock] | None = None  # tool_result: text or text blocks
    is_error: bool | None = None  # tool_result


class InputMessage(_Model):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Model):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required for a client tool
    type: str | None = None  # None or "custom": a client tool; others are server tools


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool"
    disable_parallel_tool_use: bool | None = None


class OutputFormat(_Model):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    format: OutputFormat | None = None  # structured output (`effort` is ignored)


class Metadata(_Model):
    user_id: str | None = None


class CountTokensRequest(_Model):
    """POST /v1/messages/count_tokens (and the prompt part of POST /v1/messages)."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    stream: bool = False


# ---- responses -----------------------------------------------------------------------


class TextBlock(_Model):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(_Model):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class Usage(_Model):
    input_tokens: int  # prompt tokens computed (not from the prefix cache)
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0  # prompt tokens served from the prefix cache


class Message(_Model):
    id: str  # msg_...
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextBlock | ToolUseBlock]
    stop_reason: str | None = None  # end_turn | max_tokens | stop_sequence | tool_use
    stop_sequence: str | None = None  # the one that matched (stop_reason stop_sequence)
    usage: Usage


class CountTokensResponse(_Model):
    input_tokens: int


# ---- stream events -------------------------------------------------------------------


def event(name: str, data: dict[str, Any]) -> str:
    """One SSE frame: the event's name, and its data with the same `type`."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"


def message_start(message: Message) -> str:
    return event("message_start", {"message": message.model_dump()})


def block_start(index: int, block: TextBlock | ToolUseBlock) -> str:
    return event("content_block_start", {"index": index, "content_block": block.model_dump()})


def text_delta(index: int, text: str) -> str:
    return event("content_block_delta", {"index": index,
                                         "delta": {"type": "text_delta", "text": text}})


def json_delta(index: int, partial_json: str) -> str:
    return event("content_block_delta", {"index": index, "delta": {
        "type": "input_json_delta", "partial_json": partial_json}})


def block_stop(index: int) -> str:
    return event("content_block_stop", {"index": index})


def message_delta(stop_reason: str | None, stop_sequence: str | None, usage: Usage) -> str:
    """The last delta: why the message ended, and the final usage (which replaces
    message_start's: the prefix-cache hits are known only once the prompt ran)."""
    return event("message_delta", {"delta": {"stop_reason": stop_reason,
                                             "stop_sequence": stop_sequence},
                                   "usage": usage.model_dump()})


def message_stop() -> str:
    return event("message_stop", {})


# ---- errors --------------------------------------------------------------------------


def error_body(status_code: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an HTTP status."""
    kind = ERROR_TYPES.get(status_code) or ("invalid_request_error" if status_code < 500
                                            else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_event(status_code: int, message: str) -> str:
    """The `error` event that ends a stream failing after its status was sent."""
    return f"event: error\ndata: {json.dumps(error_body(status_code, message))}\n\n"
