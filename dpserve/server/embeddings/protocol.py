"""OpenAI's embeddings schemas: the /v1/embeddings request and its response.

Parsed as every /v1 body is (`model_validate_json(body, strict=True)`; unknown fields
ignored). `input` is a string, a list of strings, a list of token ids or a list of
lists of token ids; `encoding_format` "float" (a JSON list per input) or "base64"
(the vector's little-endian float32 bytes, base64: what the official `openai`
client asks for by default and decodes itself).

Not here: the checks that need the model or the options (`dimensions` against the
hidden size, the number of inputs, tokens per input: server/embeddings/serving.py).
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dpserve.server.openai.protocol import MAX_ABS_PRIORITY


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class EmbeddingRequest(_Model):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted, as OpenAI does; not used
    # Scheduling priority (vLLM's field): lower runs first.
    priority: int = Field(0, ge=-MAX_ABS_PRIORITY, le=MAX_ABS_PRIORITY)

    @field_validator("input")
    @classmethod
    def _not_empty(cls, v: str | list) -> str | list:
        if isinstance(v, str) or not v:
            if not v:
                raise ValueError("input must not be empty")
            return v
        for i, item in enumerate(v):
            if isinstance(item, (str, list)) and not item:
                raise ValueError(f"input[{i}] must not be empty")
        return v

    @field_validator("dimensions")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"dimensions must be at least 1, got {v}")
        return v


class EmbeddingData(_Model):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # "base64": little-endian float32 bytes, base64


class EmbeddingUsage(_Model):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Model):
    id: str = ""  # dpserve's request id (vLLM's field; OpenAI's object has none)
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
