"""The streaming pieces shared by completions, chat and tool-call responses.

Scope: `merge` (several engine streams as one, (stream index, output)),
`collect` (the streams of a non-streamed request assembled into `Choice`s and
`UsageInfo`), `sse_lines` (a streamed request's SSE lines: chunks per choice
delta, usage, an error event if it fails mid-stream, `data: [DONE]`), `sse`
(one chunk as an SSE line) and the usage / logprob helpers they share.

Not here: the OpenAI shapes of the chunks (`dpserve.server.openai.protocol`, built by
`dpserve.server.openai.serving` and `dpserve.server.openai.tool_serving`), HTTP.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from dpserve.outputs import CompletionOutput, Logprob, RequestOutput
from dpserve.server.errors import to_api_error
from dpserve.server.openai.protocol import ErrorInfo, ErrorResponse, PromptTokensDetails, UsageInfo


@dataclass
class Choice:
    """One choice being assembled from deltas."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[tuple[int, dict[int, Logprob]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # of its prompt


async def collect(streams: list[AsyncIterator[RequestOutput]], n: int
                  ) -> tuple[list[Choice], UsageInfo]:
    """A non-streamed request's choices (prompt-major, `n` per prompt) and usage."""
    choices = [Choice() for _ in range(len(streams) * n)]
    usage = UsageInfo()
    async with aclosing(merge(streams)) as merged:
        async for prompt_index, out in merged:
            if out.finished:
                usage.prompt_tokens += len(out.prompt_token_ids)
                add_cached(usage, out)
            for c in out.outputs:
                choice = choices[prompt_index * n + c.index]
                choice.text.append(c.text)
                choice.num_tokens += len(c.token_ids)
                choice.logprobs.extend(token_pairs(c))
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
                if out.prompt_logprobs is not None:
                    choice.prompt_logprobs = out.prompt_logprobs
    usage.completion_tokens = sum(c.num_tokens for c in choices)
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    return choices, usage


async def sse_lines(streams: list[AsyncIterator[RequestOutput]], n: int,
                    chunk: Callable[[int, CompletionOutput], BaseModel],
                    usage_chunk: Callable[[UsageInfo], BaseModel],
                    include_usage: bool) -> AsyncIterator[str]:
    """The SSE lines of a stream: chunks per choice delta, usage, [DONE]."""
    usage, done = UsageInfo(), set()
    try:
        async with aclosing(merge(streams)) as merged:
            async for prompt_index, out in merged:
                if out.finished:
                    usage.prompt_tokens += len(out.prompt_token_ids)
                    add_cached(usage, out)
                for c in out.outputs:
                    index = prompt_index * n + c.index
                    usage.completion_tokens += len(c.token_ids)
                    if index in done or not (c.text or c.finished or c.logprobs):
                        continue  # nothing new to show (text may be held back)
                    if c.finished:
                        done.add(index)
                    yield sse(chunk(index, c))
        if include_usage:
            usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
            yield sse(usage_chunk(usage))
    except Exception as e:  # noqa: BLE001 - the status is sent: report in the stream
        error = to_api_error(e)
        yield sse(ErrorResponse(error=ErrorInfo(
            message=error.message, type=error.type, param=error.param, code=error.code)))
    yield "data: [DONE]\n\n"


def add_cached(usage: UsageInfo, out: RequestOutput) -> None:
    details = usage.prompt_tokens_details or PromptTokensDetails()
    details.cached_tokens += out.num_cached_tokens
    usage.prompt_tokens_details = details


def token_pairs(c: CompletionOutput) -> list[tuple[int, dict[int, Logprob]]]:
    """(sampled token id, its logprobs entry) for each new token of a delta."""
    return list(zip(c.token_ids, c.logprobs)) if c.logprobs else []


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


_DONE = object()


async def merge(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
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
