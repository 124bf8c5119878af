"""Serving logic for /v1/completions and /v1/chat/completions (no HTTP here).

A parsed request becomes `SamplingParams` (OpenAI names mapped to ours) and
one `AsyncLLM.generate()` stream per prompt; the streams' DELTA outputs
become either one response or SSE chunks (`data: {...}\\n\\n`, then
`data: [DONE]\\n\\n`). Every request is validated in full before anything is
sent to the engine, so a bad request never disturbs the ones in flight and a
streamed request fails with a status code, not in the middle of a stream.

Request limits (server/limits.py) are checked on the parsed request first;
a structured-output spec is compiled for the tokenizer off the event loop under
the compile deadline (server/grammar_check.py); with `--request-timeout` each
engine stream ends with a 504 past it (aborted in the engine); `cache_salt` and,
with --prefix-cache-salt-per-key, the API key's identity salt the prefix cache.

`to_api_error()` turns any exception into the OpenAI error shape; the app's
one exception handler and the in-stream error event both use it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec
from pydantic import BaseModel, ValidationError

from dpserve.frontend.async_llm import AsyncLLM
from dpserve.frontend.errors import EngineDeadError, EngineUnavailableError, RequestError
from dpserve.outputs import CompletionOutput, Logprob, RequestOutput
from dpserve.sampling_params import SamplingParams
from dpserve.server.grammar_check import GrammarChecker
from dpserve.server.limits import (
    RequestLimits,
    check_chat,
    check_completion,
    request_salt,
    with_deadline,
)
from dpserve.server.log_options import logged_stream
from dpserve.server.protocol import (
    APIError,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    Logprobs,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    SamplingRequest,
    TopLogprob,
    UsageInfo,
)
from dpserve.server.structured import structured_from_request
from dpserve.server.tool_serving import chat_tool_stream, history_message, tool_message
from dpserve.server.tools import (
    ToolPlan,
    plan_tools,
    render_messages,
    template_supports_tools,
    tool_constraint,
)
from dpserve.structured.spec import StructuredOutputs

logger = logging.getLogger(__name__)

_PARAM_FIELDS = set(SamplingParams.__struct_fields__)


@dataclass
class _Choice:
    """One choice being assembled from deltas."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[tuple[int, dict[int, Logprob]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # of its prompt


class OpenAIServing:
    """Completions and chat completions over one AsyncLLM."""

    def __init__(self, llm: AsyncLLM, model_name: str,
                 tool_call_parser: str | None = None,
                 limits: RequestLimits | None = None) -> None:
        self.llm = llm
        self.model_name = model_name
        self.tool_call_parser = tool_call_parser  # None: tool_choice "auto" is refused
        self.limits = limits or RequestLimits.from_engine(llm.config.limits)
        self.grammar_checker = GrammarChecker(
            llm.config.model.tokenizer, llm.vocab_size,
            self.limits.structured_outputs_compile_workers,
            self.limits.structured_outputs_compile_timeout)
        self.token_text = functools.lru_cache(maxsize=65536)(
            lambda token_id: llm.decode([token_id]))
        # generation_config.json defaults for fields a request leaves unset.
        self.defaults = dict(llm.config.model.generation_defaults)

    # ---- /v1/completions -----------------------------------------------------------

    async def create_completion(self, req: CompletionRequest,
                                data_parallel_rank: int | None = None,
                                api_key_id: str | None = None,
                                ) -> BaseModel | AsyncIterator[str]:
        """`data_parallel_rank` (the X-data-parallel-rank header) pins the engine;
        `api_key_id` (the auth layer's name of the key used) salts the prefix cache
        with --prefix-cache-salt-per-key."""
        deadline = self._deadline()
        self._check_model(req.model)
        check_completion(req, self.limits)
        params = self._sampling_params(req, max_tokens=self.defaults.get("max_tokens", 16)
                                       if req.max_tokens is None else req.max_tokens,
                                       logprobs=req.logprobs,
                                       structured=await self._structured(req))
        prompt = req.prompt
        batch = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
        prompts = [(p, await self.llm.in_tokenizer_thread(self.llm.encode, p))
                   if isinstance(p, str) else (None, list(p)) for p in batch]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = self._start(request_id, prompts, params, data_parallel_rank,
                              self._salt(req, api_key_id), deadline)
        # echo: each choice starts with its prompt's text.
        echo = [(t if t is not None else self.llm.decode(ids)) if req.echo else ""
                for t, ids in prompts]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            lines = self._completion_stream(request_id, streams, params, include_usage)
            return self._echo_first(request_id, echo, params.n, lines) if req.echo else lines
        choices, usage = await self._collect(streams, params.n)
        return CompletionResponse(id=request_id, model=self.model_name, usage=usage, choices=[
            CompletionChoice(index=i, text=echo[i // params.n] + "".join(c.text),
                             finish_reason=c.finish_reason,
                             stop_reason=c.stop_reason,
                             logprobs=self._completion_logprobs(c.logprobs, params.logprobs),
                             prompt_logprobs=self._prompt_logprobs(c.prompt_logprobs))
            for i, c in enumerate(choices)])

    async def _echo_first(self, request_id: str, echo: list[str], n: int,
                          lines: AsyncIterator[str]) -> AsyncIterator[str]:
        for i in range(len(echo) * n):
            yield _sse(CompletionResponse(id=request_id, model=self.model_name, choices=[
                CompletionChoice(index=i, text=echo[i // n])]))
        async with aclosing(lines):  # type: ignore[type-var]
            async for line in lines:
                yield line

    async def _completion_stream(self, request_id: str, streams: list[AsyncIterator[Any]],
                                 params: SamplingParams, include_usage: bool,
                                 ) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token

        def chunk(index: int, c: CompletionOutput) -> BaseModel:
            logprobs = self._completion_logprobs(_pairs(c), params.logprobs, offsets.get(index, 0))
            if logprobs is not None and logprobs.tokens:
                offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            return CompletionResponse(id=request_id, model=self.model_name, choices=[
                CompletionChoice(index=index, text=c.text, logprobs=logprobs,
                                 finish_reason=c.finish_reason, stop_reason=c.stop_reason)])

        def usage_chunk(usage: UsageInfo) -> BaseModel:
            return CompletionResponse(id=request_id, model=self.model_name, choices=[],
                                      usage=usage)

        async with aclosing(self._sse(streams, params.n, chunk, usage_chunk,
                                      include_usage)) as lines:
            async for line in lines:
                yield line

    # ---- /v1/chat/completions ------------------------------------------------------

    async def create_chat_completion(self, req: ChatCompletionRequest,
                                     data_parallel_rank: int | None = None,
                                     api_key_id: str | None = None,
                                     ) -> BaseModel | AsyncIterator[str]:
        deadline = self._deadline()
        self._check_model(req.model)
        check_chat(req, self.limits)
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)
        if max_tokens is None:
            max_tokens = self.defaults.get("max_tokens")
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._sampling_params(
            req, max_tokens=max_tokens, logprobs=num_logprobs,
            renames={"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"
                     if req.max_completion_tokens is not None else "max_tokens"},
            structured=await self._structured(req))
        plan = plan_tools(req, self.tool_call_parser)
        constraint = tool_constraint(plan) if plan is not None else None
        if constraint is not None:
            if params.structured_outputs is not None:
                raise RequestError(f"tool_choice {req.tool_choice!r} cannot be combined with "
                                   f"response_format or structured_outputs",
                                   param="tool_choice")
            await self.grammar_checker.check(constraint, "tools")
            params = msgspec.structs.replace(params, structured_outputs=constraint)
        prompt_ids = await self.llm.in_tokenizer_thread(self._render_chat, req, plan)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            streams = self._start(request_id, [(None, prompt_ids)], params,
                                  data_parallel_rank, self._salt(req, api_key_id), deadline)
        except RequestError as e:
            raise RequestError(str(e), "messages" if e.param == "prompt" else e.param,
                               e.code) from None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            if plan is not None and plan.mode != "none":
                return chat_tool_stream(self, request_id, streams, params, include_usage, plan)
            return self._chat_stream(request_id, streams, params, include_usage)
        choices, usage = await self._collect(streams, params.n)
        out = []
        for i, c in enumerate(choices):
            message, finish = tool_message("".join(c.text), c.finish_reason, plan)
            out.append(ChatChoice(index=i, message=message, finish_reason=finish,
                                  stop_reason=c.stop_reason,
                                  logprobs=self._chat_logprobs(c.logprobs, params.logprobs)))
        return ChatCompletionResponse(id=request_id, model=self.model_name, usage=usage,
                                      choices=out, prompt_logprobs=self._prompt_logprobs(
                                          choices[0].prompt_logprobs))

    def _render_chat(self, req: ChatCompletionRequest, plan: ToolPlan | None = None,
                     ) -> list[int]:
        native = template_supports_tools(self.llm.chat_template)
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content if isinstance(m.content, str) else ""
            if isinstance(m.content, list):
                if any(p.type != "text" or p.text is None for p in m.content):
                    raise RequestError(f"messages[{i}]: only text content parts are "
                                       f"supported", param="messages")
                content = "".join(p.text or "" for p in m.content)
            role = "system" if m.role == "developer" else m.role
            messages.append(history_message(role, content, m, native))
        tools = plan.tools if plan is not None else None
        messages = render_messages(messages, tools, native)
        try:
            return self.llm.apply_chat_template(
                messages, req.add_generation_prompt,
                tools=[{"type": "function", "function": t} for t in tools]
                if tools and native else None)
        except Exception as e:  # noqa: BLE001 - templates raise what they like on bad input
            raise RequestError(f"cannot apply the chat template: {e}",
                               param="messages") from None

    async def _chat_stream(self, request_id: str, streams: list[AsyncIterator[Any]],
                           params: SamplingParams, include_usage: bool) -> AsyncIterator[str]:
        def chunk(index: int, c: CompletionOutput) -> BaseModel:
            return ChatCompletionChunk(id=request_id, model=self.model_name, choices=[
                ChatStreamChoice(index=index, delta=DeltaMessage(content=c.text),
                                 finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                 logprobs=self._chat_logprobs(_pairs(c), params.logprobs))])

        def usage_chunk(usage: UsageInfo) -> BaseModel:
            return ChatCompletionChunk(id=request_id, model=self.model_name, choices=[],
                                       usage=usage)

        for i in range(len(streams) * params.n):  # OpenAI sends the role first
            yield _sse(ChatCompletionChunk(id=request_id, model=self.model_name, choices=[
                ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]))
        async with aclosing(self._sse(streams, params.n, chunk, usage_chunk,
                                      include_usage)) as lines:
            async for line in lines:
                yield line

    # ---- shared --------------------------------------------------------------------

    model_aliases: tuple[str, ...] = ()  # more names clients may use (--served-model-name)
    log_requests = False  # --enable-log-requests: a line per arrival and finish

    def check_model(self, model: str | None) -> None:
        self._check_model(model)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model not in self.model_aliases:
            raise APIError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")

    def _deadline(self) -> float | None:
        """When a request arriving now must be done by (--request-timeout), loop time."""
        timeout = self.limits.request_timeout
        return None if timeout is None else asyncio.get_running_loop().time() + timeout

    def _salt(self, req: SamplingRequest, api_key_id: str | None) -> str | None:
        return request_salt(req.cache_salt, api_key_id, self.limits.prefix_cache_salt_per_key)

    async def _structured(self, req: SamplingRequest) -> StructuredOutputs | None:
        """The request's constraint, compiled in time (grammar_check) or a 400."""
        found = structured_from_request(req)
        if found is None:
            return None
        field, spec = found
        await self.grammar_checker.check(spec, field)
        return spec

    def _sampling_params(self, req: SamplingRequest, max_tokens: int | None,
                         logprobs: int | None, renames: dict[str, str] | None = None,
                         structured: StructuredOutputs | None = None) -> SamplingParams:
        """OpenAI names -> SamplingParams; its ValueErrors name the request field."""
        given = {k: getattr(req, k) for k in (
            "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty") if getattr(req, k) is not None}
        given = {**{k: v for k, v in self.defaults.items() if k != "max_tokens"}, **given}
        try:
            return SamplingParams(
                n=req.n, max_tokens=max_tokens, seed=req.seed, stop=list(req.stop or []),
                stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens, logprobs=logprobs,
                prompt_logprobs=req.prompt_logprobs,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                structured_outputs=structured,
                logit_bias=self._logit_bias(req), **given)
        except RequestError:
            raise
        except ValueError as e:
            name, _, rest = str(e).partition(" ")
            if name not in _PARAM_FIELDS:
                raise RequestError(str(e)) from None
            param = (renames or {}).get(name, name)  # the name the client used
            raise RequestError(f"{param} {rest}", param=param) from None

    def _logit_bias(self, req: SamplingRequest) -> dict[int, float] | None:
        if not req.logit_bias:
            return None
        if not all(k.isdigit() for k in req.logit_bias):  # its size is checked already
            raise RequestError("logit_bias keys must be token ids", param="logit_bias")
        bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        bad = next((t for t in bias if t >= self.llm.vocab_size), None)
        if bad is not None:
            raise RequestError(f"logit_bias token id {bad} is outside the vocabulary "
                               f"[0, {self.llm.vocab_size})", param="logit_bias")
        return bias

    def _start(self, request_id: str, prompts: Sequence[tuple[str | None, list[int]]],
               params: SamplingParams, data_parallel_rank: int | None = None,
               cache_salt: str | None = None, deadline: float | None = None,
               ) -> list[AsyncIterator[RequestOutput]]:
        """Validate every prompt, then open one generate() stream per prompt (each ends
        with a 504 past `deadline`, loop time)."""
        for _, ids in prompts:
            self.llm.validate(ids, params, data_parallel_rank)
        admit = getattr(self.llm, "admission", None)  # paused / asleep / queues full
        if admit is not None:
            admit([len(ids) for _, ids in prompts] * params.n)
        streams = [self.llm.generate(ids, params, f"{request_id}-{i}", text,
                                     data_parallel_rank, cache_salt=cache_salt)
                   for i, (text, ids) in enumerate(prompts)]
        if self.log_requests:
            streams = [logged_stream(s, f"{request_id}-{i}", len(ids), params)
                       for i, (s, (_, ids)) in enumerate(zip(streams, prompts))]
        if deadline is not None:
            timeout = self.limits.request_timeout or 0.0
            streams = [with_deadline(s, deadline, timeout) for s in streams]
        return streams

    async def _collect(self, streams: list[AsyncIterator[RequestOutput]],
                       n: int) -> tuple[list[_Choice], UsageInfo]:
        choices = [_Choice() for _ in range(len(streams) * n)]
        usage = UsageInfo()
        async with aclosing(_merge(streams)) as merged:
            async for prompt_index, out in merged:
                if out.finished:
                    usage.prompt_tokens += len(out.prompt_token_ids)
                    _add_cached(usage, out)
                for c in out.outputs:
                    choice = choices[prompt_index * n + c.index]
                    choice.text.append(c.text)
                    choice.num_tokens += len(c.token_ids)
                    choice.logprobs.extend(_pairs(c))
                    choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
                    if out.prompt_logprobs is not None:
                        choice.prompt_logprobs = out.prompt_logprobs
        usage.completion_tokens = sum(c.num_tokens for c in choices)
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return choices, usage

    async def _sse(self, streams: list[AsyncIterator[RequestOutput]], n: int,
                   chunk: Callable[[int, CompletionOutput], BaseModel],
                   usage_chunk: Callable[[UsageInfo], BaseModel],
                   include_usage: bool) -> AsyncIterator[str]:
        """The SSE lines of a stream: chunks per choice delta, usage, [DONE]."""
        usage, done = UsageInfo(), set()
        try:
            async with aclosing(_merge(streams)) as merged:
                async for prompt_index, out in merged:
                    if out.finished:
                        usage.prompt_tokens += len(out.prompt_token_ids)
                        _add_cached(usage, out)
                    for c in out.outputs:
                        index = prompt_index * n + c.index
                        usage.completion_tokens += len(c.token_ids)
                        if index in done or not (c.text or c.finished or c.logprobs):
                            continue  # nothing new to show (text may be held back)
                        if c.finished:
                            done.add(index)
                        yield _sse(chunk(index, c))
            if include_usage:
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                yield _sse(usage_chunk(usage))
        except Exception as e:  # noqa: BLE001 - the status is sent: report in the stream
            error = to_api_error(e)
            yield _sse(ErrorResponse(error=ErrorInfo(
                message=error.message, type=error.type, param=error.param, code=error.code)))
        yield "data: [DONE]\n\n"

    def _completion_logprobs(self, pairs: list[tuple[int, dict[int, Logprob]]],
                             num: int | None, offset: int = 0) -> Logprobs | None:
        if num is None:
            return None
        out = Logprobs(top_logprobs=[])
        pos = offset
        for token_id, entry in pairs:
            text = self.token_text(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(entry[token_id].logprob if token_id in entry else None)
            assert out.top_logprobs is not None
            top: dict[str, float] = {}
            for t, lp in sorted(entry.items(), key=lambda x: (x[0] != token_id, x[1].rank)):
                if lp.rank <= num or t == token_id:  # the sampled token, then the best N
                    top.setdefault(self.token_text(t), lp.logprob)  # texts may collide
            out.top_logprobs.append(top)
            out.text_offset.append(pos)
            pos += len(text)
        return out

    def _prompt_logprobs(self, entries: list[dict[int, Logprob] | None] | None,
                         ) -> PromptLogprobs | None:
        """RequestOutput.prompt_logprobs -> vLLM's JSON shape (decoded token texts)."""
        if entries is None:
            return None
        return [None if e is None else {
            t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=self.token_text(t))
            for t, lp in e.items()} for e in entries]

    def _chat_logprobs(self, pairs: list[tuple[int, dict[int, Logprob]]],
                       num: int | None) -> ChatLogprobs | None:
        if num is None:
            return None

        def top(token_id: int, lp: Logprob) -> TopLogprob:
            text = self.token_text(token_id)
            return TopLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()))

        content = []
        for token_id, entry in pairs:
            sampled = entry.get(token_id) or Logprob(float("nan"), 0)
            best = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= num),
                          key=lambda x: x[1].rank)
            content.append(ChatTokenLogprob(**top(token_id, sampled).model_dump(),
                                            top_logprobs=[top(t, lp) for t, lp in best]))
        return ChatLogprobs(content=content)


def _add_cached(usage: UsageInfo, out: RequestOutput) -> None:
    details = usage.prompt_tokens_details or PromptTokensDetails()
    details.cached_tokens += out.num_cached_tokens
    usage.prompt_tokens_details = details


def _pairs(c: CompletionOutput) -> list[tuple[int, dict[int, Logprob]]]:
    """(sampled token id, its logprobs entry) for each new token of a delta."""
    return list(zip(c.token_ids, c.logprobs)) if c.logprobs else []


def _sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


_DONE = object()


async def _merge(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several streams as (stream index, item); closes them all on exit."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:  # type: ignore[type-var]
            async for item in stream:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async with aclosing(stream):  # type: ignore[type-var]
                async for item in stream:
                    queue.put_nowait((index, item))
            queue.put_nowait((index, _DONE))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # each stream's own cleanup aborts its request


def to_api_error(exc: BaseException) -> APIError:
    """Any exception -> the OpenAI error it is answered with."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        named = not loc or err["msg"].startswith(str(err["loc"][0]))
        message = err["msg"] if named else f"{loc}: {err['msg']}"
        return APIError(400, message, param=str(err["loc"][0]) if err["loc"] else None)
    if isinstance(exc, RequestError):
        return APIError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, ValueError):
        name = str(exc).split(" ", 1)[0]
        return APIError(400, str(exc), param=name if name in _PARAM_FIELDS else None)
    if isinstance(exc, EngineUnavailableError):  # no rank serves it now; the server lives
        return APIError(503, str(exc), type="server_error", code="engine_unavailable")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error", code="engine_dead")
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and 400 <= status < 600:  # Starlette HTTPException
        detail = getattr(exc, "detail", None) or str(exc)
        return APIError(status, str(detail), type="invalid_request_error" if status < 500
                        else "server_error")
    logger.error("internal error", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}", type="server_error")
