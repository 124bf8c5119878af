"""Process names and log format: every log line says which process it is from.

Each dpserve process calls `name_process(role)` first: the role becomes its
multiprocessing name (shown in every log line), its process title
(`dpserve::<role>` in ps/top) and logging is set up if nobody did it yet.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys

LOG_FORMAT = ("%(asctime)s %(levelname)s %(processName)s pid=%(process)d "
              "[%(name)s] %(message)s")


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
