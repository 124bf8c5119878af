"""The OpenAI-compatible HTTP schemas: requests, responses, stream chunks, errors.

Requests are parsed with `Model.model_validate_json(body, strict=True)`:
wrong JSON types fail here with the field named. Value ranges that
`SamplingParams` already checks (temperature, top_p, ...) are left to it;
this module checks only what it alone knows (n, fields we do not support).
The sizes that are options (stop strings, stop_token_ids, logit_bias, tools,
messages, ...) are checked by server/limits.py once parsing is done.
Unknown fields are ignored, as OpenAI clients send many;
fields that would change the result and that dpserve does not implement
(suffix, best_of > n, echo with logprobs) are
rejected with a message naming them.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

MAX_N = 16
MAX_PROMPTS = 64  # prompts in one /v1/completions batch
MAX_ABS_PRIORITY = 2**31 - 1  # `priority` is a signed 32-bit integer


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _unsupported(name: str, why: str = "") -> PydanticCustomError:
    return PydanticCustomError("unsupported", f"{name} is not supported by this server{why}")


# ---- errors -------------------------------------------------------------------


class ErrorInfo(_Model):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Model):
    error: ErrorInfo


# ---- shared request fields ----------------------------------------------------------


class StreamOptions(_Model):
    include_usage: bool = False


class SamplingRequest(_Model):
    """Fields /v1/completions and /v1/chat/completions share (OpenAI + extensions)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions (vLLM names), sent by OpenAI clients through `extra_body`.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # top-k at every prompt position (not streamed)
    # Structured output (vLLM names; server/openai/structured.py reads them).
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Prefix-cache isolation (vLLM's field): requests share cached prompt blocks only
    # when their salts are equal (none = the unsalted cache).
    cache_salt: str | None = None
    # Scheduling priority (vLLM's field): lower runs first, in every engine's queue.
    priority: int = Field(0, ge=-MAX_ABS_PRIORITY, le=MAX_ABS_PRIORITY)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> list[str]:
        return [v] if isinstance(v, str) else list(v or [])  # sizes: server/limits.py

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, v: str | None) -> str | None:
        if v == "":
            raise PydanticCustomError("cache_salt", "cache_salt must be a non-empty string")
        return v

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and info.data.get("stream"):
            raise PydanticCustomError("prompt_logprobs",
                                      "prompt_logprobs are not available when stream is true")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: StreamOptions | None,
                                    info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise PydanticCustomError("stream_options",
                                      "stream_options is only allowed when stream is true")
        return v


# ---- /v1/completions ---------------------------------------------------------------


class CompletionRequest(SamplingRequest):
    # str | list[str] | list[int] | list[list[int]]; checked below for a clear message.
    prompt: Any
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        def tokens(x: Any) -> bool:
            return isinstance(x, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x)

        ok = (isinstance(v, str) or tokens(v)
              or (isinstance(v, list) and all(isinstance(p, str) or tokens(p) for p in v)))
        if not ok:
            raise PydanticCustomError("prompt_type", "prompt must be a string, a list of "
                                      "strings, a list of token ids or a list of such lists")
        if v == "" or v == [] or (isinstance(v, list) and any(p in ("", []) for p in v)):
            raise PydanticCustomError("empty", "prompt must not be empty")
        if isinstance(v, list) and v and not isinstance(v[0], int) and len(v) > MAX_PROMPTS:
            raise PydanticCustomError("too_many", "at most {limit} prompts per request",
                                      {"limit": MAX_PROMPTS})
        return v

    @field_validator("echo")
    @classmethod
    def _echo_without_logprobs(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("logprobs") is not None:
            raise _unsupported("echo", " together with logprobs")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> None:
        if v:
            raise _unsupported("suffix")
        return None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if v is not None and v != n:
            raise _unsupported("best_of", f" (it must equal n={n} when given)")
        return v


class Logprobs(_Model):
    """Completions-style logprobs."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = []


class PromptLogprob(_Model):
    """One token at one prompt position (vLLM's shape)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# None for the first prompt token, then token id -> PromptLogprob per position.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class PromptTokensDetails(_Model):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(_Model):
    index: int
    text: str
    logprobs: Logprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Model):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---- /v1/chat/completions ----------------------------------------------------------


class ContentPart(_Model):
    type: str
    text: str | None = None


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this result answers


class ResponseFormat(_Model):
    type: str  # text | json_object | json_schema (server/openai/structured.py)
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict"}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # extension
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None  # server/openai/tools.py
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, v: list[Any] | None, info: ValidationInfo) -> None:
        if v:
            raise _unsupported("functions", "; use tools")
        return None

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, v: Any, info: ValidationInfo) -> None:
        if v is not None and v != "none":
            raise _unsupported("function_call", "; use tool_choice")
        return None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("top_logprobs", "top_logprobs requires logprobs=true")
        return v


class TopLogprob(_Model):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(_Model):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(_Model):
    name: str | None = None
    arguments: str | None = None  # JSON text


class ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] | None = "function"
    function: FunctionCall
    index: int | None = None  # stream deltas only


class ChatResponseMessage(_Model):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Model):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Model):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(_Model):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatStreamChoice(_Model):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Model):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---- /v1/models ----------------------------------------------------------------------


class ModelCard(_Model):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "dpserve"
    root: str | None = None  # the model's path (a LoRA adapter: the adapter's)
    parent: str | None = None  # a LoRA adapter: the base model's id
    max_model_len: int | None = None


class ModelList(_Model):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- LoRA adapters (admin) -------------------------------------------------------------


class LoadLoRAAdapterRequest(_Model):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(_Model):
    lora_name: str = Field(min_length=1, max_length=256)
