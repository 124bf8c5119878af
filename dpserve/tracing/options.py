"""The tracing options: `TracingArgs` (the flags), `TracingConfig` (frozen), the check.

Scope: `--otlp-traces-endpoint` (vLLM's name) and `--trace-file`, fields of
`dpserve.config.EngineArgs` (which extends `TracingArgs`: every process that makes
spans, API servers and engines, gets them in its `EngineConfig.tracing`), checked when
the options are made (a URL, an existing directory, the SDK installed: ConfigError
naming the option otherwise), without importing opentelemetry.

Not here: using them (`dpserve.tracing.install`).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

from dpserve.errors import ConfigError

EXTRA_HINT = "pip install 'dpserve[tracing]'"
GROUP = "tracing"  # the `dpserve serve --help` group of these options


@dataclass(frozen=True)
class TracingConfig:
    """Where this server's spans go (at least one of the two is set)."""

    otlp_traces_endpoint: str | None = None  # OTLP/HTTP, e.g. http://host:4318/v1/traces
    trace_file: str | None = None  # JSONL, one span per line, appended by every process


@dataclass
class TracingArgs:
    """The tracing options as users pass them (`EngineArgs` has them: its base)."""

    otlp_traces_endpoint: str | None = field(default=None, metadata={"help": (
        "Send OpenTelemetry traces of requests (API server, routing, engine spans) to this "
        "OTLP/HTTP endpoint, e.g. http://localhost:4318/v1/traces. Needs "
        f"{EXTRA_HINT}."), "group": GROUP})
    trace_file: str | None = field(default=None, metadata={"help": (
        "Append the same spans to this JSONL file (one span per line; every process "
        "of the server appends to it)."), "group": GROUP})

    def __post_init__(self) -> None:
        self.tracing_config()

    def tracing_config(self) -> TracingConfig | None:
        """The options checked (None: tracing off); ConfigError naming the option."""
        return tracing_config(self)


def tracing_config(options: Any) -> TracingConfig | None:
    """The tracing options of `options` (`EngineArgs`: its `otlp_traces_endpoint` and
    `trace_file`) checked (None: tracing off); ConfigError naming the option."""
    otlp_traces_endpoint, trace_file = options.otlp_traces_endpoint, options.trace_file
    if otlp_traces_endpoint is None and trace_file is None:
        return None
    if otlp_traces_endpoint is not None:
        if not otlp_traces_endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"otlp_traces_endpoint must be an http:// or https:// URL (the "
                              f"OTLP/HTTP traces endpoint), got {otlp_traces_endpoint!r}")
        _need_module("opentelemetry.exporter.otlp.proto.http", "otlp_traces_endpoint")
    if trace_file is not None:
        parent = os.path.dirname(os.path.abspath(trace_file))
        if not os.path.isdir(parent):
            raise ConfigError(f"trace_file {trace_file!r}: no directory {parent!r}")
    _need_module("opentelemetry.sdk", "otlp_traces_endpoint" if otlp_traces_endpoint
                 else "trace_file")
    return TracingConfig(otlp_traces_endpoint, trace_file)


def _need_module(name: str, option: str) -> None:
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise ConfigError(f"{option} needs the OpenTelemetry SDK and OTLP exporter, which "
                          f"are not installed: {EXTRA_HINT}")
