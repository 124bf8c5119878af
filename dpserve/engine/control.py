"""EngineControl: one engine's side of pause / sleep (held by `EngineCoreProc`).

Scope: bring the `EngineCore` into a `ControlState` (rules in
`dpserve.control`), say whether the busy loop may step, and when the state
is reached (`done`: at once, except pause "wait", which is done once no
request is left). Transitions, in this order: abort the requests in flight
(pause "abort", or going to sleep), reset the prefix cache, then free or
restore memory (`EngineCore.sleep` / `wake_up`).

`ControlCalls` is the engine process's side: `control(op, arg, token)` utility
calls on an engine without a coordinator, each answered once its state is
reached, and the "reached" report to the coordinator.

Requests that still reach an engine that is paused "abort" or asleep (sent
before the front-end heard of it) end at once with ABORT; under "keep" they
queue and run after resume.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec

from dpserve.control import next_state
from dpserve.engine.core import EngineCore
from dpserve.protocol import (
    ControlChange,
    ControlState,
    EngineCoreOutput,
    EngineCoreOutputs,
    UtilityCall,
    UtilityOutput,
)

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


class ControlCalls:
    """`control(op, arg, token)` utility calls and the answers once a state is reached.

    `send(client, outputs)` queues a message to one front-end, `publish(outputs)`
    sends request outputs to their front-ends, `report_done(seq)` (DP) tells the
    coordinator that this engine reached ControlState `seq`.
    """

    def __init__(self, control: EngineControl, rank: int, num_clients: int,
                 send: Callable[[int, EngineCoreOutputs], None],
                 publish: Callable[[list[EngineCoreOutput]], None],
                 report_done: Callable[[int], None] | None) -> None:
        self.control = control
        self.rank = rank
        self.num_clients = num_clients
        self._send = send
        self._publish = publish
        self._report_done = report_done
        self._acked = 0  # the ControlState seq reported reached
        self._waiters: list[tuple[int, int]] = []  # (client, call_id) of unanswered calls

    def call(self, call: UtilityCall, client_index: int) -> None:
        """Without a coordinator: change this engine's state, tell every front-end,
        answer once the state is reached (`check`)."""
        try:
            state = next_state(self.control.state, ControlChange(*call.args))
        except (TypeError, ValueError) as e:
            self._send(client_index, EngineCoreOutputs(
                engine_index=self.rank, utility_output=UtilityOutput(
                    call.call_id, failure_message=f"control() failed: {e}")))
            return
        self._publish(self.control.apply(state))
        for client in range(self.num_clients):
            self._send(client, EngineCoreOutputs(
                engine_index=self.rank, control=state, timestamp=time.monotonic()))
        self._waiters.append((client_index, call.call_id))
        self.check()

    def check(self) -> None:
        """Once the control state is reached: tell the coordinator, answer waiters."""
        state = self.control.state
        if self._acked == state.seq or not self.control.done:
            return
        self._acked = state.seq
        if self._report_done is not None:
            self._report_done(state.seq)
        result = msgspec.to_builtins(state)
        for client, call_id in self._waiters:
            self._send(client, EngineCoreOutputs(
                engine_index=self.rank, utility_output=UtilityOutput(call_id, result=result),
                timestamp=time.monotonic()))
        self._waiters.clear()
