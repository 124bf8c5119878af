"""Pause / sleep state: the pure rules, shared by the coordinator and the engines.

Scope: what an operator's change (`ControlChange`: pause, resume, sleep,
wake_up, reset_prefix_cache) makes of the current `ControlState`. Who keeps
the state: the DP coordinator when there is one (it broadcasts every change
to every engine and publishes it to every API server), else each engine
(changed by a utility call, announced on every output socket). Engines apply
a state with `dpserve.engine.control.EngineControl`.

Meaning (what an engine does in a state):
* paused "abort": its requests end now (finish reason abort); no steps.
* paused "wait": requests in flight run to the end; the front-ends take no new
  ones. The change is done (acknowledged) once the engine holds none.
* paused "keep": no steps; requests keep their KV and go on after resume.
* sleep level 1: its requests end (abort), the KV cache memory is freed;
  level 2: the weights too (CUDA: to host memory; CPU: reloaded on wake_up).
* prefix_resets counting up: forget every cached prefix block.
"""

from __future__ import annotations

import msgspec

from dpserve.protocol import ControlChange, ControlState

PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_LEVELS = (1, 2)
CONTROL_OPS = ("pause", "resume", "sleep", "wake_up", "reset_prefix_cache")


def check_change(change: ControlChange) -> None:
    """Raise ValueError (naming the parameter) for a change that makes no sense."""
    if change.op not in CONTROL_OPS:
        raise ValueError(f"unknown control op {change.op!r}")
    if change.op == "pause" and change.arg not in PAUSE_MODES:
        raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {change.arg!r}")
    if change.op == "sleep" and change.arg not in SLEEP_LEVELS:
        raise ValueError(f"level must be 1 or 2, got {change.arg!r}")


def next_state(state: ControlState, change: ControlChange) -> ControlState:
    """The state after `change` (validated by `check_change`); `seq` counts up."""
    check_change(change)
    fields: dict = {"seq": state.seq + 1, "token": change.token}
    if change.op == "pause":
        fields["paused"] = change.arg
    elif change.op == "resume":
        fields["paused"] = None
    elif change.op == "sleep":
        fields["sleep_level"] = change.arg
    elif change.op == "wake_up":
        fields["sleep_level"] = 0
    else:
        fields["prefix_resets"] = state.prefix_resets + 1
    return msgspec.structs.replace(state, **fields)
