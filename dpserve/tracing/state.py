"""This process's tracer, once `dpserve.tracing.install` made it (None: not tracing).

Scope: the one per-process holder (`THIS_PROCESS`; OpenTelemetry's provider is per
process too) and its readers `active`, `tracer`, `process_attributes`.

Not here: making it (`dpserve.tracing.install`), spans (`dpserve.tracing.spans`).
"""

from __future__ import annotations

from typing import Any


class _Tracing:
    """This process's tracer (`install`)."""

    def __init__(self) -> None:
        self.tracer: Any = None  # an opentelemetry Tracer once installed
        self.provider: Any = None
        self.attributes: dict[str, Any] = {}  # set on every span (rank, API server index)


THIS_PROCESS = _Tracing()


def active() -> bool:
    """Whether this process makes spans."""
    return THIS_PROCESS.tracer is not None


def tracer() -> Any:
    """This process's tracer (after `install`)."""
    assert THIS_PROCESS.tracer is not None, "tracing.install() first"
    return THIS_PROCESS.tracer


def process_attributes() -> dict[str, Any]:
    """The attributes every span of this process carries (its rank, its index)."""
    return THIS_PROCESS.attributes
