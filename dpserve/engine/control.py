"""EngineControl: one engine's side of pause / sleep (held by `EngineCoreProc`).

Scope: bring the `EngineCore` into a `ControlState` (rules in
`dpserve.control`), say whether the busy loop may step, and when the state
is reached (`done`: at once, except pause "wait", which is done once no
request is left). Transitions, in this order: abort the requests in flight
(pause "abort", or going to sleep), reset the prefix cache, then free or
restore memory (`EngineCore.sleep` / `wake_up`).

Requests that still reach an engine that is paused "abort" or asleep (sent
before the front-end heard of it) end at once with ABORT; under "keep" they
queue and run after resume.
"""

from __future__ import annotations

import logging

from dpserve.engine.core import EngineCore
from dpserve.protocol import ControlState, EngineCoreOutput

logger = logging.getLogger(__name__)


class EngineControl:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.state = ControlState()

    def apply(self, new: ControlState) -> list[EngineCoreOutput]:
        """Move to `new`; returns the final outputs of the requests it aborted."""
        old, core = self.state, self.core
        if new == old:
            return []
        aborted: list[EngineCoreOutput] = []
        if (new.paused == "abort" and old.paused != "abort") or \
                (new.sleep_level > 0 and old.sleep_level == 0):
            aborted = core.abort_requests(core.unfinished_request_ids())
        if new.prefix_resets > old.prefix_resets and not core.reset_prefix_cache():
            logger.warning("reset_prefix_cache: requests still hold blocks; cache kept")
        if new.sleep_level != old.sleep_level:
            if new.sleep_level == 0:
                core.wake_up()
            else:
                core.sleep(new.sleep_level)
        self.state = new
        logger.info("control state %d: paused=%s sleep_level=%d (%d request(s) aborted)",
                    new.seq, new.paused, new.sleep_level, len(aborted))
        return aborted

    @property
    def can_step(self) -> bool:
        """May the busy loop run the engine (paused "abort"/"keep" or asleep: no)."""
        return self.state.sleep_level == 0 and self.state.paused in (None, "wait")

    @property
    def rejects_new(self) -> bool:
        """New requests end at once with ABORT (paused "abort", or asleep)."""
        return self.state.sleep_level > 0 or self.state.paused == "abort"

    @property
    def done(self) -> bool:
        """The state is reached (pause "wait": no request left)."""
        return self.state.paused != "wait" or not self.core.has_unfinished_requests()
