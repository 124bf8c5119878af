"""Error types shared across packages (kept here so no import loop needs them)."""


class ConfigError(ValueError):
    """A bad option; the message names it."""
