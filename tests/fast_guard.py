"""The test-fast guard: a test that `make test-fast` selects (one marked neither
`procs` nor `slow`) fails when it starts a process or opens the default 135M model.

Scope: the pytest plugin `FastGuard` (registered by conftest.py, in every run, so
`make test` keeps the markers honest too). A Python audit hook sees every process
start (`subprocess.Popen`, `os.fork`, `os.posix_spawn`, `os.exec*`, `os.spawn*`,
`os.system`; multiprocessing's fork start goes through `os.fork`), a patch of
`multiprocessing`'s `BaseProcess.start` sees its spawn and forkserver starts (they
call `_posixsubprocess` directly, with no audit event), and the audit hook's "open"
event sees any file of the default model opened: its GGUF file (dpserve.model.loader's
`DEFAULT_GGUF`) or its converted directory (named after the GGUF file's stem). The
start or the open is refused (the hook raises) and the test fails with a message
naming the test, what it started or opened, and the marker to add.

Before any test (`warm_up`), what a process would start lazily, once per process,
starts outside them, so which test starts it does not depend on the order or on a
cold cache: `platform.processor()` runs `uname -p` (the openai client asks for the
platform), and dpserve's CPU kernels are built (`cc`) into their cache, or found there.

Not here: the markers themselves (pyproject.toml) and which tests carry them.
"""

from __future__ import annotations

import multiprocessing.process
import os
import platform
import sys
from collections.abc import Generator
from pathlib import Path

import pytest

from dpserve.model.loader import DEFAULT_GGUF

FAST_EXCLUDED = ("procs", "slow")  # make test-fast runs `-m "not procs and not slow"`
PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn",
                            "os.spawn", "os.exec", "os.system"})
DEFAULT_MODEL_STEM = Path(DEFAULT_GGUF).stem  # "SmolLM2-135M-Instruct.Q4_1"


class FastGuardError(RuntimeError):
    """A test-fast test started a process or opened the default model."""


def is_fast(item: pytest.Item) -> bool:
    """Whether `make test-fast` selects `item` (it is marked neither procs nor slow)."""
    return not any(item.get_closest_marker(name) for name in FAST_EXCLUDED)


def _describe(event: str, args: tuple) -> str:
    if event == "subprocess.Popen":  # (executable, args, cwd, env)
        argv = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        return f"started a process ({event}: {' '.join(map(str, argv))[:200]})"
    if event in ("os.exec", "os.posix_spawn", "os.spawn", "os.system"):
        return f"started a process ({event}: {str(args)[:200]})"
    return f"forked the test process ({event})"


def warm_up() -> None:
    """Start, outside any test, what dpserve and its clients start once per process."""
    platform.processor()  # cached: `uname -p` runs here, not in the first openai client's test
    from dpserve.model import cpu_kernels

    cpu_kernels.available()  # cached: `cc` runs here on a cold cache, not in an engine's test


class FastGuard:
    """The plugin: tracks the test-fast item whose setup, call or teardown runs."""

    def __init__(self) -> None:
        warm_up()
        self.item: pytest.Item | None = None
        self.found: list[str] = []
        self._start = multiprocessing.process.BaseProcess.start
        sys.addaudithook(self._audit)  # for the whole run: audit hooks cannot be removed
        guard = self

        def start(process: multiprocessing.process.BaseProcess) -> None:
            if guard.item is not None:
                target = getattr(process, "_target", None)
                guard._refuse(f"started a multiprocessing process ({process.name}, "
                              f"target {getattr(target, '__qualname__', target)})", "procs")
            guard._start(process)

        multiprocessing.process.BaseProcess.start = start  # type: ignore[method-assign]

    def _audit(self, event: str, args: tuple) -> None:
        if self.item is None:
            return
        if event in PROCESS_EVENTS:
            self._refuse(_describe(event, args), "procs")
        elif event == "open" and isinstance(args[0], (str, bytes)):
            path = os.fsdecode(args[0])
            if DEFAULT_MODEL_STEM in path:
                self._refuse(f"opened the default 135M model ({path})", "slow")

    def _refuse(self, what: str, marker: str) -> None:
        nodeid = self.item.nodeid if self.item is not None else "?"
        message = (f"{nodeid}: a test-fast test (marked neither procs nor slow) {what}. "
                   "`make test-fast` starts no process and loads no default model: mark the "
                   f"test `@pytest.mark.{marker}` (markers in pyproject.toml), or make it not "
                   "do that")
        self.found.append(message)
        raise FastGuardError(message)

    def _phase(self, item: pytest.Item) -> Generator[None, object, object]:
        self.item, self.found = (item if is_fast(item) else None), []
        try:
            return (yield)
        finally:
            self.item = None
            if self.found:
                pytest.fail("\n".join(dict.fromkeys(self.found)), pytrace=False)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, object, object]:
        return (yield from self._phase(item))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, object, object]:
        return (yield from self._phase(item))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, object, object]:
        return (yield from self._phase(item))
