"""Messages between the front-end and an engine.

Every message is a msgspec Struct so it can be sent as msgpack without
pickle. In-process (the offline `LLM`) the same objects are passed directly.
"""

from __future__ import annotations

import msgspec

from dpserve.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A tokenised request, ready for the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
