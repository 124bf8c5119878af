"""The tenants' ledger: what each tenant has in flight, queued and used this minute.

Scope: `Ledger` (IO-free; the caller passes the time) admits a request against
its tenant's `TenantLimit` or refuses it with a `Refusal` (which limit, its
value, what is left, when to retry), then hears when the request starts (its
first token) and finishes. `Usage` is a tenant's figures now.

The three limits, per tenant, checked in this order at admission:

* max_requests_in_flight: requests admitted and not finished.
* max_queued_tokens: prompt tokens of requests admitted whose first token has
  not come yet (`started`).
* tokens_per_minute: tokens of the requests admitted in the last 60 s. A
  request counts prompt + max_tokens at admission (what it may use: the ledger
  cannot know less); at `finished` its entry is corrected to prompt + the
  tokens it generated, if it is still in the window. So a tenant whose
  requests stop early gets the difference back when they finish, never later.

Invariants: a key is admitted at most once (a second admit of a live key is a
ValueError); `started` / `finished` of an unknown key do nothing (the entry was
dropped: a lost API server, a restarted coordinator); every figure returns to 0
once every admitted key has finished (tests/unit/test_tenants.py).

Not here: the limits file (`dpserve.tenancy.limits`), the sockets that carry
admissions to the coordinator, HTTP (`dpserve.server.tenants`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from dpserve.tenancy.limits import TenantLimit, TenantLimits

WINDOW_S = 60.0  # tokens_per_minute's sliding window
RETRY_BUSY_S = 1.0  # Retry-After when in-flight or queued requests must finish first


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: over `limit` (a `TenantLimit` field) of `value`."""

    limit: str  # "max_requests_in_flight" | "max_queued_tokens" | "tokens_per_minute"
    value: int  # the limit
    remaining: int  # what is left of it now
    cost: int  # what this request needed of it
    retry_after_s: int  # seconds until it may fit (whole, >= 1)
    reset_s: int  # seconds until the tenant's usage of it is back to 0 (0: unknown)


@dataclass(frozen=True)
class Usage:
    """A tenant's figures now."""

    in_flight: int = 0
    queued_tokens: int = 0
    window_tokens: int = 0  # tokens admitted in the last WINDOW_S (corrected at finish)


@dataclass
class _Spend:
    """One admitted request's tokens in its tenant's window."""

    time: float  # when admitted
    tokens: int  # prompt + max_tokens, then prompt + generated once finished
    in_window: bool = True


@dataclass
class _Entry:
    """One admitted request."""

    tenant: str
    prompt_tokens: int
    spend: _Spend
    started: bool = False


@dataclass
class _Tenant:
    in_flight: int = 0
    queued_tokens: int = 0
    window_tokens: int = 0
    window: deque[_Spend] = field(default_factory=deque)  # oldest first


class Ledger:
    """Admissions against `TenantLimits` (module docstring). Keys: any hashable that
    names one request (the coordinator uses (API server session, request id))."""

    def __init__(self, limits: TenantLimits, window_s: float = WINDOW_S) -> None:
        self.limits = limits
        self.window_s = window_s
        self._entries: dict[Hashable, _Entry] = {}
        self._tenants: dict[str, _Tenant] = {}

    def admit(self, key: Hashable, tenant: str, prompt_tokens: int, max_tokens: int,
              now: float) -> Refusal | None:
        """Admit one request (None) or say why not (nothing is recorded then)."""
        if key in self._entries:
            raise ValueError(f"request {key!r} is already admitted")
        limit = self.limits.of(tenant)
        state = self._tenant(tenant, now)
        refusal = self._check(limit, state, prompt_tokens, prompt_tokens + max_tokens, now)
        if refusal is not None:
            return refusal
        spend = _Spend(now, prompt_tokens + max_tokens)
        self._entries[key] = _Entry(tenant, prompt_tokens, spend)
        state.in_flight += 1
        state.queued_tokens += prompt_tokens
        state.window.append(spend)
        state.window_tokens += spend.tokens
        return None

    def started(self, key: Hashable) -> None:
        """The request's first token came: its prompt is no longer queued."""
        entry = self._entries.get(key)
        if entry is None or entry.started:
            return
        entry.started = True
        self._tenants[entry.tenant].queued_tokens -= entry.prompt_tokens

    def finished(self, key: Hashable, generated_tokens: int | None = None) -> None:
        """The request ended; `generated_tokens` corrects its window entry (None: not
        known, e.g. its API server was lost: the reservation stays until it expires)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        state = self._tenants[entry.tenant]
        if not entry.started:
            state.queued_tokens -= entry.prompt_tokens
        state.in_flight -= 1
        spend = entry.spend
        if generated_tokens is not None and spend.in_window:
            tokens = entry.prompt_tokens + generated_tokens
            state.window_tokens += tokens - spend.tokens
            spend.tokens = tokens

    def drop(self, keys: Iterable[Hashable]) -> None:
        """Forget requests whose end will never be heard (as finished, tokens unknown)."""
        for key in list(keys):
            self.finished(key)

    def keys(self) -> list[Hashable]:
        return list(self._entries)

    def usage(self, tenant: str, now: float) -> Usage:
        state = self._tenants.get(tenant)
        if state is None:
            return Usage()
        self._expire(state, now)
        return Usage(state.in_flight, state.queued_tokens, state.window_tokens)

    def tenants(self) -> list[str]:
        return list(self._tenants)

    # ---- inside --------------------------------------------------------------------

    def _tenant(self, tenant: str, now: float) -> _Tenant:
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant()
        self._expire(state, now)
        return state

    def _expire(self, state: _Tenant, now: float) -> None:
        """Spends admitted more than the window ago leave it."""
        while state.window and state.window[0].time <= now - self.window_s:
            spend = state.window.popleft()
            spend.in_window = False
            state.window_tokens -= spend.tokens

    def _check(self, limit: TenantLimit, state: _Tenant, prompt_tokens: int, cost: int,
               now: float) -> Refusal | None:
        busy = max(1, math.ceil(RETRY_BUSY_S))
        if limit.max_requests_in_flight is not None \
                and state.in_flight + 1 > limit.max_requests_in_flight:
            return Refusal("max_requests_in_flight", limit.max_requests_in_flight,
                           max(0, limit.max_requests_in_flight - state.in_flight), 1, busy, 0)
        if limit.max_queued_tokens is not None \
                and state.queued_tokens + prompt_tokens > limit.max_queued_tokens:
            return Refusal("max_queued_tokens", limit.max_queued_tokens,
                           max(0, limit.max_queued_tokens - state.queued_tokens),
                           prompt_tokens, busy, 0)
        tpm = limit.tokens_per_minute
        if tpm is not None and state.window_tokens + cost > tpm:
            return Refusal("tokens_per_minute", tpm, max(0, tpm - state.window_tokens), cost,
                           self._fits_in(state, cost - (tpm - state.window_tokens), now),
                           self._fits_in(state, state.window_tokens, now))
        return None

    def _fits_in(self, state: _Tenant, to_free: int, now: float) -> int:
        """Whole seconds until `to_free` tokens leave the tenant's window (the window's
        length when they never will: the request alone is over the limit)."""
        freed = 0
        for spend in state.window:
            freed += spend.tokens
            if freed >= to_free:
                return max(1, math.ceil(spend.time + self.window_s - now))
        return max(1, math.ceil(self.window_s))
