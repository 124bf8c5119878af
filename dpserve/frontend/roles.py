"""Prefill / decode roles of the DP ranks, and which requests are handed off.

Scope (IO-free, pure): `--data-parallel-roles prefill:P,decode:D` resolved
(`dpserve.placement.data_parallel_roles`) to `Roles(P)`: ranks [0, P) prefill,
every other rank decode. The rule holds whatever the rank count is now, so it
follows elastic scaling without any news: scaling adds and removes ranks at the
top, which are decode ranks (a new rank decodes unless it is one of the first
P, i.e. prefill ranks are missing); below P + 1 ranks there is no decode rank
and the prefill ranks serve colocated. Every front-end (and anyone else who
knows P) computes the same roles; the coordinator needs none.

A request is handed off (`can_hand_off`: its first leg on a prefill rank, the
rest on a decode rank) unless it is pinned (`X-data-parallel-rank`), a pooling
request (nothing to decode), asks for prompt logprobs (the decode rank would
compute the prompt again: no prefix-cache hit for those), wants one token
(`max_tokens` 1: the prefill rank is done), or has no room for a second token.
`first_leg` is what the prefill rank gets: the same request stopping after one
token (`max_tokens` 1, `min_tokens` at most 1: the first token is drawn under
the same rules) with `do_remote_decode` set, so its engine commits the prompt's
blocks to the host's KV tier before that token leaves (`EngineCore.step`).

Not here: placement by role (`dpserve.frontend.rank_table`), the flight's phases
(`dpserve.frontend.migration`), sending the continuation (`dpserve.frontend.handoff`).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from dpserve.protocol import EngineCoreRequest

PREFILL, DECODE, BOTH = "prefill", "decode", "both"


@dataclass(frozen=True)
class Roles:
    """Ranks [0, prefill) prefill, the others decode (module docstring)."""

    prefill: int

    def role_of(self, rank: int) -> str:
        return PREFILL if rank < self.prefill else DECODE


def roles_of(counts: tuple[int, int] | None) -> Roles | None:
    """`ParallelConfig.data_parallel_roles` (prefill, decode) -> Roles (None: off)."""
    return Roles(counts[0]) if counts is not None else None


def can_hand_off(request: EngineCoreRequest, max_model_len: int | None) -> bool:
    """Whether the request runs as a prefill leg and a decode leg (module docstring)."""
    params = request.sampling_params
    room = max_model_len is None or len(request.prompt_token_ids) + 1 < max_model_len
    return (request.data_parallel_rank is None and request.pooling is None
            and params.prompt_logprobs is None and params.max_tokens != 1
            and not request.prior_output_token_ids and room)


def first_leg(request: EngineCoreRequest) -> EngineCoreRequest:
    """The request as its prefill rank runs it: one token, then the handoff."""
    params = msgspec.structs.replace(request.sampling_params, max_tokens=1,
                                     min_tokens=min(request.sampling_params.min_tokens, 1))
    return msgspec.structs.replace(request, sampling_params=params, do_remote_decode=True)
