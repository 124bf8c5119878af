"""The KV tier's arena: one POSIX shared-memory segment per store start.

Scope: the store's launcher names a segment (`new_arena_name`: owner pid,
generation and a random part, so no name is ever reused or guessable), the store
creates it (`create_arena`: mode 0600, O_EXCL, its pages allocated up front so
the budget is held and no later write can fault) and unlinks it on exit
(`unlink_arena`; the launcher does the same after the store died). Engines and
their TP workers map it with `attach_arena`, the store itself with `map_arena`
(pulls between hosts' stores): the mapping stays valid after the name is
unlinked, so a copy in progress finishes from a dead store's arena.

Segments are files in /dev/shm (Linux); only this user's, mode 0600 files are
mapped. `sweep_dead_arenas` (at a store's start) unlinks those whose launcher is
gone (a whole dpserve SIGKILLed leaves its arena: nothing of it ran to unlink it).

Not here: what lives in the arena (`dpserve.kv_tier.layout`), who uses which slot
(`dpserve.kv_tier.store`).
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import stat
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"
NAME_PREFIX = "dpserve-kv-"


class ArenaError(RuntimeError):
    """A segment that cannot be created or mapped (the message says why)."""


def new_arena_name(owner_pid: int, generation: int) -> str:
    """A fresh segment name: `dpserve-kv-<owner pid>-<generation>-<random>`."""
    return f"{NAME_PREFIX}{owner_pid}-{generation}-{secrets.token_hex(6)}"


def arena_path(name: str) -> str:
    """The segment's file; ArenaError for a name that is not one of ours."""
    if not name.startswith(NAME_PREFIX) or "/" in name or name in (".", ".."):
        raise ArenaError(f"not a KV tier arena name: {name!r}")
    return os.path.join(SHM_DIR, name)


def shm_free_bytes() -> int | None:
    """Bytes free in /dev/shm (None where there is no /dev/shm)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def create_arena(name: str, size: int) -> None:
    """Create segment `name` of `size` bytes, mode 0600, every page allocated now
    (ArenaError, nothing left behind, when /dev/shm cannot hold it)."""
    path = arena_path(name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise ArenaError(f"cannot create the KV tier arena {path}: {e.strerror}") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.close(fd)
        unlink_arena(name)
        why = (f"/dev/shm has {shm_free_bytes() or 0} bytes free"
               if e.errno == errno.ENOSPC else e.strerror)
        raise ArenaError(f"cannot allocate the KV tier arena ({size} bytes, "
                         f"--kv-offload-memory): {why}") from None
    os.close(fd)


def unlink_arena(name: str) -> bool:
    """Remove segment `name` (mappings stay valid); False if it was gone already."""
    try:
        os.unlink(arena_path(name))
    except FileNotFoundError:
        return False
    return True


def leftover_arenas(owner_pid: int) -> list[str]:
    """Names of the segments that launcher `owner_pid`'s stores left in /dev/shm."""
    prefix = f"{NAME_PREFIX}{owner_pid}-"
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def sweep_dead_arenas() -> list[str]:
    """Unlink the segments of launchers that are gone (a whole dpserve SIGKILLed, its
    store with it, cannot unlink its own): this user's `dpserve-kv-<pid>-...` files
    whose launcher pid runs no process. Returns the names removed."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        owner = name.removeprefix(NAME_PREFIX).split("-", 1)[0]
        if not name.startswith(NAME_PREFIX) or not owner.isdigit() or _runs(int(owner)):
            continue
        try:
            if os.lstat(arena_path(name)).st_uid == os.getuid() and unlink_arena(name):
                removed.append(name)
        except OSError:
            pass  # gone meanwhile
    return removed


def _runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: not ours to judge
    return True


def map_arena(name: str, size: int) -> mmap.mmap:
    """Map segment `name` (exactly `size` bytes, this user's, mode 0600) read-write;
    the mapping stays valid after the name is unlinked. The store maps its own this
    way (pulls write it, fetches read it)."""
    path = arena_path(name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as e:
        raise ArenaError(f"cannot open the KV tier arena {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise ArenaError(f"refusing the KV tier arena {path}: not this user's mode 0600 "
                             f"file (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
        if st.st_size != size:
            raise ArenaError(f"the KV tier arena {path} holds {st.st_size} bytes, "
                             f"expected {size}")
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def attach_arena(name: str, size: int) -> torch.Tensor:
    """Map segment `name` (as `map_arena`): a uint8 tensor `[size]` over the shared
    pages. The mapping lives as long as the tensor (and its views), also after the
    segment is unlinked."""
    import torch

    return torch.frombuffer(map_arena(name, size), dtype=torch.uint8)  # holds the mapping
