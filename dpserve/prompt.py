"""`check_prompt`: the one rule for a prompt that can never run, front-end and engine alike.

A prompt can run when it is not empty, every token id is in the vocabulary,
and its tokens (with the tokens a moved request already generated) leave room
for the completion: `prompt + prior + max_tokens <= max_model_len`, where an
engine, which does not budget the completion, asks for one token (prompt +
prior < max_model_len); a pooling request, which has no completion, passes
`max_tokens=0`. The messages are the user-facing ones the HTTP server
answers with (OpenAI's wording for the context length); `PromptError` is a
`ValueError` that names the request field at fault (`param`) and a stable
`code`.

Used by `EngineCore.add_request`, `AsyncLLM.validate` and the offline LLM's
data-parallel client (`SyncEngineClient`). Not here: the KV-cache cap (the
scheduler's), sampling parameters (`dpserve.sampling_params`).
"""

from __future__ import annotations

from collections.abc import Sequence


class PromptError(ValueError):
    """A prompt that can never run: `param` names the field, `code` is a stable tag."""

    def __init__(self, message: str, param: str = "prompt", code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def check_prompt(prompt_token_ids: Sequence[int], max_model_len: int, vocab_size: int, *,
                 prior_token_ids: Sequence[int] = (), max_tokens: int | None = None) -> None:
    """Raise PromptError if the prompt can never run (module docstring). `prior_token_ids`:
    tokens generated before the request moved here; `max_tokens`: the completion's
    budget (None: one token; 0: none, a pooling request)."""
    n = len(prompt_token_ids)
    if n == 0:
        raise PromptError("the prompt must not be empty")
    bad = next((t for ids in (prompt_token_ids, prior_token_ids) for t in ids
                if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise PromptError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size}) "
                          f"(token ids must be below the vocabulary size)")
    context = n + len(prior_token_ids)
    completion = 1 if max_tokens is None else max_tokens
    if context + completion > max_model_len:
        prior = f", {len(prior_token_ids)} generated before" if prior_token_ids else ""
        raise PromptError(
            f"This model's maximum context length is {max_model_len} tokens. "
            f"However, you requested {context + completion} tokens ({n} in the prompt"
            f"{prior}, {completion} for the completion). Please reduce the length of "
            f"the prompt or max_tokens (max_model_len {max_model_len}).",
            param="prompt" if context >= max_model_len else "max_tokens",
            code="context_length_exceeded")
