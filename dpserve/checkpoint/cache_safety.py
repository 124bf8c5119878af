"""Whether a cache path may be trusted.

Scope: dpserve loads code (the CPU kernel library, `cpu_kernels.py`) and weights
(converted GGUF models, `loader.py`) from its caches, so a cache that another user
can write into would run their code in dpserve's processes or swap its model. The
rule both caches follow:
* a directory is trusted when it is owned by this user and not writable by group
  or others (a missing one is created mode 0700);
* a file (or a converted model's directory and each of its entries) when it is no
  symbolic link, owned by this user and not writable by group or others.

Not here: what to do with an untrusted path (each cache decides: build or convert
into a private temporary directory instead); the parents of a cache directory are
not checked (their safety is the operator's choice of cache location).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def _owner_problem(st: os.stat_result) -> str | None:
    """Why a path with this stat is not this user's alone (None: it is)."""
    if not hasattr(os, "geteuid"):  # no POSIX owners (Windows)
        return None
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def private_dir(path: Path) -> str | None:
    """Create `path` (mode 0700; parents as usual) if missing; why it cannot be trusted
    as a cache directory, or None. A symbolic link to a trusted directory is trusted."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError as e:
        return f"not usable ({e.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    return _owner_problem(st)


def file_problem(path: Path) -> str | None:
    """Why the file at `path` cannot be trusted, or None; FileNotFoundError when absent."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    return _owner_problem(st)


def tree_problem(path: Path) -> str | None:
    """Why the directory at `path` (no link) or one of its entries (regular files, no
    links) cannot be trusted, or None; FileNotFoundError when absent."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    problem = _owner_problem(st)
    if problem is not None:
        return problem
    for entry in os.scandir(path):
        problem = file_problem(Path(entry.path))
        if problem is not None:
            return f"{entry.name}: {problem}"
    return None
