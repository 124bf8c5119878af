"""Helpers for dpserve's own tests and benchmarks (not used at serving time)."""
