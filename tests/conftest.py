"""Shared fixtures: tiny random checkpoints built once per test session."""

from __future__ import annotations

import os

import pytest

# Keep converted models of the test run out of the user's cache only when asked;
# by default reuse the user cache so the default model is converted once.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from dpserve.testing.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    from dpserve.testing.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")
