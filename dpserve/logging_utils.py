"""Process names and log format: every log line says which process it is from.

Each dpserve process calls `name_process(role)` first: the role becomes its
multiprocessing name (shown in every log line), its process title
(`dpserve::<role>` in ps/top) and logging is set up if nobody did it yet.
The title replaces the whole command line in /proc/<pid>/cmdline, so secrets
given as options (`SECRET_FLAGS`) leave `ps` once it is set; `dpserve serve`
sets it (and scrubs `sys.argv`: `scrub_argv`) right after parsing its options.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys

LOG_FORMAT = ("%(asctime)s %(levelname)s %(processName)s pid=%(process)d "
              "[%(name)s] %(message)s")


SECRET_FLAGS = ("--api-key", "--data-parallel-secret")  # their values never show
HIDDEN = "<hidden>"


def scrub_argv(flags: tuple[str, ...] = SECRET_FLAGS) -> None:
    """Replace the values of `flags` ("--flag V" and "--flag=V") in sys.argv with
    HIDDEN, so nothing that reads sys.argv later (spawned children get a copy) sees
    them."""
    argv = sys.argv
    for i, arg in enumerate(argv):
        if arg in flags and i + 1 < len(argv):
            argv[i + 1] = HIDDEN
        elif arg.split("=", 1)[0] in flags and "=" in arg:
            argv[i] = arg.split("=", 1)[0] + "=" + HIDDEN


def setup_logging() -> None:
    """Log to stderr at $DPSERVE_LOG_LEVEL (default INFO), unless already set up."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=os.environ.get("DPSERVE_LOG_LEVEL", "INFO").upper(),
                            format=LOG_FORMAT, stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per HTTP request


def name_process(role: str) -> None:
    """e.g. "EngineCore_0", "DPCoordinator", "APIServer_0"."""
    import setproctitle

    multiprocessing.current_process().name = role
    setproctitle.setproctitle(f"dpserve::{role}")
    setup_logging()
