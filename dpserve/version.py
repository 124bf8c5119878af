"""The package version (a leaf module, so any layer may name it)."""

__version__ = "0.1.0"
