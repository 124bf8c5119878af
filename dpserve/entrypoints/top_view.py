"""What `dpserve top` shows, from two polls of a server: pure (no IO, no clock).

Scope: `parse_metrics` (Prometheus text -> `Metrics`), `Poll` (one answer of
GET /engines and GET /metrics, with the time it came), `view_of(url, previous,
current)` -> `View` (the header figures, one `RankRow` per rank, the tenants'
`TenantTable`), and `render(view, status, boxed)` -> the rich renderable (boxed:
the live terminal; not boxed: `--once`'s plain text, columns separated by
spaces, `-` where a figure is unknown, so scripts can split it).

Where the figures come from:

* header: the model (the `model_name` label of `dpserve:*` series), uptime (now -
  `process_start_time_seconds` of the API server that answered /metrics), the DP
  size and running / waiting requests (/engines, summed over ranks), tokens/s out
  and in (the difference of `dpserve:generation_tokens_total` /
  `dpserve:prompt_tokens_total` between the two polls over the time between
  them), requests finished and tokens so far (those counters);
* per rank (/engines, joined with the series whose `engine` label is the rank):
  state, cordon, waiting, running, KV cache usage, prefix-cache hit rate since
  start (`dpserve:prefix_cache_hit_rate`), tokens/s (/engines' `tokens_per_s`:
  the coordinator's figure over its last few seconds; no per-engine token counter
  exists), requests finished (`dpserve:engine_requests_finished_total`) and per
  second between the polls, role, restarts;
* tenants: every `dpserve:tenant_*` family present, one row per `tenant` label,
  one column per series (its labels but `tenant` / `model_name` name the column):
  counters and gauges as their value, histograms and summaries as their mean
  (`_sum / _count`). No such series: no table.

A counter that went down between polls (a restarted API server) counts from 0:
the rate is its new value over the time (Prometheus' `rate()` does the same).
Text from the server (states, roles, tenant names, label values) is shown without
control characters and cut to `_MAX_TEXT` (the model's name: `_MAX_MODEL`): a
tenant name may be the client's to pick.

Not here: HTTP, the terminal, the clock (`dpserve.entrypoints.top`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

TENANT_PREFIX = "dpserve:tenant_"
_MAX_TEXT = 40  # characters of any server-given text shown (but the model's name)
_MAX_MODEL = 120
_MAX_TENANTS = 50  # rows of the tenants table (the rest are counted)
_HIDDEN_LABELS = ("tenant", "model_name", "le", "quantile")  # not part of a column's name

Labels = dict[str, str]


@dataclass(frozen=True)
class Metrics:
    """One /metrics answer: sample name -> [(labels, value)], family name -> type."""

    samples: dict[str, list[tuple[Labels, float]]] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)

    def total(self, name: str, **match: str) -> float | None:
        """The sum of `name`'s samples whose labels include `match`; None: none."""
        values = [v for labels, v in self.samples.get(name, ())
                  if all(labels.get(k) == want for k, want in match.items())]
        return sum(values) if values else None

    def label(self, name: str) -> str | None:
        """The first value of label `name` on any sample (e.g. the model's name)."""
        for samples in self.samples.values():
            for labels, _ in samples:
                if name in labels:
                    return labels[name]
        return None


def parse_metrics(text: str) -> Metrics:
    """Prometheus text exposition -> `Metrics` (ValueError: not that format)."""
    samples: dict[str, list[tuple[Labels, float]]] = defaultdict(list)
    types = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[s.name].append((dict(s.labels), float(s.value)))
    return Metrics(dict(samples), types)


@dataclass(frozen=True)
class Poll:
    """GET /engines (its JSON) and GET /metrics, answered at `at` (a monotonic clock,
    seconds) and `wall` (Unix time)."""

    at: float
    wall: float
    engines: dict[str, Any]
    metrics: Metrics


@dataclass(frozen=True)
class RankRow:
    """One DP rank's line (None: not known)."""

    rank: int
    state: str
    cordoned: bool
    waiting: int
    running: int
    kv_cache_usage: float  # 0-1
    prefix_hit_rate: float | None  # 0-1, since the engine started
    tokens_per_s: float
    finished: float | None  # requests finished by the rank (all API servers)
    finished_per_s: float | None  # between the two polls
    role: str
    restarts: int


@dataclass(frozen=True)
class TenantTable:
    """`dpserve:tenant_*` series: a column per series, a row per tenant (sorted by name)."""

    columns: list[str]
    rows: list[tuple[str, list[float | None]]]
    left_out: int = 0  # tenants past _MAX_TENANTS


@dataclass(frozen=True)
class View:
    """Everything one screen shows (module docstring: where each figure comes from)."""

    url: str
    model: str | None
    uptime_s: float | None
    data_parallel_size: int
    running: int
    waiting: int
    tokens_per_s: float | None  # generated, between the two polls
    prompt_tokens_per_s: float | None
    finished: float | None  # requests finished (all reasons)
    generated: float | None  # tokens generated so far
    prompted: float | None  # prompt tokens so far
    ranks: list[RankRow]
    tenants: TenantTable | None


def rate(previous: float | None, current: float | None, seconds: float) -> float | None:
    """A counter's increase per second; a counter that went down restarted from 0."""
    if previous is None or current is None or seconds <= 0:
        return None
    return (current - previous if current >= previous else current) / seconds


def view_of(url: str, previous: Poll | None, current: Poll) -> View:
    """The screen for `current`, with rates since `previous` (None: no rates yet)."""
    m = current.metrics
    dt = current.at - previous.at if previous is not None else 0.0
    before = previous.metrics if previous is not None else None

    def counter_rate(name: str) -> float | None:
        return rate(before.total(name) if before else None, m.total(name), dt)

    start = m.total("process_start_time_seconds")
    rows = [_rank_row(e, m, before, dt) for e in current.engines.get("engines", [])]
    return View(url=url, model=_clean(m.label("model_name"), _MAX_MODEL) or None,
                uptime_s=current.wall - start if start else None,
                data_parallel_size=int(current.engines.get("data_parallel_size", len(rows))),
                running=sum(r.running for r in rows), waiting=sum(r.waiting for r in rows),
                tokens_per_s=counter_rate("dpserve:generation_tokens_total"),
                prompt_tokens_per_s=counter_rate("dpserve:prompt_tokens_total"),
                finished=m.total("dpserve:request_success_total"),
                generated=m.total("dpserve:generation_tokens_total"),
                prompted=m.total("dpserve:prompt_tokens_total"),
                ranks=rows, tenants=tenant_table(m))


def _rank_row(engine: dict[str, Any], m: Metrics, before: Metrics | None,
              dt: float) -> RankRow:
    rank = int(engine["rank"])
    finished_name = "dpserve:engine_requests_finished_total"
    finished = m.total(finished_name, engine=str(rank))
    return RankRow(
        rank=rank, state=_clean(engine.get("state")), cordoned=bool(engine.get("cordoned")),
        waiting=int(engine.get("waiting", 0)), running=int(engine.get("running", 0)),
        kv_cache_usage=float(engine.get("kv_cache_usage", 0.0)),
        prefix_hit_rate=m.total("dpserve:prefix_cache_hit_rate", engine=str(rank)),
        tokens_per_s=float(engine.get("tokens_per_s", 0.0)), finished=finished,
        finished_per_s=rate(before.total(finished_name, engine=str(rank)) if before else None,
                            finished, dt),
        role=_clean(engine.get("role") or "both"), restarts=int(engine.get("restarts", 0)))


def tenant_table(m: Metrics) -> TenantTable | None:
    """Every `dpserve:tenant_*` family as columns, a row per tenant; None: no such series."""
    cells: dict[str, dict[str, float | None]] = defaultdict(dict)  # tenant -> column -> value
    columns: list[str] = []
    for family, kind in sorted(m.types.items()):
        if not family.startswith(TENANT_PREFIX) or family.endswith("_created"):
            continue
        short = family[len(TENANT_PREFIX):]
        for (tenant, extra), value in _tenant_values(m, family, kind).items():
            column = short + (f"{{{extra}}}" if extra else "")
            if column not in columns:
                columns.append(column)
            cells[tenant][column] = value
    if not columns:
        return None
    columns.sort()
    tenants = sorted(cells)
    rows = [(t, [cells[t].get(c) for c in columns]) for t in tenants[:_MAX_TENANTS]]
    return TenantTable(columns, rows, max(0, len(tenants) - _MAX_TENANTS))


def _tenant_values(m: Metrics, family: str, kind: str
                   ) -> dict[tuple[str, str], float | None]:
    """(tenant, the series' other labels as text) -> the value shown for `family`."""
    def by_series(sample: str) -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = defaultdict(float)
        for labels, value in m.samples.get(sample, ()):
            if "tenant" in labels:
                extra = ",".join(f"{k}={_clean(v)}" for k, v in sorted(labels.items())
                                 if k not in _HIDDEN_LABELS)
                out[(_clean(labels["tenant"]), extra)] += value
        return out

    if kind in ("histogram", "summary"):
        sums, counts = by_series(family + "_sum"), by_series(family + "_count")
        return {key: (sums.get(key, 0.0) / n if n else None) for key, n in counts.items()}
    return dict(by_series(family + "_total" if kind == "counter" else family))


def _clean(text: Any, most: int = _MAX_TEXT) -> str:
    """Server-given text, fit to show: printable characters only, at most `most`."""
    shown = "".join(c if c.isprintable() else "?" for c in str(text or ""))
    return shown if len(shown) <= most else shown[:most - 1] + "~"


def render(view: View | None, status: str | None, boxed: bool) -> RenderableType:
    """The header, the ranks' table and the tenants' (when there are tenant series);
    `status` (e.g. "reconnecting") is a line under the header."""
    parts: list[RenderableType] = []
    if view is not None:
        parts += _header(view)
    if status:
        parts.append(Text(status, style="bold red" if boxed else ""))
    if view is not None:
        parts.append(_ranks_table(view.ranks, boxed))
        if view.tenants is not None:
            parts.append(_tenants_table(view.tenants, boxed))
    return Group(*parts)


def _header(v: View) -> list[RenderableType]:
    up = _duration(v.uptime_s) if v.uptime_s is not None else "-"
    return [
        Text(f"dpserve top  {v.url}  model {v.model or '-'}  up {up}  "
             f"data parallel {v.data_parallel_size}"),
        Text(f"tokens/s out {_num(v.tokens_per_s, 1)}  in {_num(v.prompt_tokens_per_s, 1)}"
             f"  requests running {v.running}  waiting {v.waiting}  finished "
             f"{_num(v.finished)}  tokens generated {_num(v.generated)}  prompt "
             f"{_num(v.prompted)}")]


def _ranks_table(ranks: list[RankRow], boxed: bool) -> Table:
    table = _table("ranks", boxed, ["rank", "state", "cordoned", "waiting", "running",
                                    "kv_cache", "prefix_hit", "tokens/s", "finished",
                                    "finished/s", "role", "restarts"])
    for r in ranks:
        table.add_row(str(r.rank), _state(r.state, boxed), "yes" if r.cordoned else "no",
                      str(r.waiting), str(r.running), _pct(r.kv_cache_usage),
                      _pct(r.prefix_hit_rate), _num(r.tokens_per_s, 1), _num(r.finished),
                      _num(r.finished_per_s, 2), r.role, str(r.restarts))
    return table


def _tenants_table(tenants: TenantTable, boxed: bool) -> Table:
    table = _table("tenants", boxed, ["tenant", *tenants.columns])
    for name, values in tenants.rows:
        table.add_row(Text(name), *(_num(v, 3 if v is not None and v % 1 else 0)
                                    for v in values))
    if tenants.left_out:
        table.caption = f"and {tenants.left_out} more tenants"
    return table


def _table(title: str, boxed: bool, columns: list[str]) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAVY if boxed else None,
                  pad_edge=False, show_edge=boxed, title_justify="left",
                  header_style="bold" if boxed else "")
    for i, name in enumerate(columns):
        table.add_column(Text(name), justify="left" if i == 0 or name in (
            "state", "role", "tenant") else "right", no_wrap=True)
    return table


_STATE_STYLES = {"serving": "green", "starting": "yellow", "draining": "yellow",
                 "restarting": "yellow", "unhealthy": "red", "dead": "bold red"}


def _state(state: str, boxed: bool) -> Text:
    return Text(state, style=_STATE_STYLES.get(state, "") if boxed else "")


def _num(value: float | None, decimals: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:.{decimals}f}" if decimals else str(round(value))


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def _duration(seconds: float) -> str:
    s = max(0, int(seconds))
    days, s = divmod(s, 86400)
    text = f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{days}d {text}" if days else text
