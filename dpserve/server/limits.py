"""Request limits of the API server (the "request limits" group of `dpserve serve`).

One HTTP request is bounded in every dimension that costs the server or the
engines work per entry: stop_token_ids and logit_bias entries (each is looked at
for every generated token), stop strings, tools, structured-output specs and
choices, messages, the engine requests it fans out to (n x prompts), the length
of its cache_salt. Each limit is an option with a default (`add_limit_args`);
`RequestLimits.from_args` reads them once. `check_sampling` / `check_chat` /
`check_completion` run on the parsed request before anything else is built from
it, and each refusal is a `RequestError` (400) whose message names the field,
the limit, the option and the value given. Each check is `len()` or one
serialisation: no walk over a list before its length is known to be within bounds.

`--max-stop-token-ids`, `--max-logit-bias` and `--structured-outputs-compile-timeout`
are engine options (`EngineArgs`, shown in this group): the engine enforces them
too, so the offline `LLM` gets them (`SamplingParams.check_limits`).

Also here, as the serving layer applies them: `request_salt` (a request's
cache_salt combined with its API key's identity under --prefix-cache-salt-per-key)
and `with_deadline` (--request-timeout: a stream that fails with a 504 past it).

Not here: the request body size (`--max-request-body-bytes`, server/app.py), the
compile deadline itself (server/openai/grammar_check.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from dpserve.config import RequestLimitsConfig
from dpserve.errors import ConfigError
from dpserve.frontend.errors import RequestError
from dpserve.sampling_params import DEFAULT_MAX_LOGIT_BIAS, DEFAULT_MAX_STOP_TOKEN_IDS
from dpserve.server.errors import APIError

_T = TypeVar("_T")
LIMIT_CODE = "request_limit_exceeded"  # the `code` of every refusal here


@dataclass(frozen=True)
class RequestLimits:
    """What one HTTP request may hold (see the module docstring); option = field name."""

    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS  # (EngineArgs)
    max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS  # (EngineArgs)
    max_stop_strings: int = 4  # OpenAI's limit
    max_stop_string_length: int = 256  # characters
    max_tools: int = 128  # OpenAI's limit
    max_tools_bytes: int = 256 << 10  # the tools list as JSON
    max_structured_choices: int = 256  # guided_choice / structured_outputs.choice
    max_structured_choices_bytes: int = 64 << 10
    max_structured_outputs_bytes: int = 64 << 10  # one JSON schema, regex or grammar
    max_messages: int = 2048  # OpenAI's limit
    max_request_fanout: int = 128  # engine requests of one HTTP request: n x prompts
    max_embedding_inputs: int = 2048  # inputs of one /v1/embeddings request (OpenAI's)
    max_cache_salt_length: int = 256  # characters
    structured_outputs_compile_timeout: float = 10.0  # seconds (EngineArgs)
    structured_outputs_compile_workers: int = 2  # compile processes of one API server
    request_timeout: float | None = None  # seconds; None: no limit
    prefix_cache_salt_per_key: bool = False  # salt each request with its API key's id

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RequestLimits:
        """The flags (`add_limit_args`, and the engine's own limits from `EngineArgs`);
        ConfigError naming the option for a bad value."""
        limits = cls(**{f.name: getattr(args, f.name) for f in fields(cls)
                        if hasattr(args, f.name)})
        limits.validate()
        return limits

    @classmethod
    def from_engine(cls, engine: RequestLimitsConfig) -> RequestLimits:
        """The defaults, with the engine's own limits (a server built without flags)."""
        return cls(max_stop_token_ids=engine.max_stop_token_ids,
                   max_logit_bias=engine.max_logit_bias,
                   structured_outputs_compile_timeout=engine.structured_outputs_compile_timeout)

    def validate(self) -> None:
        """ConfigError naming the option of a value out of range."""
        for name in _SERVER_OPTIONS:
            value = getattr(self, name)
            if name == "request_timeout":
                if value is not None and not 0 < value < float("inf"):
                    raise ConfigError(f"--request-timeout must be a positive number of "
                                      f"seconds, got {value!r}")
            elif not isinstance(value, bool) and value < 1:
                raise ConfigError(f"{_flag(name)} must be at least 1, got {value!r}")


_SERVER_OPTIONS = ("max_stop_strings", "max_stop_string_length", "max_tools",
                   "max_tools_bytes", "max_structured_choices", "max_structured_choices_bytes",
                   "max_structured_outputs_bytes", "max_messages", "max_request_fanout",
                   "max_embedding_inputs",
                   "max_cache_salt_length", "structured_outputs_compile_workers",
                   "request_timeout", "prefix_cache_salt_per_key")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_limit_args(group: argparse.ArgumentParser) -> None:
    """The API server's request-limit flags (the engine's are added by `EngineArgs`)."""
    d = RequestLimits()
    a = group.add_argument
    a("--max-stop-strings", type=int, default=d.max_stop_strings,
      help="Most stop strings of one request.")
    a("--max-stop-string-length", type=int, default=d.max_stop_string_length,
      help="Longest stop string, in characters.")
    a("--max-tools", type=int, default=d.max_tools, help="Most tools of one chat request.")
    a("--max-tools-bytes", type=int, default=d.max_tools_bytes,
      help="Largest tools list of one chat request, as JSON bytes.")
    a("--max-structured-choices", type=int, default=d.max_structured_choices,
      help="Most choices of guided_choice / structured_outputs.choice.")
    a("--max-structured-choices-bytes", type=int, default=d.max_structured_choices_bytes,
      help="Largest choice list (guided_choice / structured_outputs.choice), as JSON bytes.")
    a("--max-structured-outputs-bytes", type=int, default=d.max_structured_outputs_bytes,
      help="Largest JSON schema, regex or grammar of one request (response_format, "
           "structured_outputs, guided_json / guided_regex / guided_grammar), in bytes.")
    a("--max-messages", type=int, default=d.max_messages,
      help="Most messages of one chat request.")
    a("--max-request-fanout", type=int, default=d.max_request_fanout,
      help="Most engine requests one HTTP request becomes: n x the number of prompts.")
    a("--max-embedding-inputs", type=int, default=d.max_embedding_inputs,
      help="Most inputs of one /v1/embeddings request (each is one engine request).")
    a("--max-cache-salt-length", type=int, default=d.max_cache_salt_length,
      help="Longest cache_salt, in characters.")
    a("--structured-outputs-compile-workers", type=int,
      default=d.structured_outputs_compile_workers,
      help="Processes of each API server that check structured-output specs (compiled for "
           "the tokenizer, killed past --structured-outputs-compile-timeout); when all are "
           "busy for that long, a structured request gets 503.")
    a("--request-timeout", type=float, default=None,
      help="Seconds a request may run in all; past it, it is aborted in the engine and the "
           "client gets HTTP 504 (code request_timeout), or an error event ending its "
           "stream. None: no limit.")
    a("--prefix-cache-salt-per-key", action="store_true",
      help="Salt every request's prefix-cache hashes with its API key's identity, so "
           "clients with different keys never share (or probe) each other's cached "
           "prefixes; a request's own cache_salt is combined with it.")


# ---- checks --------------------------------------------------------------------------


def refuse(field: str, what: str, limit: int | float, option: str, given: Any) -> RequestError:
    """The 400 of a limit: field, limit, option and the value given."""
    return RequestError(f"{field}: {what} is {given}, more than the limit of {limit} "
                        f"(--{option})", param=field, code=LIMIT_CODE)


def _cap(field: str, what: str, given: int, limit: int, option: str) -> None:
    if given > limit:
        raise refuse(field, what, limit, option, given)


def _json_bytes(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def check_sampling(req: Any, limits: RequestLimits, num_prompts: int = 1) -> None:
    """The limits of the fields both endpoints share (SamplingRequest)."""
    if req.stop_token_ids is not None:
        _cap("stop_token_ids", "the number of stop token ids", len(req.stop_token_ids),
             limits.max_stop_token_ids, "max-stop-token-ids")
    if req.logit_bias is not None:
        _cap("logit_bias", "the number of entries", len(req.logit_bias),
             limits.max_logit_bias, "max-logit-bias")
    stops = req.stop or []
    _cap("stop", "the number of stop strings", len(stops), limits.max_stop_strings,
         "max-stop-strings")
    longest = max((len(s) for s in stops), default=0)
    _cap("stop", "the longest stop string's length", longest, limits.max_stop_string_length,
         "max-stop-string-length")
    if any(not s for s in stops):
        raise RequestError("stop strings must not be empty", param="stop")
    _cap("n", "n x the number of prompts", req.n * num_prompts, limits.max_request_fanout,
         "max-request-fanout")
    salt = getattr(req, "cache_salt", None)
    if salt is not None:
        _cap("cache_salt", "the length of cache_salt", len(salt), limits.max_cache_salt_length,
             "max-cache-salt-length")
    _check_structured(req, limits)


def check_completion(req: Any, limits: RequestLimits) -> None:
    prompt = req.prompt
    single = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))
    check_sampling(req, limits, num_prompts=1 if single else len(prompt))


def check_chat(req: Any, limits: RequestLimits) -> None:
    _cap("messages", "the number of messages", len(req.messages), limits.max_messages,
         "max-messages")
    if req.tools:
        _cap("tools", "the number of tools", len(req.tools), limits.max_tools, "max-tools")
        _cap("tools", "the size of tools in JSON bytes", _json_bytes(req.tools),
             limits.max_tools_bytes, "max-tools-bytes")
    check_sampling(req, limits)


def _check_structured(req: Any, limits: RequestLimits) -> None:
    """Sizes of every structured-output spec the request may carry."""
    extra = req.structured_outputs if isinstance(req.structured_outputs, dict) else {}
    fmt = getattr(req, "response_format", None)
    specs = [("guided_json", req.guided_json), ("guided_regex", req.guided_regex),
             ("guided_grammar", req.guided_grammar),
             ("response_format", fmt.json_schema if fmt is not None else None)]
    specs += [("structured_outputs", extra.get(k)) for k in ("json", "regex", "grammar")]
    for field, value in specs:
        if value is None:
            continue
        size = len(value.encode()) if isinstance(value, str) else _json_bytes(value)
        _cap(field, "the size of the schema / regex / grammar in bytes", size,
             limits.max_structured_outputs_bytes, "max-structured-outputs-bytes")
    for field, choices in (("guided_choice", req.guided_choice),
                           ("structured_outputs", extra.get("choice"))):
        if not isinstance(choices, list):
            continue
        _cap(field, "the number of choices", len(choices), limits.max_structured_choices,
             "max-structured-choices")
        _cap(field, "the size of the choices in JSON bytes", _json_bytes(choices),
             limits.max_structured_choices_bytes, "max-structured-choices-bytes")


# ---- cache salt, request timeout ---------------------------------------------------------


def request_salt(cache_salt: str | None, api_key_id: str | None, per_key: bool) -> str | None:
    """The salt of a request's prefix-cache hashes (None: the unsalted cache).

    Without --prefix-cache-salt-per-key: the request's own cache_salt. With it, every
    request is salted, by the JSON pair [key id, cache_salt]: a client cannot write a
    cache_salt that equals another key's salt (every salt is such a pair, and the key
    part is the server's), and requests without a key share one namespace, apart
    from keyed ones."""
    if not per_key:
        return cache_salt
    return json.dumps(["dpserve-key", api_key_id, cache_salt], ensure_ascii=True)


def timeout_error(timeout: float) -> APIError:
    return APIError(504, f"the request ran longer than {timeout:g} s (--request-timeout="
                    f"{timeout:g}) and was aborted", type="server_error",
                    code="request_timeout")


async def with_deadline(stream: AsyncIterator[_T], deadline: float,
                        timeout: float) -> AsyncIterator[_T]:
    """`stream`'s items until the loop's clock reaches `deadline`; then the stream is
    closed (its request aborted in the engine) and the 504 of `timeout_error` raised."""
    async with aclosing(stream):  # type: ignore[type-var]
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    item = await anext(stream)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise timeout_error(timeout) from None
            yield item
