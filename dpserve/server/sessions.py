"""Which session an API request continues, so that its turns stick to one rank.

Scope: the `Session` (`dpserve.protocol`) a request carries to the router
(`dpserve.frontend.routing`: the session's rank unless it is hot, cordoned or
gone), from the first of:

1. the `X-Session-ID` header (any route that generates; at most
   `MAX_SESSION_ID_CHARS` characters, a longer one is a 400 naming the header);
2. the Responses API's chain (`previous_response_id`): the chain's first
   response id, and the rank its last response ran on, read from the store that
   every API server shares (`responses_chain_session`); a response that starts a
   chain is its own first;
3. the request's `user` field (completions, chat completions, responses;
   Anthropic's `metadata.user_id`, which the Messages API runs as `user`).

Keys carry their source (`x-session-id:`, `response:`, `user:`), so a header and a
`user` of the same text are two sessions. A key is only hashed for placement:
never logged, stored or sent to an engine.

Not here: where a session goes (the router), the store's rows
(`dpserve.server.responses.store`).
"""

from __future__ import annotations

from fastapi import Request

from dpserve.protocol import Session
from dpserve.server.errors import APIError

SESSION_HEADER = "X-Session-ID"
MAX_SESSION_ID_CHARS = 256


def header_session(request: Request) -> Session | None:
    """The session the `X-Session-ID` header names (None: no header, or an empty one)."""
    value = request.headers.get(SESSION_HEADER)
    if not value:
        return None
    if len(value) > MAX_SESSION_ID_CHARS:
        raise APIError(400, f"{SESSION_HEADER} is {len(value)} characters long; at most "
                       f"{MAX_SESSION_ID_CHARS} are allowed", param=SESSION_HEADER)
    return Session(f"x-session-id:{value}")


def user_session(user: str | None) -> Session | None:
    """The session of a request's `user` field (None: no user)."""
    return Session(f"user:{user}") if user else None


def responses_chain_session(first_id: str, rank: int | None) -> Session:
    """The session of a Responses chain: its first response's id; `rank`: where its
    last response ran (None: not known)."""
    return Session(f"response:{first_id}", rank)
