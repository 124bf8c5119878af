"""Serving logic for /v1/embeddings (no HTTP here): `EmbeddingServing.create_embedding`.

Each input becomes one pooling request (`EngineCoreRequest.pooling`) through the
same `AsyncLLM.generate` path as a completion: the same validation, admission
(503 while paused, 429 when queues are full), load balancing over the DP ranks,
--request-timeout, abort when the client leaves, and prefix-cache salting per API
key (--prefix-cache-salt-per-key). The engines batch the inputs of one call (and
of every other request) into their steps; nothing is sampled. The result is the
model's final hidden state (after its final norm), pooled as `--pooler-config`
says (vLLM's engine option, `ModelConfig.pooler`: `pooling_type` LAST, the default,
or MEAN; `normalize`, default true), cut to `dimensions` and then normalised.

`create_embedding(body)` is the one entry: the route (server/embeddings/routes.py)
and the batch runner (a /v1/embeddings line of a batch file) both call it, with a
parsed `EmbeddingRequest` or its JSON object. Bad input is a `RequestError` /
`APIError` naming the field: an empty input, more inputs than
--max-embedding-inputs, an input longer than the model's context
(--max-model-len), a token id outside the vocabulary, `dimensions` above the
hidden size.

Not here: the schemas (server/embeddings/protocol.py), the pooling itself (the
engine: engine/pooling.py, model/pooler.py).
"""

from __future__ import annotations

import array
import asyncio
import base64
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from dpserve.frontend.errors import RequestError
from dpserve.outputs import RequestOutput
from dpserve.protocol import PoolingParams, RequestTags
from dpserve.sampling_params import SamplingParams
from dpserve.server.caller import ANONYMOUS, Caller
from dpserve.server.embeddings.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from dpserve.server.errors import APIError
from dpserve.server.limits import LIMIT_CODE, refuse, request_salt, with_deadline
from dpserve.server.openai.serving import OpenAIServing
from dpserve.server.openai.streams import merge

_PARAMS = SamplingParams(max_tokens=1)  # a pooling request samples nothing


class EmbeddingServing:
    """/v1/embeddings over the chat / completion server's `OpenAIServing` (its model
    names, limits, admission and engine path)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.llm = serving.llm
        self.pooler = self.llm.config.model.pooler  # --pooler-config
        self.hidden_size = int(self.llm.config.model.hf_config["hidden_size"])

    async def create_embedding(self, body: EmbeddingRequest | dict[str, Any],
                               caller: Caller = ANONYMOUS) -> EmbeddingResponse:
        """The embeddings of `body`'s inputs, in order (module docstring). `caller`:
        its pinned engine, its key (salts the prefix cache with
        --prefix-cache-salt-per-key), its tenant and trace context."""
        req = (body if isinstance(body, EmbeddingRequest)
               else EmbeddingRequest.model_validate(body, strict=True))
        timeout = self.serving.limits.request_timeout  # --request-timeout: 504 past it
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        tags = self.serving.tags(caller, req.priority)  # fcfs: 400 for a priority
        lora_name = self.serving.check_model(req.model)
        pooling = self._pooling(req)
        prompts = await self._prompts(req)
        request_id = f"embd-{uuid.uuid4().hex}"
        streams = self._start(request_id, prompts, pooling, caller, tags, deadline,
                              lora_name)
        streams = await self.serving.metered(request_id, caller, streams,
                                             sum(len(ids) for _, ids in prompts), 0)
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        async with aclosing(merge(streams)) as merged:
            async for index, out in merged:
                if out.finished:
                    outputs[index] = out
        data = [EmbeddingData(index=i, embedding=_encode(_pooled(out), req.encoding_format))
                for i, out in enumerate(outputs)]
        tokens = sum(len(ids) for _, ids in prompts)
        return EmbeddingResponse(id=request_id, data=data, model=lora_name
                                 or self.serving.model_name,
                                 usage=EmbeddingUsage(prompt_tokens=tokens,
                                                      total_tokens=tokens))

    def _pooling(self, req: EmbeddingRequest) -> PoolingParams:
        dims = req.dimensions
        if dims is not None and dims > self.hidden_size:
            raise RequestError(f"dimensions {dims} is more than the model's hidden size "
                               f"({self.hidden_size})", param="dimensions")
        return PoolingParams(self.pooler.pooling_type, self.pooler.normalize, dims)

    async def _prompts(self, req: EmbeddingRequest) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) of each input, checked against the limits."""
        given = req.input
        batch: list[Any] = ([given] if isinstance(given, str) or isinstance(given[0], int)
                            else list(given))
        most = self.serving.limits.max_embedding_inputs
        if len(batch) > most:
            raise refuse("input", "the number of inputs", most, "max-embedding-inputs",
                         len(batch))
        texts = [p for p in batch if isinstance(p, str)]
        encoded = iter(await self.llm.in_tokenizer_thread(
            lambda: [self.llm.encode(t) for t in texts]) if texts else [])
        prompts = [(p, next(encoded)) if isinstance(p, str) else (None, list(p))
                   for p in batch]
        limit = self.llm.max_model_len
        for i, (_, ids) in enumerate(prompts):
            where = "input" if len(prompts) == 1 else f"input[{i}]"
            if not ids:
                raise RequestError(f"{where} has no tokens", param="input")
            if len(ids) > limit:
                raise RequestError(f"{where} has {len(ids)} tokens, more than the model's "
                                   f"maximum context length of {limit} tokens "
                                   f"(--max-model-len)", param="input", code=LIMIT_CODE)
        return prompts

    def _start(self, request_id: str, prompts: list[tuple[str | None, list[int]]],
               pooling: PoolingParams, caller: Caller, tags: RequestTags,
               deadline: float | None, lora_name: str | None,
               ) -> list[AsyncIterator[RequestOutput]]:
        """Validate every input, admit them, then open one pooling stream per input."""
        rank = caller.data_parallel_rank
        for i, (_, ids) in enumerate(prompts):
            try:
                self.llm.validate(ids, _PARAMS, rank, pooling=True)
            except RequestError as e:
                where = "input" if len(prompts) == 1 else f"input[{i}]"
                param = "input" if e.param == "prompt" else e.param
                raise RequestError(f"{where}: {e}", param, e.code) from None
        if self.serving.admission is not None:  # paused / asleep / queues full
            self.serving.admission([len(ids) for _, ids in prompts])
        salt = request_salt(None, caller.api_key_id,
                            self.serving.limits.prefix_cache_salt_per_key)
        streams = [self.llm.generate(ids, _PARAMS, f"{request_id}-{i}", text, rank,
                                     cache_salt=salt, lora_name=lora_name, pooling=pooling,
                                     tags=tags)
                   for i, (text, ids) in enumerate(prompts)]
        if deadline is not None:
            timeout = self.serving.limits.request_timeout or 0.0
            streams = [with_deadline(s, deadline, timeout) for s in streams]
        return streams


def _pooled(out: RequestOutput | None) -> bytes:
    """The vector of a finished pooling request; 503 for one the engine ended without
    it (aborted: a drain's end, a pause that aborts)."""
    if out is None or out.pooled is None:
        raise APIError(503, "the embedding request was aborted in the engine before it "
                       "finished; retry", type="server_error", code="request_aborted")
    return out.pooled


def _encode(pooled: bytes, encoding_format: str) -> list[float] | str:
    """float32 LE bytes -> a JSON list of numbers, or (base64) the bytes as they are."""
    if encoding_format == "base64":
        return base64.b64encode(pooled).decode("ascii")
    vector = array.array("f", pooled)
    if sys.byteorder != "little":
        vector.byteswap()
    return vector.tolist()
