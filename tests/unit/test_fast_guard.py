"""The test-fast guard (fast_guard.py) in a pytest run of its own (in this process,
through pytester): a test marked neither procs nor slow that starts a process (a
subprocess, a multiprocessing process, a fork) or opens the default model fails,
naming itself, what it did and the marker to add; a marked test may; after the run
nothing is left wrapped."""

from __future__ import annotations

import io
import subprocess

import pytest

from dpserve.checkpoint.loader import DEFAULT_GGUF

pytest_plugins = ["pytester"]

# The inner run's tests try to start processes (the guard refuses them): this one is
# no test-fast test, or its own guard would refuse them first.
pytestmark = pytest.mark.procs

CONFTEST = """
from fast_guard import FastGuard

def pytest_configure(config):
    config.pluginmanager.register(FastGuard(), "fast_guard")
"""

TESTS = f"""
import multiprocessing
import os
import subprocess

import pytest

def test_popen():
    subprocess.run(["true"], check=True)

def test_multiprocessing_spawn():
    proc = multiprocessing.get_context("spawn").Process(target=print)
    proc.start()
    proc.join()

def test_fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)

def test_default_model(tmp_path):
    (tmp_path / {DEFAULT_GGUF!r}).write_bytes(b"GGUF")

@pytest.fixture
def server():
    subprocess.run(["true"], check=True)

def test_fixture_starts_one(server):
    pass

@pytest.mark.procs
def test_marked_procs():
    subprocess.run(["true"], check=True)

def test_pure_logic():
    assert sum(range(4)) == 6
"""


def test_guard_fails_unmarked_tests_that_start_processes(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    procs: starts processes\n    slow: slow\n")
    pytester.makepyfile(test_inner=TESTS)
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=4, errors=1)
    text = result.stdout.str()
    what = {"test_popen": "started a process (subprocess: true)",
            "test_multiprocessing_spawn": "started a multiprocessing process",
            "test_fork": "forked the test process (os.fork)",
            "test_fixture_starts_one": "started a process (subprocess: true)"}
    for test, did in what.items():
        assert f"test_inner.py::{test}: a test-fast test (marked neither procs nor slow) " \
               f"{did}" in text, text
    assert "opened the default 135M model" in text and "`@pytest.mark.slow`" in text, text
    assert text.count("mark the test `@pytest.mark.procs`") >= 4, text
    assert not hasattr(subprocess.Popen._execute_child, "__wrapped__")  # all restored
    assert open is io.open and not hasattr(open, "__wrapped__")
