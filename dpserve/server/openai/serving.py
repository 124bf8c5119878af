"""Serving logic for /v1/completions and /v1/chat/completions (no HTTP here).

A parsed request becomes `SamplingParams` (OpenAI names mapped to ours) and
one `AsyncLLM.generate()` stream per prompt; the streams' DELTA outputs
become either one response or SSE chunks (`data: {...}\\n\\n`, then
`data: [DONE]\\n\\n`). Every request is validated in full before anything is
sent to the engine, so a bad request never disturbs the ones in flight and a
streamed request fails with a status code, not in the middle of a stream.

Request limits (server/limits.py) are checked on the parsed request first;
a structured-output spec is compiled for the tokenizer off the event loop under
the compile deadline (server/openai/grammar_check.py); with `--request-timeout` each
engine stream ends with a 504 past it (aborted in the engine); `cache_salt` and,
with --prefix-cache-salt-per-key, the API key's identity salt the prefix cache; a
session (the X-Session-ID header, else `user`: `dpserve.server.sessions`) keeps a
conversation's turns on one rank. With --tenant-limits, a request is admitted
against its tenant's limits once checked, before anything reaches an engine
(`metered`: a 429 over one; `dpserve.server.tenants`).

`start_chat` is the chat path up to the engine (checks, sampling parameters,
tools, the rendered prompt, the streams): /v1/chat/completions formats its
`ChatRun` here, other APIs translated to a chat request (Anthropic's Messages,
server/anthropic/serving.py) format it their own way.

Not here: the streaming pieces shared with tool calls (`dpserve.server.openai.streams`),
the logprob objects (`dpserve.server.openai.logprobs`, a part `OpenAIServing` holds),
the error mapping (`dpserve.server.errors.to_api_error`), HTTP (the routers).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import BaseModel

from dpserve.frontend.async_llm import AsyncLLM
from dpserve.frontend.errors import RequestError
from dpserve.outputs import CompletionOutput, RequestOutput
from dpserve.protocol import RequestTags
from dpserve.sampling_params import SamplingParams
from dpserve.server.caller import ANONYMOUS, Caller, caller_tags
from dpserve.server.errors import APIError
from dpserve.server.limits import (
    RequestLimits,
    check_chat,
    check_completion,
    request_salt,
    with_deadline,
)
from dpserve.server.log_options import logged_stream
from dpserve.server.openai.grammar_check import GrammarChecker
from dpserve.server.openai.logprobs import LogprobRenderer
from dpserve.server.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    SamplingRequest,
    UsageInfo,
)
from dpserve.server.openai.streams import collect, sse, sse_lines, token_pairs
from dpserve.server.openai.structured import structured_from_request
from dpserve.server.openai.tool_serving import chat_tool_stream, history_message, tool_message
from dpserve.server.openai.tools import (
    ToolPlan,
    choose_tool_parser,
    plan_tools,
    render_messages,
    template_supports_tools,
    tool_constraint,
)
from dpserve.server.sessions import user_session
from dpserve.server.tenants import TenantGate
from dpserve.structured.spec import StructuredOutputs
from dpserve.tenancy.limits import DEFAULT
from dpserve.tracing import child_span

logger = logging.getLogger(__name__)

_PARAM_FIELDS = set(SamplingParams.__struct_fields__)


@dataclass
class ChatRun:
    """A chat request under way in the engine (`OpenAIServing.start_chat`)."""

    request_id: str
    model: str  # the name its responses carry: the LoRA adapter's or the base model's
    streams: list[AsyncIterator[RequestOutput]]  # one: a chat has one prompt
    params: SamplingParams
    plan: ToolPlan | None  # its tools (None: no tools)
    num_prompt_tokens: int


class OpenAIServing:
    """Completions and chat completions over one AsyncLLM."""

    def __init__(self, llm: AsyncLLM, model_name: str,
                 tool_call_parser: str | None = None,
                 limits: RequestLimits | None = None, *,
                 admission: Callable[[list[int]], None] | None = None,
                 model_aliases: Sequence[str] = (), log_requests: bool = False,
                 tenants: TenantGate | None = None) -> None:
        """`tool_call_parser`: --tool-call-parser (None: from the chat template,
        `dpserve.server.openai.tools.detect_tool_parser`). `admission`: called with a
        request's prompt lengths before it is sent; raises to refuse it
        (`dpserve.server.admission`). `tenants`: the tenants' limits
        (--tenant-limits; `dpserve.server.tenants`). `model_aliases`: more
        names clients may use (--served-model-name). `log_requests`: a line per
        arrival and finish (--enable-log-requests)."""
        self.llm = llm
        self.model_name = model_name
        self.model_aliases = tuple(model_aliases)
        self.log_requests = log_requests
        self.admission = admission
        self.tenants = tenants
        # tool_choice "auto": --tool-call-parser, else the chat template's format.
        self.tool_call_parser = choose_tool_parser(tool_call_parser, llm.chat_template)
        self.limits = limits or RequestLimits.from_engine(llm.config.limits)
        self.grammar_checker = GrammarChecker(
            llm.config.model.tokenizer, llm.vocab_size,
            self.limits.structured_outputs_compile_workers,
            self.limits.structured_outputs_compile_timeout)
        self.logprobs = LogprobRenderer(llm.decode)  # each token's text decoded once
        # generation_config.json defaults for fields a request leaves unset.
        self.defaults = dict(llm.config.model.generation_defaults)

    # ---- /v1/completions -----------------------------------------------------------

    async def create_completion(self, req: CompletionRequest, caller: Caller = ANONYMOUS,
                                ) -> BaseModel | AsyncIterator[str]:
        """`caller` (`dpserve.server.caller`): its pinned engine, its key's id (salts
        the prefix cache with --prefix-cache-salt-per-key), its session (else
        `user`'s: `dpserve.server.sessions`, placed with the session's turns), its
        tenant and trace context (carried to the engines with `req.priority`)."""
        deadline = self._deadline()
        lora_name = self._check_model(req.model)
        model = lora_name or self.model_name  # what the response says (vLLM's)
        check_completion(req, self.limits)
        params = self._sampling_params(req, max_tokens=self.defaults.get("max_tokens", 16)
                                       if req.max_tokens is None else req.max_tokens,
                                       logprobs=req.logprobs,
                                       structured=await self._structured(req))
        prompt = req.prompt
        batch = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
        with child_span("tokenize", caller.trace_headers):
            prompts = [(p, await self.llm.in_tokenizer_thread(self.llm.encode, p))
                       if isinstance(p, str) else (None, list(p)) for p in batch]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = self._start(request_id, prompts, params, req, caller, deadline, lora_name)
        streams = await self.metered(request_id, caller, streams, *self._cost(prompts, params))
        # echo: each choice starts with its prompt's text.
        echo = [(t if t is not None else self.llm.decode(ids)) if req.echo else ""
                for t, ids in prompts]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            lines = self._completion_stream(request_id, streams, params, include_usage, model)
            return self._echo_first(request_id, echo, params.n, lines, model) if req.echo \
                else lines
        choices, usage = await collect(streams, params.n)
        return CompletionResponse(id=request_id, model=model, usage=usage, choices=[
            CompletionChoice(index=i, text=echo[i // params.n] + "".join(c.text),
                             finish_reason=c.finish_reason,
                             stop_reason=c.stop_reason,
                             logprobs=self.logprobs.completion(c.logprobs, params.logprobs),
                             prompt_logprobs=self.logprobs.prompt(c.prompt_logprobs))
            for i, c in enumerate(choices)])

    async def _echo_first(self, request_id: str, echo: list[str], n: int,
                          lines: AsyncIterator[str], model: str) -> AsyncIterator[str]:
        for i in range(len(echo) * n):
            yield sse(CompletionResponse(id=request_id, model=model, choices=[
                CompletionChoice(index=i, text=echo[i // n])]))
        async with aclosing(lines):  # type: ignore[type-var]
            async for line in lines:
                yield line

    async def _completion_stream(self, request_id: str, streams: list[AsyncIterator[Any]],
                                 params: SamplingParams, include_usage: bool, model: str,
                                 ) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token

        def chunk(index: int, c: CompletionOutput) -> BaseModel:
            logprobs = self.logprobs.completion(token_pairs(c), params.logprobs,
                                                offsets.get(index, 0))
            if logprobs is not None and logprobs.tokens:
                offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            return CompletionResponse(id=request_id, model=model, choices=[
                CompletionChoice(index=index, text=c.text, logprobs=logprobs,
                                 finish_reason=c.finish_reason, stop_reason=c.stop_reason)])

        def usage_chunk(usage: UsageInfo) -> BaseModel:
            return CompletionResponse(id=request_id, model=model, choices=[], usage=usage)

        async with aclosing(sse_lines(streams, params.n, chunk, usage_chunk,
                                      include_usage)) as lines:
            async for line in lines:
                yield line

    # ---- /v1/chat/completions ------------------------------------------------------

    async def create_chat_completion(self, req: ChatCompletionRequest,
                                     caller: Caller = ANONYMOUS,
                                     ) -> BaseModel | AsyncIterator[str]:
        run = await self.start_chat(req, caller)
        request_id, streams, params, plan, model = (run.request_id, run.streams, run.params,
                                                    run.plan, run.model)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            if plan is not None and plan.mode != "none":
                return chat_tool_stream(request_id, streams, params, include_usage, plan,
                                        model)
            return self._chat_stream(request_id, streams, params, include_usage, model)
        choices, usage = await collect(streams, params.n)
        out = []
        for i, c in enumerate(choices):
            message, finish = tool_message("".join(c.text), c.finish_reason, plan)
            out.append(ChatChoice(index=i, message=message, finish_reason=finish,
                                  stop_reason=c.stop_reason,
                                  logprobs=self.logprobs.chat(c.logprobs, params.logprobs)))
        return ChatCompletionResponse(id=request_id, model=model, usage=usage,
                                      choices=out, prompt_logprobs=self.logprobs.prompt(
                                          choices[0].prompt_logprobs))

    async def start_chat(self, req: ChatCompletionRequest, caller: Caller = ANONYMOUS,
                         id_prefix: str = "chatcmpl-") -> ChatRun:
        """Check `req` in full, render its prompt and send it to the engine: the run that
        a response (this module's, or another API's built from a chat request) is made
        from. Nothing reaches the engine when a check fails. `caller`: as in
        `create_completion`."""
        deadline = self._deadline()
        lora_name = self._check_model(req.model)
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
        with child_span("chat_template", caller.trace_headers):  # rendered and tokenised
            prompt_ids = await self.llm.in_tokenizer_thread(self._render_chat, req, plan)
        request_id = f"{id_prefix}{uuid.uuid4().hex}"
        try:
            streams = self._start(request_id, [(None, prompt_ids)], params, req, caller,
                                  deadline, lora_name)
        except RequestError as e:
            raise RequestError(str(e), "messages" if e.param == "prompt" else e.param,
                               e.code) from None
        streams = await self.metered(request_id, caller, streams,
                                     *self._cost([(None, prompt_ids)], params))
        return ChatRun(request_id, lora_name or self.model_name, streams, params, plan,
                       len(prompt_ids))

    async def chat_prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        """The prompt `req` renders to (the chat template, with its tools), checked as
        `start_chat` checks it, without running it (token counting)."""
        self._check_model(req.model)
        check_chat(req, self.limits)
        plan = plan_tools(req, self.tool_call_parser)
        return await self.llm.in_tokenizer_thread(self._render_chat, req, plan)

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
                           params: SamplingParams, include_usage: bool, model: str,
                           ) -> AsyncIterator[str]:
        def chunk(index: int, c: CompletionOutput) -> BaseModel:
            return ChatCompletionChunk(id=request_id, model=model, choices=[
                ChatStreamChoice(index=index, delta=DeltaMessage(content=c.text),
                                 finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                 logprobs=self.logprobs.chat(token_pairs(c), params.logprobs))])

        def usage_chunk(usage: UsageInfo) -> BaseModel:
            return ChatCompletionChunk(id=request_id, model=model, choices=[], usage=usage)

        for i in range(len(streams) * params.n):  # OpenAI sends the role first
            yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[
                ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]))
        async with aclosing(sse_lines(streams, params.n, chunk, usage_chunk,
                                      include_usage)) as lines:
            async for line in lines:
                yield line

    # ---- shared --------------------------------------------------------------------

    def tags(self, caller: Caller, priority: int) -> RequestTags:
        """The tags of the caller's request; a non-zero `priority` is a 400 under
        --scheduling-policy fcfs (vLLM's behaviour), before anything reaches an engine."""
        policy = self.llm.config.scheduler.policy
        if priority != 0 and policy != "priority":
            raise RequestError(f"priority {priority} needs --scheduling-policy priority "
                               f"(this server runs --scheduling-policy {policy})",
                               param="priority")
        return caller_tags(caller, priority)

    def check_model(self, model: str | None) -> str | None:
        return self._check_model(model)

    def _check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names (None: the base model, by any of its names, or
        no name); 404 for a name that is neither."""
        if model is None or model == self.model_name or model in self.model_aliases:
            return None
        if model in (self.llm.cluster.loras or ()):
            return model
        raise APIError(404, f"The model `{model}` does not exist.", param="model",
                       code="model_not_found")

    def _deadline(self) -> float | None:
        """When a request arriving now must be done by (--request-timeout), loop time."""
        timeout = self.limits.request_timeout
        return None if timeout is None else asyncio.get_running_loop().time() + timeout

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
               params: SamplingParams, req: SamplingRequest, caller: Caller,
               deadline: float | None, lora_name: str | None,
               ) -> list[AsyncIterator[RequestOutput]]:
        """Validate every prompt, then open one generate() stream per prompt (each ends
        with a 504 past `deadline`, loop time), with LoRA adapter `lora_name` (None:
        the base model); the caller's session (else `req.user`'s) places them all
        alike, its key salts their prefix cache and its tags go with them."""
        tags = self.tags(caller, req.priority)
        rank = caller.data_parallel_rank
        with child_span("admit", caller.trace_headers):
            for _, ids in prompts:
                self.llm.validate(ids, params, rank)
            if self.admission is not None:  # paused / asleep / queues full
                self.admission([len(ids) for _, ids in prompts] * params.n)
        salt = request_salt(req.cache_salt, caller.api_key_id,
                            self.limits.prefix_cache_salt_per_key)
        session = caller.session or user_session(req.user)
        streams = [self.llm.generate(ids, params, f"{request_id}-{i}", text, rank,
                                     cache_salt=salt, lora_name=lora_name, session=session,
                                     tags=tags)
                   for i, (text, ids) in enumerate(prompts)]
        if self.log_requests:
            streams = [logged_stream(s, f"{request_id}-{i}", len(ids), params)
                       for i, (s, (_, ids)) in enumerate(zip(streams, prompts))]
        if deadline is not None:
            timeout = self.limits.request_timeout or 0.0
            streams = [with_deadline(s, deadline, timeout) for s in streams]
        return streams

    async def metered(self, request_id: str, caller: Caller,
                      streams: list[AsyncIterator[RequestOutput]], prompt_tokens: int,
                      max_tokens: int) -> list[AsyncIterator[RequestOutput]]:
        """Admit a request whose engine streams are `streams` (not yet iterated: nothing
        was sent) against its tenant's --tenant-limits (a 429 over one), and meter
        them for the ledger; `streams` as they are without limits."""
        if self.tenants is None:
            return streams
        ticket = await self.tenants.admit(caller.tenant or DEFAULT, request_id,
                                          prompt_tokens, max_tokens)
        return streams if ticket is None else [ticket.meter(s) for s in streams]

    def _cost(self, prompts: Sequence[tuple[str | None, list[int]]],
              params: SamplingParams) -> tuple[int, int]:
        """(prompt tokens, most tokens generated) of a request, over its n completions."""
        room = sum(params.max_tokens or max(0, self.llm.max_model_len - len(ids))
                   for _, ids in prompts)
        return sum(len(ids) for _, ids in prompts) * params.n, room * params.n
