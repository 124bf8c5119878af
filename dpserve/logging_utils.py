"""Process names and log format: every log line says which process it is from.

Each dpserve process calls `name_process(role)` first: the role becomes its
multiprocessing name (shown in every log line), its process title
(`dpserve::<role>` in ps/top) and logging is set up if nobody did it yet.
The title replaces the whole command line in /proc/<pid>/cmdline, so secrets
given as options (`SECRET_FLAGS`) leave `ps` once it is set; the `dpserve`
command sets a first one (and scrubs `sys.argv`) before anything else:
`hide_command_line`.
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


def hide_command_line() -> None:
    """Before anything slow (the first thing `dpserve` does): scrub sys.argv and set a
    provisional title, which overwrites the command line in /proc/<pid>/cmdline; a
    secret given as an option is visible only while Python starts."""
    import setproctitle

    scrub_argv()
    setproctitle.setproctitle("dpserve")


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
