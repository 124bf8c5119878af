"""`LogprobRenderer`: token logprobs -> the OpenAI shapes a response carries them in.

The engine sends, per token, its id and a map of token id -> `Logprob` (the sampled
token and the best alternatives, each with its rank). A response shows texts, not
ids: completions as `Logprobs` (tokens, logprobs, top alternatives by text, text
offsets), chat as `ChatLogprobs` (each token with its bytes), prompt logprobs in
vLLM's shape (decoded tokens). Each token's text is decoded once (an LRU of 65,536
token ids), not per response.

Not here: which logprobs a request asks for (`SamplingParams.logprobs`, set by
`dpserve.server.openai.serving`), the engine's side (`dpserve.model.sampler`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from dpserve.outputs import Logprob
from dpserve.server.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    Logprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)


class LogprobRenderer:
    """Token ids and their logprobs -> OpenAI's logprob objects, texts from `decode`."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.token_text = functools.lru_cache(maxsize=65536)(
            lambda token_id: decode([token_id]))

    def completion(self, pairs: list[tuple[int, dict[int, Logprob]]], num: int | None,
                   offset: int = 0) -> Logprobs | None:
        """The sampled tokens' logprobs as /v1/completions gives them: each token's text,
        logprob, its `num` best alternatives (the sampled one first) and text offset,
        counted from `offset` (a stream's chunks go on from the last one's end)."""
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

    def prompt(self, entries: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
        """RequestOutput.prompt_logprobs -> vLLM's JSON shape (decoded token texts)."""
        if entries is None:
            return None
        return [None if e is None else {
            t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=self.token_text(t))
            for t, lp in e.items()} for e in entries]

    def chat(self, pairs: list[tuple[int, dict[int, Logprob]]], num: int | None,
             ) -> ChatLogprobs | None:
        """The sampled tokens' logprobs as /v1/chat/completions gives them: each token
        with its bytes and its `num` best alternatives (rank order)."""
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


