"""The one auth layer of the HTTP server: API keys, the open allowlist, the admin rule.

Scope: `AuthOptions` (the accepted keys and `--metrics-auth`, read once from
`--api-key`, `$DPSERVE_API_KEY` and `--api-key-file`), `AuthMiddleware` (an
ASGI middleware in front of every route, so a route added later is behind
the key without anyone remembering to add it), `add_auth_args` (the flags)
and `check_admin_exposure` (the start-up refusal of an unauthenticated admin
API). `build_app` installs the middleware.

Every request needs `Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY`
(any accepted key; either header will do, on every route) except the
paths in `OPEN_PATHS`: /health, /ping, /version (liveness probes), the
dashboard page and its two static files (they hold no data; the page's script
sends the key the user types into it to every data route it calls), and
/metrics unless `--metrics-auth`. Without the key: 401, OpenAI-shaped, with
`WWW-Authenticate: Bearer`. Without any configured key everything is open.
Keys are compared in constant time (sha256 digests with `secrets.compare_digest`,
every key tried); only the digests are kept.

The middleware sets `request.state.api_key_id`: a non-secret name of the key
that matched (its name in the key file, else "key-" + the first 12 hex digits
of sha256(key)), None when no key is configured. Per-key prefix-cache salting
reads it.

Key file (`--api-key-file PATH`): one key per line, `KEY` or `NAME KEY`
(whitespace between; NAME is letters, digits, `._-`); blank lines and lines
starting with `#` are ignored; several keys allowed. A file readable or
writable by every user (mode o+r / o+w) is refused.

Not here: CORS (`dpserve.server.openai.extras`), body limits and JSON-only admin posts
(`dpserve.server.bodies`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from dpserve.errors import ConfigError
from dpserve.security import is_loopback
from dpserve.server.errors import APIError, send_error

API_KEY_ENV = "DPSERVE_API_KEY"
# Open without a key (exact paths, any method).
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/dashboard",
                        "/dashboard/dashboard.js", "/dashboard/dashboard.css"})
METRICS_PATH = "/metrics"  # open unless --metrics-auth
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class APIKey:
    """An accepted key: its non-secret id and the sha256 digest of the key."""

    id: str
    digest: bytes


def key_id(key: str) -> str:
    """The non-secret id of an unnamed key: "key-" + 12 hex digits of its sha256."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _entry(key: str, name: str | None = None) -> APIKey:
    return APIKey(name or key_id(key), hashlib.sha256(key.encode()).digest())


@dataclass(frozen=True)
class AuthOptions:
    keys: tuple[APIKey, ...] = ()  # empty: every route is open
    metrics_auth: bool = False  # /metrics needs the key too

    @classmethod
    def from_key(cls, key: str | None, metrics_auth: bool = False) -> AuthOptions:
        return cls((_entry(key),) if key else (), metrics_auth)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AuthOptions:
        """--api-key (default $DPSERVE_API_KEY) plus every key of --api-key-file."""
        keys: list[APIKey] = []
        single = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None
        if single:
            keys.append(_entry(single))
        path = getattr(args, "api_key_file", None)
        if path:
            keys += load_key_file(path)
        if len({k.digest for k in keys}) < len(keys):
            raise ConfigError("--api-key-file: the same key is given twice (in the file, or "
                              "also as --api-key / $DPSERVE_API_KEY)")
        metrics_auth = bool(getattr(args, "metrics_auth", False))
        if metrics_auth and not keys:
            raise ConfigError("--metrics-auth needs an API key (--api-key, --api-key-file or "
                              "$DPSERVE_API_KEY)")
        return cls(tuple(keys), metrics_auth)

    def match(self, authorization: str) -> str | None:
        """The id of the key `authorization` ("Bearer KEY") carries, or None. Constant
        time in the key: every accepted key is compared, whichever matches."""
        scheme, _, token = authorization.partition(" ")
        given = hashlib.sha256(token.strip().encode()).digest()
        found = None
        for key in self.keys:
            if secrets.compare_digest(given, key.digest) and scheme.lower() == "bearer":
                found = key.id
        return found


def load_key_file(path: str) -> list[APIKey]:
    """The keys of an --api-key-file (module docstring); ConfigError on a bad file."""
    file = Path(path)
    try:
        mode = file.stat().st_mode
        text = file.read_text()
    except OSError as e:
        raise ConfigError(f"--api-key-file {path}: {e.strerror or e}") from None
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        raise ConfigError(f"--api-key-file {path} is readable or writable by every user "
                          f"(mode {stat.S_IMODE(mode):04o}); chmod 600 it")
    keys, names = [], set()
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2 or (len(fields) == 2 and not _NAME.fullmatch(fields[0])):
            raise ConfigError(f"--api-key-file {path} line {number}: expected KEY or "
                              f"NAME KEY (NAME: letters, digits, ._-)")
        name = fields[0] if len(fields) == 2 else None
        if name is not None:
            if name in names:
                raise ConfigError(f"--api-key-file {path} line {number}: name {name!r} is "
                                  f"used twice")
            names.add(name)
        keys.append(_entry(fields[-1], name))
    if not keys:
        raise ConfigError(f"--api-key-file {path} holds no key")
    return keys


class AuthMiddleware:
    """Every HTTP request not in the allowlist needs an accepted key (module docstring)."""

    def __init__(self, app: ASGIApp, options: AuthOptions) -> None:
        self.app = app
        self.options = options
        self.open = OPEN_PATHS if options.metrics_auth else OPEN_PATHS | {METRICS_PATH}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["api_key_id"] = None
        if self.options.keys:
            headers = dict(scope["headers"])
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            state["api_key_id"] = self.options.match(authorization)
            if state["api_key_id"] is None and b"x-api-key" in headers:  # Anthropic's
                token = headers[b"x-api-key"].decode("latin-1")
                state["api_key_id"] = self.options.match(f"Bearer {token}")
            if state["api_key_id"] is None and route_path(scope) not in self.open:
                await send_error(send, UNAUTHORIZED)
                return
        await self.app(scope, receive, send)


def route_path(scope: Scope) -> str:
    """The path the router matches: without --root-path when a client sent it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root + "/"):
        return path[len(root):]
    return path


UNAUTHORIZED = APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>' "
                       "(or 'x-api-key: <key>').",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def add_auth_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    a = parser.add_argument
    a("--api-key", default=None,
      help="Require 'Authorization: Bearer KEY' on every route but /health, /ping, "
           "/version, /dashboard and /metrics (default: $DPSERVE_API_KEY; none = open).")
    a("--api-key-file", default=None, metavar="PATH",
      help="More accepted keys, one per line: KEY or NAME KEY ('#' comments); the file "
           "must not be readable by every user.")
    a("--metrics-auth", action="store_true",
      help="/metrics needs the API key too (default: open, for scrapers).")
    a("--allow-unauthenticated-admin", action="store_true",
      help="Allow --enable-admin-api without an API key; only with a loopback --host.")


def check_admin_exposure(args: argparse.Namespace, auth: AuthOptions) -> None:
    """--enable-admin-api without a key: refused unless loopback-only and explicitly allowed."""
    allow = getattr(args, "allow_unauthenticated_admin", False)
    if allow and not is_loopback(args.host):
        raise ConfigError(f"--allow-unauthenticated-admin needs a loopback --host "
                          f"(127.0.0.1, ::1, localhost), got {args.host!r}")
    if getattr(args, "enable_admin_api", False) and not auth.keys and not allow:
        raise ConfigError("--enable-admin-api needs an API key (--api-key, --api-key-file or "
                          "$DPSERVE_API_KEY); on a loopback --host, "
                          "--allow-unauthenticated-admin serves it without one")
