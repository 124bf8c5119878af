"""Shared fixtures: tiny random checkpoints built once per test session, and a
real DP coordinator process with a ZMQ context for its scripted peers; the
test-fast guard (fast_guard.py), registered for every run; under `-m`, test modules
whose own marks leave none of their tests selected are not imported."""

from __future__ import annotations

import ast
import faulthandler
import itertools
import os
import re
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from _pytest.mark.expression import Expression
from fast_guard import FastGuard

# Keep converted models of the test run out of the user's cache only when asked;
# by default reuse the user cache so the default model is converted once.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines started by tests skip compiling every linear kernel at start-up (about a
# second per engine, hundreds of engines per run); test_model and test_enforce_eager
# check the compilation itself and what the flag changes.
os.environ.setdefault("DPSERVE_ENFORCE_EAGER", "1")
# `--dtype auto` stays float32 on CPUs with native bfloat16 too (cpu_features): the
# suite compares greedy tokens with transformers' float32 and must not depend on the
# machine it runs on; test_cpu_dtype checks the bfloat16 choice itself.
os.environ.setdefault("DPSERVE_CPU_BF16", "0")


# The longest test files (whole-file run time, `--durations=0`, 2026-11-26 23:35), longest
# first. `make test` hands whole files to its two workers in collection order
# (`--no-loadscope-reorder`): the longest going first, the last file to start is a
# short one and neither worker idles long at the end. Only an order: a file missing
# here runs after these, in pytest-randomly's order.
LONGEST_FILES = [
    "test_faults.py", "test_elastic.py", "test_multinode.py", "test_tensor_parallel.py",
    "test_default_model.py", "test_docs_examples.py", "test_top.py", "test_moe_elastic.py",
    "test_responses_api.py",
    "test_spec_decode_serve.py", "test_api_servers.py", "test_lora_serve.py",
    "test_tensor_parallel_serve.py", "test_moe_parallel.py", "test_gguf.py",
    "test_kernel_cache_safety.py", "test_bench_priority.py", "test_batches_api.py",
    "test_request_limits.py", "test_tenants_serve.py", "test_cpu_kernels.py",
    "test_pd_serve.py", "test_serve_process.py", "test_control.py",
    "test_structured_server.py", "test_tp_sharding.py", "test_bench_prefix_routing.py",
    "test_llm_data_parallel.py", "test_ops.py", "test_lockstep_faults.py",
    "test_bench_spec_decode.py", "test_http_security.py", "test_engine_process.py",
    "test_security.py", "test_tracing_serve.py", "test_dashboard.py",
    "test_server_stats.py", "test_profile.py", "test_http_extras.py",
    "test_dataplane_security.py", "test_coordinator.py", "test_dp_group.py",
    "test_request_state.py", "test_priority_serve.py", "test_kv_tier_pull.py",
    "test_spec_decode_engine.py", "test_kv_tier_serve.py", "test_sharded_state.py",
    "test_model.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first (a stable sort: pytest-randomly's order within and after)."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def module_marks(path: Path) -> set[str]:
    """The names of the `pytest.mark.<name>` marks of a test module's module-level
    `pytestmark`, read from its source (empty when it has none)."""
    for node in ast.parse(path.read_bytes(), str(path)).body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
            return {n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute)
                    and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}
    return set()


def selects_none(markexpr: str, marks: set[str]) -> bool:
    """Whether `-m markexpr` deselects every test of a module marked `marks`, whatever
    marks its tests add (each subset of the other names in the expression). False for
    an expression with marker arguments (`name(key=value)`): those are not decided here."""
    names = set(re.findall(r"[^\s()]+", markexpr)) - {"and", "or", "not"} - marks
    if "(" in markexpr or len(names) > 8:
        return False
    expression = Expression.compile(markexpr)
    for chosen in itertools.product((False, True), repeat=len(names)):
        present = marks | {n for n, on in zip(sorted(names), chosen, strict=True) if on}
        if expression.evaluate(present.__contains__):
            return False
    return True


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A test module that `-m` deselects whole, by its module-level marks, is not even
    imported (make test-fast: 69 modules that only start processes or run long, about
    5 s of imports; make test's lanes likewise). The tests selected are the same."""
    markexpr = config.option.markexpr
    if markexpr and collection_path.suffix == ".py" and collection_path.name.startswith(
            "test_") and selects_none(markexpr, module_marks(collection_path)):
        return True
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(FastGuard(), "fast_guard")
    # The Makefile's hang guard sends SIGUSR1 before it kills a lane: every
    # thread's stack goes to stderr, so a run that never ends says where it waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)


@pytest.fixture(scope="session")
def default_hf_model():
    """transformers' own loading of the default model's GGUF file (gguf-py
    dequantisation), float32: an oracle independent of dpserve's conversion,
    shared by test_default_model and test_gguf (loading takes a while)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dpserve.checkpoint.loader import default_gguf_path

    gguf = default_gguf_path()
    return AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from dpserve.testing.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    from dpserve.testing.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


# A real DP coordinator process (started, closed after the test) and a ZMQ context.
@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def make_coordinator() -> Iterator[Callable[..., object]]:
    made: list = []

    from dpserve.launch.coordinator import DPCoordinator

    def make(num_engines: int, **kwargs: object) -> DPCoordinator:
        coord = DPCoordinator(num_engines, **kwargs)  # type: ignore[arg-type]
        made.append(coord)
        coord.start()
        return coord

    yield make
    for coord in made:
        coord.close()
        assert coord.proc is not None and not coord.proc.is_alive()
