"""The spans of a traced request's placement: `route` (which rank, and why) and `migrate`.

Scope (only for a request with a trace context, `EngineCoreRequest.trace_headers`; an
untraced request never reaches this module): `RouteTrace`, which the engine client
holds around one placement: its span `route`, a child of the API request's span,
from before the choice to after the send, with

* `dpserve.route.rank` (the rank chosen), `dpserve.route.reason`: `pinned`
  (X-data-parallel-rank), `session` (its session's rank), `cache_hit` (the longest
  remembered prefix, `dpserve.route.cache_blocks` blocks), `tier` (the host tier holds
  the prefix), `adapter` (its LoRA adapter is warm there), `least_loaded` (no prefix
  anywhere, or its owner hot; and the least-loaded policy), `round_robin`;
  `dpserve.route.session_moved` when its session's rank could not take it;
* each candidate's figures, as the router saw them before choosing:
  `dpserve.rank.<i>.load` (`Router.load`), `dpserve.rank.<i>.cache_blocks` (prefix
  blocks it is thought to hold), `.tier_blocks` (with a host tier), `.adapter_tier`
  (3 resident .. 0 cold, for a LoRA request);

and the request as sent carries the route span's context, so the engine's spans are its
children. The reason is read from the router's own counters (before / after), so the
router's code is the same traced or not.

`migrate_span`: a request moved to another rank (its rank died or stopped serving, or a
prefill/decode handoff) gets a span `migrate` (from, to, why, tokens so far), a child
of the placement it leaves and linked to it, and goes on carrying that span's context:
the second engine's spans join the same trace under it.

Not here: the choice itself (`dpserve.frontend.routing`, `dpserve.frontend.rank_table`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from dpserve.frontend.migration import Move
from dpserve.frontend.rank_table import EngineState, RankTable
from dpserve.frontend.routing import LoadView, Router, cache_root, host_of
from dpserve.protocol import EngineCoreRequest

_COUNTERS = ("session_routed", "session_moved", "cache_routed", "load_routed",
             "tier_routed", "adapter_warm")


class RouteTrace:
    """One traced placement (module docstring): `choose`, `carried_by`, then the span
    ends (`end`, or leaving its `with` block)."""

    def __init__(self, table: RankTable, request: EngineCoreRequest) -> None:
        from dpserve.tracing.spans import start_span

        self.table = table
        self.request = request
        self.span = start_span("route", request.trace_headers,
                               attributes={"dpserve.route.policy": table.router.policy})

    def choose(self, exclude: int | None = None) -> EngineState:
        """`RankTable.choose`, with the span's attributes."""
        router, request = self.table.router, self.request
        chain = (router.tracker.hashes(request.prompt_token_ids, cache_root(request))
                 if router.policy == "cache-aware" else [])  # no prefix record otherwise
        candidates = self.table.placeable(exclude)
        self.span.set_attributes(_figures(router, candidates, request, chain,
                                          self.table.balanced))
        before = [getattr(router, name) for name in _COUNTERS]
        try:
            engine = self.table.choose(request, exclude)
        except BaseException as e:  # (the span ends as the caller's `with` block does)
            self.span.set_attribute("error.type", type(e).__name__)
            raise
        grew = {name for name, was in zip(_COUNTERS, before, strict=True)
                if getattr(router, name) > was}
        reason = _reason(router, request, grew)
        self.span.set_attributes({
            "dpserve.route.rank": engine.rank, "dpserve.route.reason": reason,
            "dpserve.route.cache_blocks": router.tracker.matched_blocks(engine.rank, chain)
            if reason == "cache_hit" else 0,
            "dpserve.route.session_moved": "session_moved" in grew,
            "dpserve.route.candidates": [e.rank for e in candidates]})
        if self.table.roles is not None:
            self.span.set_attribute("dpserve.route.role", self.table.role_of(engine.rank))
        return engine

    def carried_by(self, request: EngineCoreRequest) -> EngineCoreRequest:
        """`request` carrying the route span's context (the engine's spans' parent)."""
        from dpserve.tracing.spans import carrier_of

        return msgspec.structs.replace(request, trace_headers=carrier_of(self.span))

    def __enter__(self) -> RouteTrace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()

    def end(self) -> None:
        self.span.end()


def _figures(router: Router, candidates: list[EngineState], request: EngineCoreRequest,
             chain: list[Any], balanced: bool) -> dict[str, Any]:
    """Each candidate rank's figures as the router sees them before it chooses."""
    figures: dict[str, Any] = {}
    for engine in candidates:
        key = f"dpserve.rank.{engine.rank}"
        matched = router.tracker.matched_blocks(engine.rank, chain)
        figures[f"{key}.load"] = router.load(engine, LoadView(balanced, request.priority))
        figures[f"{key}.cache_blocks"] = matched
        if router.tier is not None:
            figures[f"{key}.tier_blocks"] = router.tier.matched_blocks(host_of(engine), chain,
                                                                       matched)
        if request.lora_name is not None:
            figures[f"{key}.adapter_tier"] = router.adapters.tier(engine, request.lora_name)
    return figures


def _reason(router: Router, request: EngineCoreRequest, grew: set[str]) -> str:
    """Why the router chose as it did, from which of its counters moved."""
    if request.data_parallel_rank is not None:
        return "pinned"
    if "session_routed" in grew:
        return "session"
    if "cache_routed" in grew:
        return "cache_hit"
    if "tier_routed" in grew:
        return "tier"
    if request.lora_name is not None and "adapter_warm" in grew:
        return "adapter"
    return "round_robin" if router.policy == "round-robin" else "least_loaded"


def migrate_span(move: Move, why: str) -> Move:
    """A `migrate` span for a traced move (module docstring); the move carrying it."""
    from dpserve.tracing.spans import carrier_of, link_to, start_span

    carrier = move.request.trace_headers or {}
    span = start_span("migrate", carrier, links=link_to(carrier), attributes={
        "dpserve.migrate.from_rank": move.source, "dpserve.migrate.to_rank": move.target,
        "dpserve.migrate.why": why, "dpserve.migrate.tokens": move.num_tokens})
    span.end()  # a moment: the engine's spans under it show the time it takes there
    return dataclasses.replace(move, request=msgspec.structs.replace(
        move.request, trace_headers=carrier_of(span)))
