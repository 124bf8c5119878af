"""Per-request sampling options.

`SamplingParams` is a msgspec Struct so that it can later cross process
boundaries as it is. It validates itself on construction: every bad value
raises `ValueError` naming the field, so both the offline API and the HTTP
server turn it into a clear message. Its sizes (stop_token_ids, logit_bias
entries) are checked by `check_limits` against the configured request limits.
"""

from __future__ import annotations

import msgspec

from dpserve.structured.spec import StructuredOutputs

_MAX_LOGPROBS = 20
# Request limits (EngineArgs / `dpserve serve` override them: `check_limits`).
DEFAULT_MAX_STOP_TOKEN_IDS = 256  # each is checked for every generated token
DEFAULT_MAX_LOGIT_BIAS = 1024


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to pick tokens and when to stop, for one request.

    temperature == 0 means greedy. top_k <= 0 (or -1) disables top-k;
    top_p == 1 and min_p == 0 disable those filters. `seed` makes a sampled
    request reproducible whatever else shares its batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # Number of top logprobs to return besides the sampled token's (None: none).
    logprobs: int | None = None
    # Number of top logprobs to return at every prompt position besides the prompt
    # token's (None: none). A request asking for them gets no prefix-cache hit.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Output constrained to a JSON schema, regex, choice or grammar (dpserve/structured/).
    structured_outputs: StructuredOutputs | None = None
    # token id -> bias added to its logit before sampling (OpenAI: [-100, 100]).
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(0.0 <= self.temperature <= 2.0, "temperature",
               f"must be in [0, 2], got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k", f"must be -1 (disabled) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
               f"must be in (0, 2], got {self.repetition_penalty}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"must be at least 1, got {self.max_tokens}")
        _check(self.seed is None or -(1 << 63) <= self.seed < (1 << 63), "seed",
               f"must fit in a signed 64-bit integer, got {self.seed}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or 0 <= self.logprobs <= _MAX_LOGPROBS, "logprobs",
               f"must be in [0, {_MAX_LOGPROBS}], got {self.logprobs}")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= _MAX_LOGPROBS,
               "prompt_logprobs",
               f"must be in [0, {_MAX_LOGPROBS}], got {self.prompt_logprobs}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "stop strings must be non-empty strings")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "token ids must be non-negative")
        _check(not self.logit_bias or all(
            isinstance(t, int) and t >= 0 and -100.0 <= b <= 100.0
            for t, b in self.logit_bias.items()), "logit_bias",
            "maps token ids (>= 0) to biases in [-100, 100]")

    def check_limits(self, max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS,
                     max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS) -> None:
        """Raise ValueError naming the field, the limit and its option when a list is
        longer than allowed. Not part of construction (a server may raise the limits):
        the API server checks before building, the engine on `add_request` with its
        configured limits, so the offline `LLM` gets them too."""
        _check(len(self.stop_token_ids) <= max_stop_token_ids, "stop_token_ids",
               f"has {len(self.stop_token_ids)} entries; at most {max_stop_token_ids} are "
               f"allowed (max_stop_token_ids, --max-stop-token-ids)")
        biases = len(self.logit_bias) if self.logit_bias else 0
        _check(biases <= max_logit_bias, "logit_bias",
               f"has {biases} entries; at most {max_logit_bias} are allowed "
               f"(max_logit_bias, --max-logit-bias)")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")
