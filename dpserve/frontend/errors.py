"""Errors the front-end raises to its callers (the HTTP server, user code).

* `EngineDeadError`: the engine (thread or process) died. Every request in
  flight fails with it at once, and every later call raises it; the server
  answers 503 from then on. Engine clients (in-process or over sockets) raise
  this one class.
* `EngineUnavailableError` (an `EngineDeadError`): no DP rank is serving this
  request now; other requests and later ones may well be served.
* `RequestError`: a request that can never run (prompt too long, token ids
  outside the vocabulary, ...). A `ValueError`, so callers that only know
  about `ValueError` still treat it as bad input; `param` names the request
  field at fault when there is one.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine is dead; nothing more will come from it."""

    def __init__(self, message: str = "the engine died; restart the server") -> None:
        super().__init__(message)


class EngineUnavailableError(EngineDeadError):
    """No DP rank serving can take this request now (dead, unhealthy, restarting),
    or its pinned rank is not serving; the server itself lives on (HTTP 503)."""

    def __init__(self, message: str = "no engine is serving") -> None:
        super().__init__(message)


class RequestError(ValueError):
    """A bad request: `param` names the field at fault, `code` is a stable tag."""

    def __init__(self, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
