"""Error types shared across packages (kept here so no import loop needs them)."""


class ConfigError(ValueError):
    """A bad option; the message names it."""


class TensorParallelError(RuntimeError):
    """A tensor-parallel collective failed, or a TP worker died or froze: the DP
    rank cannot step any more and goes down as a group (raised by
    `dpserve.model.tensor_parallel` and the engine's executor)."""


class ExpertParallelError(RuntimeError):
    """An expert-parallel collective failed (a peer rank died or froze): the step's
    results are lost (raised by `dpserve.model.expert_parallel`)."""
