"""Who sent an API request and what its headers ask of the engines: the `Caller`.

Scope: `Caller`, read once per HTTP request by `caller_of` from its headers and
what the auth layer left in `request.state`, and handed to the serving layer
(`dpserve.server.openai.serving` and the APIs built on it) in place of loose
arguments: the pinned engine (`X-data-parallel-rank`), the API key's id (prefix
cache salting), the session (`X-Session-ID`), the tenant (the key's name, the
unit of fairness and limits) and the W3C trace context headers (when this API server
traces: its root span's, which `dpserve.server.trace_http` made a child of the
client's `traceparent` and left in `request.state`; None otherwise, whatever the
client sent).

The tenant: with `--tenant-header NAME` (`request.app.state.tenant_header`),
that header's value (1 to 64 of [A-Za-z0-9._-], else a 400 naming the header);
without the header, or without the option, the API key's name (its name in
`--api-key-file`, else "key-" + 12 hex digits); with no key configured,
"default".

`key_caller` is the caller of a batch's lines (its creator's key);
`caller_tags` turns a caller and a request's priority into the `RequestTags`
every engine request of it carries.

Not here: checking the key (`dpserve.server.auth`), what a session is
(`dpserve.server.sessions`), the body's own fields (`dpserve.server.openai.protocol`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from dpserve.protocol import RequestTags, Session
from dpserve.server.errors import APIError
from dpserve.server.sessions import header_session
from dpserve.tenancy.limits import DEFAULT, TENANT_NAME

DP_RANK_HEADER = "X-data-parallel-rank"


@dataclass(frozen=True)
class Caller:
    """What one API request's headers and credentials say (all None: an anonymous
    request with no headers of ours, e.g. a batch line run by the server itself)."""

    data_parallel_rank: int | None = None  # the engine it pins (None: any)
    api_key_id: str | None = None  # the auth layer's non-secret name of the key used
    session: Session | None = None  # the conversation it continues (X-Session-ID)
    tenant: str | None = None  # whose share of the server it uses
    trace_headers: dict[str, str] | None = None  # W3C trace context (traceparent, ...)


ANONYMOUS = Caller()


def caller_of(request: Request) -> Caller:
    """The caller of an HTTP request (a 400 for a malformed header of ours)."""
    key_id = getattr(request.state, "api_key_id", None)
    return Caller(data_parallel_rank=dp_rank(request), api_key_id=key_id,
                  session=header_session(request), tenant=tenant_of(request, key_id),
                  trace_headers=getattr(request.state, "trace_headers", None))


def key_caller(api_key_id: str | None) -> Caller:
    """The caller of work the server runs for a key with no HTTP request of its own
    (a batch's lines run as the key that created the batch, and its tenant: the
    key's name; a tenant header of the batch's creation is not kept)."""
    return Caller(api_key_id=api_key_id, tenant=api_key_id or DEFAULT)


def tenant_of(request: Request, key_id: str | None) -> str:
    """The request's tenant (module docstring); a 400 for a malformed tenant header."""
    name = getattr(request.app.state, "tenant_header", None)
    value = request.headers.get(name) if name else None
    if value is None:
        return key_id or DEFAULT
    if not TENANT_NAME.fullmatch(value):
        raise APIError(400, f"{name} must be 1 to 64 letters, digits, '.', '_' or '-' (the "
                       f"tenant, --tenant-header), got {value[:80]!r}", param=name)
    return value


def caller_tags(caller: Caller, priority: int = 0) -> RequestTags:
    """The tags every engine request of this caller's request carries."""
    return RequestTags(priority=priority, tenant=caller.tenant,
                       trace_headers=caller.trace_headers)


def dp_rank(request: Request) -> int | None:
    """The engine a request pins with `X-data-parallel-rank` (None: any engine)."""
    value = request.headers.get(DP_RANK_HEADER)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise APIError(400, f"{DP_RANK_HEADER} must be an integer engine rank, got "
                       f"{value!r}", param=DP_RANK_HEADER) from None
