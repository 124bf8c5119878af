"""Errors the front-end raises to its callers (the HTTP server, user code).

* `EngineDeadError`: the engine (thread or process) died. Every request in
  flight fails with it at once, and every later call raises it; the server
  answers 503 from then on. Engine clients (in-process or over sockets) raise
  this one class.
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


class RequestError(ValueError):
    """A bad request: `param` names the field at fault, `code` is a stable tag."""

    def __init__(self, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
