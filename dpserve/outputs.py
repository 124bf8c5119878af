"""What users get back: vLLM-shaped request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One dict per generated position: token id -> its Logprob (the sampled token
# and the top-N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # SamplingParams.prompt_logprobs: None for the first prompt token, then one
    # dict per prompt token (the token itself and the top-k there).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # A pooling (embedding) request's result once finished: little-endian float32
    # bytes (`EngineCoreOutput.pooled`); None for a generation request.
    pooled: bytes | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # the pooled (and, by default, normalised) hidden state


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding, as vLLM's `LLM.embed` returns it."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
