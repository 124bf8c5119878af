"""Tenants in the API server: the options, the check before a request is sent, 429s.

Scope: `TenantOptions` (`--tenant-limits FILE`, `--tenant-header NAME`, read once;
`add_tenant_args`), `TenantGate` (asks the ledger before a request reaches an
engine: `admit` -> a `Ticket`, or a 429 / 503 `APIError`), `Ticket` (one admitted
request: `meter` wraps its engine streams and tells the ledger when its first
token comes and when the last stream ends, with the tokens it generated),
`LocalLedger` (the ledger in this process: no DP coordinator) and
`refusal_error` (the 429: OpenAI's shape, `rate_limit_error`, the limit as its
code, `Retry-After`, IETF `RateLimit-*` and OpenAI's `x-ratelimit-*` headers; a
request that alone is over the limit, and so can never fit, names the field to
shrink as its `param`: a batch line retries the others, not it).

Where the ledger lives: in the DP coordinator whenever there is one (every API
server asks it: `dpserve.server.tenant_link.LedgerLink`), else here. A tenant
with no limits is never sent to the ledger. One ticket per API request: a
request of several prompts or n > 1 is one request in flight, its prompts'
tokens (times n) its queued tokens until the first token of any of them, and
its max_tokens times its completions its reservation against tokens_per_minute.

Not here: who the tenant is (`dpserve.server.caller`), the ledger's rules
(`dpserve.tenancy.ledger`), the per-tenant metrics (`dpserve.server.metrics.tenants`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from dpserve.errors import ConfigError
from dpserve.server.errors import APIError
from dpserve.tenancy.ledger import Ledger, Refusal
from dpserve.tenancy.limits import TenantLimits, load_tenant_limits

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_HEADER_NAME = re.compile(r"[A-Za-z0-9-]{1,64}")
# Headers a tenant header must not be: they carry credentials or routing of ours.
_RESERVED = {"authorization", "x-api-key", "x-data-parallel-rank", "x-session-id"}


@dataclass(frozen=True)
class TenantOptions:
    """--tenant-limits (None: no limits) and --tenant-header (None: the key's name); the
    API server adds where the coordinator's ledger is (None: none, a ledger in-process)."""

    limits: TenantLimits | None = None
    header: str | None = None
    ledger_address: str | None = None  # the DP coordinator's tenant ROUTER
    secret: str | None = field(default=None, repr=False)  # the data-plane secret (CURVE)

    def at(self, ledger_address: str | None, secret: str | None) -> TenantOptions:
        """These options with the coordinator's ledger at `ledger_address` (None: none)."""
        return replace(self, ledger_address=ledger_address, secret=secret)

    def ledger(self) -> LedgerClient:
        """The ledger these options name (with limits only)."""
        assert self.limits is not None
        if self.ledger_address is None:
            return LocalLedger(self.limits)
        from dpserve.server.tenant_link import LedgerLink

        return LedgerLink(self.ledger_address, self.secret)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TenantOptions:
        header = getattr(args, "tenant_header", None)
        if header is not None and (not _HEADER_NAME.fullmatch(header)
                                   or header.lower() in _RESERVED):
            raise ConfigError(f"--tenant-header must be an HTTP header name (letters, digits, "
                              f"'-'; not one dpserve reads for something else), got "
                              f"{header!r}")
        path = getattr(args, "tenant_limits", None)
        return cls(load_tenant_limits(path) if path else None, header)


def add_tenant_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    a = parser.add_argument
    a("--tenant-limits", default=None, metavar="FILE",
      help="Per-tenant limits, a JSON object: tenant name (or \"default\" for the others) "
           "-> {max_requests_in_flight, tokens_per_minute, max_queued_tokens}; over one: "
           "HTTP 429 with Retry-After. Held by the DP coordinator for every API server.")
    a("--tenant-header", default=None, metavar="NAME",
      help="Take the tenant from this request header (e.g. X-Tenant-ID; 1-64 of "
           "[A-Za-z0-9._-]) instead of the API key's name. Trust it only behind a proxy "
           "that sets it.")


class LedgerClient(Protocol):
    """The ledger as an API server reaches it (in this process, or the coordinator's)."""

    async def admit(self, request_id: str, tenant: str, prompt_tokens: int,
                    max_tokens: int) -> Refusal | None: ...
    def started(self, request_id: str) -> None: ...
    def finished(self, request_id: str, generated_tokens: int) -> None: ...
    def close(self) -> None: ...


class LocalLedger:
    """The ledger in this process (no DP coordinator: one API server)."""

    def __init__(self, limits: TenantLimits) -> None:
        self.ledger = Ledger(limits)

    async def admit(self, request_id: str, tenant: str, prompt_tokens: int,
                    max_tokens: int) -> Refusal | None:
        return self.ledger.admit(request_id, tenant, prompt_tokens, max_tokens,
                                 time.monotonic())

    def started(self, request_id: str) -> None:
        self.ledger.started(request_id)

    def finished(self, request_id: str, generated_tokens: int) -> None:
        self.ledger.finished(request_id, generated_tokens)

    def close(self) -> None:
        pass


OnRefused = Callable[[str, str], None]  # (tenant, limit) of each 429


class TenantGate:
    """Admission of a request against its tenant's limits (module docstring)."""

    def __init__(self, limits: TenantLimits, ledger: LedgerClient,
                 on_refused: OnRefused | None = None) -> None:
        self.limits = limits
        self.ledger = ledger
        self.on_refused = on_refused

    async def admit(self, tenant: str, request_id: str, prompt_tokens: int,
                    max_tokens: int) -> Ticket | None:
        """A ticket for an admitted request (None: its tenant has no limits); raises
        the 429 over a limit, or the 503 the ledger's link raises when it is away."""
        if not self.limits.of(tenant).any:
            return None
        refusal = await self.ledger.admit(request_id, tenant, prompt_tokens, max_tokens)
        if refusal is not None:
            if self.on_refused is not None:
                self.on_refused(tenant, refusal.limit)
            raise refusal_error(tenant, refusal)
        return Ticket(self.ledger, request_id, asyncio.get_running_loop())

    def close(self) -> None:
        self.ledger.close()


class Ticket:
    """One admitted request: tells the ledger of its first token and its end (once,
    when its last stream ends; or, if no stream ever ran, when it is collected)."""

    def __init__(self, ledger: LedgerClient, request_id: str,
                 loop: asyncio.AbstractEventLoop) -> None:
        self._ledger = ledger
        self._request_id = request_id
        self._loop = loop
        self._streams = 0
        self._started = False
        self._done = False
        self.generated_tokens = 0

    def meter(self, stream: AsyncIterator[_T]) -> AsyncIterator[_T]:
        self._streams += 1
        return self._metered(stream)

    async def _metered(self, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
        try:
            async for out in stream:
                new = sum(len(c.token_ids) for c in out.outputs)
                if new and not self._started:
                    self._started = True
                    self._ledger.started(self._request_id)
                self.generated_tokens += new
                yield out
        finally:
            self._streams -= 1
            if self._streams == 0:
                self._finish()

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._ledger.finished(self._request_id, self.generated_tokens)

    def __del__(self) -> None:
        if not self._done:  # streams never iterated (a failure before the response)
            try:
                self._loop.call_soon_threadsafe(self._finish)
            except RuntimeError:  # the loop is closed: the process is ending
                pass


def refusal_error(tenant: str, refusal: Refusal) -> APIError:
    """The 429 of a refusal (module docstring)."""
    r = refusal
    what = {"max_requests_in_flight": f"it has {r.value - r.remaining} request(s) in flight",
            "max_queued_tokens": f"this request's {r.cost} prompt token(s) would exceed it "
                                 f"({r.remaining} left while its queued requests start)",
            "tokens_per_minute": f"this request may use {r.cost} token(s) (prompt + "
                                 f"max_tokens) and {r.remaining} are left in the last "
                                 f"minute"}[r.limit]
    alone = r.cost > r.value  # this request can never fit: the field to shrink is named
    if alone:
        what = (f"this request alone needs {r.cost} (prompt" + (" + max_tokens" if r.limit ==
                "tokens_per_minute" else "") + "), more than the limit: it can never fit")
    message = (f"Rate limit reached: tenant {tenant!r} is at its {r.limit} limit of "
               f"{r.value} (--tenant-limits): {what}; retry in {r.retry_after_s} s.")
    reset = r.reset_s or r.retry_after_s
    headers = {"Retry-After": str(r.retry_after_s), "RateLimit-Limit": str(r.value),
               "RateLimit-Remaining": str(r.remaining), "RateLimit-Reset": str(reset)}
    if r.limit == "max_requests_in_flight":
        headers |= {"x-ratelimit-limit-requests": str(r.value),
                    "x-ratelimit-remaining-requests": str(r.remaining),
                    "x-ratelimit-reset-requests": f"{reset}s"}
    elif r.limit == "tokens_per_minute":
        headers |= {"x-ratelimit-limit-tokens": str(r.value),
                    "x-ratelimit-remaining-tokens": str(r.remaining),
                    "x-ratelimit-reset-tokens": f"{reset}s"}
    param = None if not alone else "max_tokens" if r.limit == "tokens_per_minute" else "prompt"
    return APIError(429, message, type="rate_limit_error", param=param, code=r.limit,
                    headers=headers)
