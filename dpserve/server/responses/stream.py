"""A streamed response: the chat stream's chunks -> the Responses API's typed events.

The request runs as a streamed chat completion (`dpserve.server.openai.serving`, tools by
`dpserve.server.openai.tool_serving`); `ResponseEvents` reads its SSE chunks and writes the
events the `openai` client's `responses.stream()` accumulates, each
`event: <type>\\ndata: {..., "sequence_number": k}`:

    response.created, response.in_progress
    per text item:  response.output_item.added, response.content_part.added,
                    response.output_text.delta..., response.output_text.done,
                    response.content_part.done, response.output_item.done
    per tool call:  response.output_item.added, response.function_call_arguments.delta...,
                    response.function_call_arguments.done, response.output_item.done
    last:           response.completed | response.incomplete (max_output_tokens,
                    cancelled) | response.failed (an error mid-stream)

`on_final(response)` runs before the last event is sent (the store's write), so a
client that retrieves the id after the stream ends finds it.

Not here: the chunks themselves (chat), the response object (`responses.protocol`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from dpserve.server.openai.protocol import UsageInfo
from dpserve.server.responses.protocol import (
    call_item,
    message_item,
    status_of,
    usage,
    with_output,
)

Final = Callable[[dict[str, Any]], Awaitable[None]]


class ResponseEvents:
    """One streamed response's events (module docstring). `skeleton`: the response
    object at its start (status in_progress, no output)."""

    def __init__(self, skeleton: dict[str, Any], on_final: Final,
                 cancelled: asyncio.Event | None = None) -> None:
        self.response = skeleton
        self.on_final = on_final
        self.cancelled = cancelled or asyncio.Event()
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.calls: dict[int, int] = {}  # chat tool-call index -> output index
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.finished = False  # the final response was handed to `on_final`

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    async def run(self, lines: AsyncIterator[str]) -> AsyncIterator[str]:
        """The events of the chat stream `lines` (closed on exit)."""
        yield self.event("response.created", response=self.response)
        yield self.event("response.in_progress", response=self.response)
        async with aclosing(lines):  # type: ignore[type-var]
            async for line in lines:
                if self.cancelled.is_set():
                    break  # closing `lines` aborts the request in the engine
                if not line.startswith("data: ") or line.startswith("data: [DONE]"):
                    continue
                for event in self._chunk(json.loads(line[len("data: "):])):
                    yield event
        for event in self._close():
            yield event
        async for event in self._final():
            yield event

    def _chunk(self, chunk: dict[str, Any]) -> list[str]:
        if "error" in chunk:
            self.error = chunk["error"]
            return []
        if chunk.get("usage"):
            self.usage = usage_from_chunk(chunk["usage"])
        events: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return events

    def _text(self, text: str) -> list[str]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self._close()
            item = message_item("", status="in_progress")
            item["content"] = []
            events += self._add(item)
            part = {"type": "output_text", "text": "", "annotations": []}
            item["content"].append(part)
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.output) - 1, content_index=0,
                                     part=part))
        item = self.open
        assert item is not None
        item["content"][0]["text"] += text
        events.append(self.event("response.output_text.delta", item_id=item["id"],
                                 output_index=len(self.output) - 1, content_index=0,
                                 delta=text, logprobs=[]))
        return events

    def _call(self, call: dict[str, Any]) -> list[str]:
        events = []
        index = call.get("index", 0)
        fn = call.get("function") or {}
        if index not in self.calls:
            events += self._close()
            events += self._add(call_item(call.get("id") or "", fn.get("name") or "", "",
                                          status="in_progress"))
            self.calls[index] = len(self.output) - 1
        item = self.output[self.calls[index]]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            events.append(self.event("response.function_call_arguments.delta",
                                     item_id=item["id"], output_index=self.calls[index],
                                     delta=fn["arguments"]))
        return events

    def _add(self, item: dict[str, Any]) -> list[str]:
        self.output.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=len(self.output) - 1,
                           item=item)]

    def _close(self) -> list[str]:
        """The done events of the item being streamed, if any."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            events = [self.event("response.output_text.done", item_id=item["id"],
                                 output_index=index, content_index=0, text=part["text"],
                                 logprobs=[]),
                      self.event("response.content_part.done", item_id=item["id"],
                                 output_index=index, content_index=0, part=part)]
        else:
            events = [self.event("response.function_call_arguments.done", item_id=item["id"],
                                 output_index=index, name=item["name"],
                                 arguments=item["arguments"])]
        return [*events, self.event("response.output_item.done", output_index=index,
                                    item=item)]

    async def _final(self) -> AsyncIterator[str]:
        if not self.output and self.error is None:  # an empty answer is an empty message
            for event in [*self._add(message_item("", status="in_progress")), *self._close()]:
                yield event
        status, details = status_of(self.finish)
        if self.cancelled.is_set():
            status, details = "cancelled", None
        response = with_output(self.response, self.output, "failed" if self.error else status,
                               incomplete_details=details, usage=self.usage, error=self.error)
        await self.on_final(response)
        self.finished = True
        kind = {"completed": "response.completed", "failed": "response.failed"}.get(
            response["status"], "response.incomplete")
        yield self.event(kind, response=response)


def usage_from_chunk(u: dict[str, Any]) -> dict[str, Any] | None:
    return usage(UsageInfo.model_validate(u))
