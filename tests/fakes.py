"""Named fakes shared by test modules, and the requests the routing tests hand them.

* `FakeEngineState`: a FAKE of the front end's per-engine `EngineState`
  (`dpserve.frontend.rank_table`), holding only what the Router reads: the load
  figures, the engine's last `SchedulerStats` and its `EngineInfo`. `engines(n,
  **loads)` makes ranks 0..n-1 with the same loads.
* `request(tokens)`: an engine request with default sampling; `prompt(session, turn)`:
  session `session`'s shared prefix (full blocks of `BS` tokens), then its turn.

Imported by test modules as `from fakes import ...` (tests/ is on sys.path).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dpserve.protocol import EngineCoreRequest, EngineInfo, SchedulerStats
from dpserve.sampling_params import SamplingParams

BS = 4  # the block size of the routing tests


@dataclass
class FakeEngineState:
    """A named fake of `EngineState`: only what the router reads."""

    rank: int
    num_requests: int = 0
    waiting: int = 0
    running: int = 0
    sent_since_publish: int = 0
    stats: SchedulerStats | None = None
    info: EngineInfo = field(default_factory=EngineInfo)


def engines(n: int = 2, **loads: int) -> list[FakeEngineState]:
    return [FakeEngineState(r, **loads) for r in range(n)]


def request(tokens: list[int]) -> EngineCoreRequest:
    return EngineCoreRequest("r", tokens, SamplingParams())


def prompt(session: int, turn: int, prefix_blocks: int = 6) -> list[int]:
    """Session `session`'s shared prefix (prefix_blocks full blocks), then its turn."""
    return [1000 * session + i for i in range(prefix_blocks * BS)] + [7, turn, turn, 9]
