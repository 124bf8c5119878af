"""The test-fast guard: a test that `make test-fast` selects (one marked neither
`procs` nor `slow`) fails when it starts a process or opens the default 135M model.

Scope: the pytest plugin `FastGuard` (registered by conftest.py, in every run, so
`make test` keeps the markers honest too). While such a test's setup, call or
teardown runs, the entry points of a process start are wrapped: `subprocess.Popen`'s
`_execute_child` (subprocess.run, asyncio's subprocesses, os.popen), `os.fork`,
`os.forkpty`, `os.posix_spawn[p]`, `os.system`, `os.execv[e]` (the other exec and
spawn functions go through these), multiprocessing's `BaseProcess.start` and
`util.spawnv_passfds` (its spawn and forkserver starts call `_posixsubprocess`
directly); and so is `open` (builtins and io), for any file of the default model: its
GGUF file (dpserve.checkpoint.loader's `DEFAULT_GGUF`) or its converted directory (named
after the GGUF file's stem). The start or the open is refused (raises) and the test
fails with a message naming the test, what it started or opened, and the marker to
add. Outside those phases nothing is wrapped. (Patches, not a `sys.addaudithook`:
a hook runs Python code on every audited event of every thread, for the whole run,
and cannot be removed.)

Before any test (`warm_up`), what a process would start lazily, once per process,
starts outside them, so which test starts it does not depend on the order or on a
cold cache: `platform.processor()` runs `uname -p` (the openai client asks for the
platform), and dpserve's CPU kernels are built (`cc`) into their cache, or found there.

Not here: the markers themselves (pyproject.toml) and which tests carry them.
"""

from __future__ import annotations

import builtins
import io
import multiprocessing.process
import multiprocessing.util
import os
import platform
import subprocess
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from dpserve.checkpoint.loader import DEFAULT_GGUF

FAST_EXCLUDED = ("procs", "slow")  # make test-fast runs `-m "not procs and not slow"`
DEFAULT_MODEL_STEM = Path(DEFAULT_GGUF).stem  # "SmolLM2-135M-Instruct.Q4_1"
# (module or class, attribute) of every process start the guard wraps.
PROCESS_STARTS = [(subprocess.Popen, "_execute_child"),
                  (multiprocessing.process.BaseProcess, "start"),
                  (multiprocessing.util, "spawnv_passfds"),
                  *((os, name) for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp",
                                            "system", "execv", "execve") if hasattr(os, name))]
OPENS = [(builtins, "open"), (io, "open")]


class FastGuardError(RuntimeError):
    """A test-fast test started a process or opened the default model."""


def is_fast(item: pytest.Item) -> bool:
    """Whether `make test-fast` selects `item` (it is marked neither procs nor slow)."""
    return not any(item.get_closest_marker(name) for name in FAST_EXCLUDED)


def warm_up() -> None:
    """Start, outside any test, what dpserve and its clients start once per process."""
    platform.processor()  # cached: `uname -p` runs here, not in the first openai client's test
    from dpserve.model import cpu_kernels

    cpu_kernels.available()  # cached: `cc` runs here on a cold cache, not in an engine's test


def _describe(name: str, args: tuple) -> str:
    if name == "_execute_child":  # (self, args, executable, ...)
        argv = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        return f"started a process (subprocess: {' '.join(map(str, argv))[:200]})"
    if name == "start":  # (self,): a multiprocessing process
        target = getattr(args[0], "_target", None)
        return (f"started a multiprocessing process ({args[0].name}, target "
                f"{getattr(target, '__qualname__', target)})")
    if name in ("fork", "forkpty"):
        return f"forked the test process (os.{name})"
    return f"started a process ({name}: {str(args)[:200]})"


def _model_path(file: object) -> str | None:
    """`file` as a path when it names a file of the default model."""
    if isinstance(file, (str, bytes, os.PathLike)):
        path = os.fsdecode(os.fspath(file))
        if DEFAULT_MODEL_STEM in path:
            return path
    return None


class FastGuard:
    """The plugin: wraps the process starts and `open` while a test-fast item's setup,
    call or teardown runs, and fails the item when it used them."""

    def __init__(self) -> None:
        warm_up()
        self.item: pytest.Item | None = None
        self.found: list[str] = []

    def _refuse(self, what: str, marker: str) -> NoReturn:
        nodeid = self.item.nodeid if self.item is not None else "?"
        message = (f"{nodeid}: a test-fast test (marked neither procs nor slow) {what}. "
                   "`make test-fast` starts no process and loads no default model: mark the "
                   f"test `@pytest.mark.{marker}` (markers in pyproject.toml), or make it not "
                   "do that")
        self.found.append(message)
        raise FastGuardError(message)

    def _process_start(self, name: str, original: Callable) -> Callable:
        def start(*args: Any, **kwargs: Any) -> NoReturn:
            self._refuse(_describe(name, args), "procs")

        start.__wrapped__ = original  # type: ignore[attr-defined]
        return start

    def _open(self, original: Callable) -> Callable:
        def guarded_open(file: Any, *args: Any, **kwargs: Any) -> Any:
            path = _model_path(file)
            if path is not None:
                self._refuse(f"opened the default 135M model ({path})", "slow")
            return original(file, *args, **kwargs)

        guarded_open.__wrapped__ = original  # type: ignore[attr-defined]
        return guarded_open

    def _phase(self, item: pytest.Item) -> Generator[None, object, object]:
        if not is_fast(item):
            return (yield)
        self.item, self.found = item, []
        saved = [(owner, name, getattr(owner, name)) for owner, name in PROCESS_STARTS + OPENS]
        for owner, name, original in saved:
            wrap = self._open(original) if (owner, name) in OPENS else \
                self._process_start(name, original)
            setattr(owner, name, wrap)
        try:
            return (yield)
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)
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
