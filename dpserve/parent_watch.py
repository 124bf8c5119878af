"""Orphans stop: a child process exits when the process that started it dies.

Every child dpserve starts (engine, API server, DP coordinator) calls
`start_parent_watcher` once: a daemon thread waits on the parent's pidfd (or,
without pidfds, polls for re-parenting), then asks its own process to stop with
SIGTERM and, if the main thread is stuck, hard-exits after a grace period.

Not here: starting, watching or stopping children (`dpserve.launch.process`).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time

logger = logging.getLogger(__name__)

PARENT_POLL_S = 1.0  # without pidfds: how often a child looks for re-parenting
PARENT_GRACE_S = 10.0  # after asking itself to stop, an orphan hard-exits after this


def start_parent_watcher(parent_pid: int, what: str = "process") -> None:
    """Exit when the parent dies: SIGTERM ourselves, then, if the main thread is
    stuck, hard-exit after a grace period."""

    def watch() -> None:
        _wait_for_death(parent_pid)
        logger.warning("parent process %d is gone; %s shutting down", parent_pid, what)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(PARENT_GRACE_S)
        logger.error("still alive %.0f s after the parent died; exiting hard", PARENT_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watcher", daemon=True).start()


def _wait_for_death(pid: int) -> None:
    """Block until process `pid` (our parent, or the launcher that asked a forkserver
    for us) has exited: on its pidfd, else by polling for re-parenting."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone already
    except (AttributeError, OSError):  # no pidfds here: only our own parent is watched
        while os.getppid() == pid:
            time.sleep(PARENT_POLL_S)
        return
    try:
        select.select([fd], [], [])  # readable once it has exited
    finally:
        os.close(fd)
