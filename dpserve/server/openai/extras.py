"""The smaller OpenAI / vLLM surface: HTTP options (CORS, root path, TLS, chat
template, model aliases), `/tokenize`, `/detokenize`, `/v1/models/{id}`, and HTTP
responses by route and status in /metrics.

`add_http_args` adds the flags to `dpserve serve`; `HTTPOptions.from_args` reads
them once; `install_extras(app, ...)` adds the routes and middleware to the app
`build_app` made; `uvicorn_kwargs` is what uvicorn itself needs (TLS, root path).

CORS: no CORS headers at all unless `--allowed-origins` is given (a page on
another origin cannot read any answer, and a cross-site fetch() that needs a
preflight, e.g. a JSON POST to an admin route, is not sent). `--allowed-methods`,
`--allowed-headers` and `--allow-credentials` need `--allowed-origins`;
`--allow-credentials` with a "*" origin is refused (it would grant any site the
user's credentials). /tokenize and /detokenize tokenise on `AsyncLLM`'s tokenizer
thread, not on the event loop.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request

from dpserve import tracing
from dpserve.errors import ConfigError
from dpserve.frontend.errors import RequestError
from dpserve.server.trace_http import TraceMiddleware

if TYPE_CHECKING:  # prometheus_client is imported late: it reads its env on import
    from prometheus_client import CollectorRegistry


@dataclass(frozen=True)
class HTTPOptions:
    allowed_origins: tuple[str, ...] = ()  # empty: no CORS middleware at all
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    chat_template: str | None = None  # the template text (read from a file if a path)
    model_aliases: tuple[str, ...] = ()  # more --served-model-name values

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HTTPOptions:
        if bool(getattr(args, "ssl_keyfile", None)) != bool(getattr(args, "ssl_certfile", None)):
            raise ConfigError("--ssl-keyfile and --ssl-certfile go together")
        for option in ("ssl_keyfile", "ssl_certfile"):
            path = getattr(args, option, None)
            if path and not Path(path).is_file():
                raise ConfigError(f"--{option.replace('_', '-')}: no such file: {path}")
        names = getattr(args, "served_model_name", None)
        aliases = tuple(names[1:]) if isinstance(names, list) else ()
        origins = _json_list(args, "allowed_origins", [])
        credentials = bool(getattr(args, "allow_credentials", False))
        _check_cors(args, origins, credentials)
        return cls(
            allowed_origins=tuple(origins),
            allowed_methods=tuple(_json_list(args, "allowed_methods", ["*"])),
            allowed_headers=tuple(_json_list(args, "allowed_headers", ["*"])),
            allow_credentials=credentials,
            root_path=getattr(args, "root_path", "") or "",
            ssl_keyfile=getattr(args, "ssl_keyfile", None),
            ssl_certfile=getattr(args, "ssl_certfile", None),
            chat_template=load_chat_template(getattr(args, "chat_template", None)),
            model_aliases=aliases)


def _check_cors(args: argparse.Namespace, origins: list[str], credentials: bool) -> None:
    if not origins:
        for option in ("allowed_methods", "allowed_headers", "allow_credentials"):
            if getattr(args, option, None):
                raise ConfigError(f"--{option.replace('_', '-')} needs --allowed-origins "
                                  f"(without it the server sends no CORS headers)")
    if credentials and "*" in origins:
        raise ConfigError("--allow-credentials cannot be used with a '*' origin in "
                          "--allowed-origins: list the origins that may send credentials")


def _json_list(args: argparse.Namespace, name: str, default: list[str]) -> list[str]:
    raw = getattr(args, name, None)
    if raw is None:
        return default
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"--{name.replace('_', '-')} must be a JSON list of strings, "
                          f"e.g. '[\"https://example.com\"]', got {raw!r}")
    return value


def load_chat_template(value: str | None) -> str | None:
    """A path to a Jinja file, or the template itself (when it holds '{')."""
    if not value:
        return None
    path = Path(value)
    if "{" not in value:
        if not path.is_file():
            raise ConfigError(f"--chat-template: no such file: {value}")
        return path.read_text()
    return value


def add_http_args(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--allowed-origins", default=None,
      help='CORS: origins allowed, a JSON list, e.g. \'["https://app.example"]\' (default: '
           'none, no CORS headers at all).')
    a("--allowed-methods", default=None,
      help='CORS, with --allowed-origins: methods allowed (default ["*"]).')
    a("--allowed-headers", default=None,
      help='CORS, with --allowed-origins: headers allowed (default ["*"]).')
    a("--allow-credentials", action="store_true",
      help="CORS, with --allowed-origins (not '*'): allow credentials.")
    a("--root-path", default="", help="The path prefix a proxy serves this server under.")
    a("--ssl-keyfile", default=None, help="Serve HTTPS: the private key file (PEM).")
    a("--ssl-certfile", default=None, help="Serve HTTPS: the certificate file (PEM).")
    a("--chat-template", default=None,
      help="Chat template (Jinja) replacing the model's: a file, or the template itself.")


def uvicorn_kwargs(options: HTTPOptions) -> dict[str, Any]:
    kw: dict[str, Any] = {"root_path": options.root_path}
    if options.ssl_certfile:
        kw.update(ssl_keyfile=options.ssl_keyfile, ssl_certfile=options.ssl_certfile)
    return kw


def install_extras(app: FastAPI, llm: Any, serving: Any, registry: CollectorRegistry,
                   options: HTTPOptions, v1: APIRouter | None = None) -> None:
    """HTTP-response metrics, CORS (preflights are answered before the API key is asked
    for), the root span of traced requests (the outermost middleware, when tracing) and
    the extra routes (the module docstring)."""
    _count_responses(app, registry)
    _cors_and_traces(app, options)
    _tokenizer_routes(app, llm, serving)


def _count_responses(app: FastAPI, registry: CollectorRegistry) -> None:
    """`dpserve:http_responses` by route and status, counted by a middleware."""
    from prometheus_client import Counter

    responses = Counter("dpserve:http_responses", "HTTP responses by route and status.",
                        ["route", "status"], registry=registry)

    @app.middleware("http")
    async def count_responses(request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", None) or "unmatched"
        responses.labels(path, str(response.status_code)).inc()
        return response


def _cors_and_traces(app: FastAPI, options: HTTPOptions) -> None:
    """CORS (only with --allowed-origins), then, outermost, the traces' root spans."""
    from fastapi.middleware.cors import CORSMiddleware

    if options.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                           allow_methods=list(options.allowed_methods),
                           allow_headers=list(options.allowed_headers),
                           allow_credentials=options.allow_credentials)
    if tracing.active():  # each traced request's root span, outermost (server/trace_http.py)
        app.add_middleware(TraceMiddleware)


def _tokenizer_routes(app: FastAPI, llm: Any, serving: Any) -> None:
    """POST /tokenize and /detokenize, on `llm`'s tokenizer thread."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await _json_body(request)
        serving.check_model(body.get("model"))
        if "messages" in body:
            ids = await llm.in_tokenizer_thread(
                llm.apply_chat_template, body["messages"],
                bool(body.get("add_generation_prompt", True)))
        elif isinstance(body.get("prompt"), str):
            special = {} if body.get("add_special_tokens", True) else {
                "add_special_tokens": False}
            ids = await llm.in_tokenizer_thread(llm.tokenizer.encode, body["prompt"], **special)
        else:
            raise RequestError("tokenize needs a prompt (string) or messages", param="prompt")
        out: dict[str, Any] = {"count": len(ids), "max_model_len": llm.max_model_len,
                               "tokens": ids}
        if body.get("return_token_strs"):
            out["token_strs"] = await llm.in_tokenizer_thread(
                llm.tokenizer.convert_ids_to_tokens, ids)
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await _json_body(request)
        serving.check_model(body.get("model"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and 0 <= t < llm.vocab_size for t in tokens):
            raise RequestError(f"tokens must be a list of token ids in [0, {llm.vocab_size})",
                               param="tokens")
        return {"prompt": await llm.in_tokenizer_thread(llm.decode, tokens)}


async def _json_body(request: Request) -> dict[str, Any]:
    """The body as a JSON object (read through `BodyLimit`: 413 over the cap)."""
    try:
        body = json.loads(await request.body() or b"{}")
    except json.JSONDecodeError as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body
