"""`--tenant-limits FILE`: each tenant's limits, read and checked once.

Scope: `TenantLimit` (one tenant's three limits; None: no limit of that kind),
`TenantLimits` (by tenant name, and the `default` entry for every tenant not
named), `load_tenant_limits` (the JSON file -> `TenantLimits`, or a one-line
ConfigError naming `--tenant-limits` and the bad entry) and `TENANT_NAME`, the
shape of a tenant's name (also what `--tenant-header`'s value must match).

The file is one JSON object: tenant name -> its limits, `"default"` for the
tenants not named (no `default`: they have no limits). A named entry stands
alone: a limit it leaves out is no limit for that tenant (it does not inherit
the default's).

    {"default": {"max_requests_in_flight": 4, "tokens_per_minute": 20000},
     "alice":   {"max_requests_in_flight": 16, "tokens_per_minute": 200000,
                 "max_queued_tokens": 8192}}

Not here: counting usage against them (`dpserve.tenancy.ledger`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from dpserve.errors import ConfigError

OPTION = "--tenant-limits"
DEFAULT = "default"  # the entry for tenants not named, and the tenant of anonymous requests
TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
LIMIT_NAMES = ("max_requests_in_flight", "tokens_per_minute", "max_queued_tokens")


@dataclass(frozen=True)
class TenantLimit:
    """One tenant's limits (None: no limit of that kind)."""

    max_requests_in_flight: int | None = None  # requests admitted and not finished
    tokens_per_minute: int | None = None  # prompt + generated tokens, sliding 60 s window
    max_queued_tokens: int | None = None  # prompt tokens admitted, no first token yet

    @property
    def any(self) -> bool:
        return any(getattr(self, name) is not None for name in LIMIT_NAMES)


NO_LIMIT = TenantLimit()


@dataclass(frozen=True)
class TenantLimits:
    """Every tenant's limits: `named` by tenant name, `default` for the others."""

    named: dict[str, TenantLimit] = field(default_factory=dict)
    default: TenantLimit = NO_LIMIT

    def of(self, tenant: str) -> TenantLimit:
        return self.named.get(tenant, self.default)

    @property
    def names(self) -> frozenset[str]:
        """The tenants the file names (`default` included when given)."""
        return frozenset(self.named) | ({DEFAULT} if self.default.any else frozenset())


def load_tenant_limits(path: str) -> TenantLimits:
    """The limits of a `--tenant-limits` file (module docstring); ConfigError naming the
    option and the bad entry on anything else."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{OPTION} {path}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{OPTION} {path}: not valid JSON: {e.msg} (line {e.lineno}, "
                          f"column {e.colno})") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{OPTION} {path}: expected a JSON object of tenant name -> "
                          f"limits, e.g. {{\"default\": {{\"max_requests_in_flight\": 4}}}}")
    named = {name: _limit(path, name, entry) for name, entry in data.items()}
    default = named.pop(DEFAULT, NO_LIMIT)
    return TenantLimits(named, default)


def _limit(path: str, name: object, entry: object) -> TenantLimit:
    where = f"{OPTION} {path}: tenant {name!r}"
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise ConfigError(f"{where}: a tenant name is 1 to 64 letters, digits, '.', '_' "
                          f"or '-'")
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected an object of limits ({', '.join(LIMIT_NAMES)})")
    unknown = sorted(set(entry) - set(LIMIT_NAMES))
    if unknown:
        raise ConfigError(f"{where}: unknown limit {unknown[0]!r} (known: "
                          f"{', '.join(LIMIT_NAMES)})")
    for key, value in entry.items():
        if value is not None and (type(value) is not int or value < 1):
            raise ConfigError(f"{where}: {key} must be a positive integer (or null: no "
                              f"limit), got {json.dumps(value)}")
    return TenantLimit(**entry)
