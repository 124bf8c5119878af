"""Error types shared across packages (kept here so no import loop needs them)."""


class ConfigError(ValueError):
    """A bad option; the message names it."""


class ExpertParallelError(RuntimeError):
    """An expert-parallel collective failed (a peer rank died or froze): the step's
    results are lost (raised by `dpserve.model.expert_parallel`)."""
