"""The server's state directory: the one folder for what outlives a request.

It holds the Responses API's store (`responses.sqlite`, unless `--response-store`
names another file: `dpserve.server.responses.store`), and the files and batches
of /v1/files and /v1/batches (`batches.sqlite`, their metadata and every batch
line's result; `files/`, each file's contents, mode 0600: `dpserve.server.batches.store`).
Every API server of one `dpserve serve` gets the same path in its options.

Where it is: `--state-dir PATH` (created with mode 0700 when missing; kept after
exit, so stored responses, files and unfinished batches outlive a restart of the
whole server, and an unfinished batch resumes); without it the launcher makes a
private one (`dpserve-state-*` under $TMPDIR, mode 0700) before it starts the API
servers and removes it when it exits.

A named directory must be a directory this user owns that no other user can
write (a ConfigError naming `--state-dir` otherwise, before anything starts):
it holds every stored response and uploaded file.

Not here: what is inside (the stores above).
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from dpserve.errors import ConfigError

__all__ = ["add_state_dir_args", "check_state_dir", "state_directory"]


def add_state_dir_args(group: argparse.ArgumentParser) -> None:
    group.add_argument("--state-dir", default=None, metavar="PATH",
                       help="Directory of the server's state, kept across restarts: the "
                            "Responses API's store (unless --response-store), uploaded "
                            "files and batches (an unfinished batch resumes when a server "
                            "starts on the same directory). Default: a private directory "
                            "removed when the server exits.")


def check_state_dir(path: str | None) -> None:
    """ConfigError (naming --state-dir) when `path` cannot be the state directory."""
    if path is None:
        return
    if not os.path.exists(path):
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise ConfigError(f"--state-dir: no such directory: {parent}")
        return
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"--state-dir must name a directory, not {path}")
    if info.st_uid != os.getuid():
        raise ConfigError(f"--state-dir {path} belongs to another user")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(f"--state-dir {path} is writable by other users (chmod 700 it)")


@contextmanager
def state_directory(path: str | None) -> Iterator[str]:
    """The state directory made (module docstring): `path` (created 0700 when missing,
    kept), or a private one removed on exit."""
    if path is not None:
        check_state_dir(path)
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--state-dir {path}: {e.strerror or e}") from None
        yield os.path.abspath(path)
        return
    made = tempfile.mkdtemp(prefix="dpserve-state-")  # mode 0700
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)
