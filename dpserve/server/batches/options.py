"""`BatchOptions`: the `dpserve serve` flags of /v1/files and /v1/batches.

`--state-dir` (where files and batches live: `dpserve.server.state_dir`),
`--max-batch-file-bytes` (the largest upload: 413 past it, naming the flag) and
`--max-batch-concurrency` (the lines one API server runs at once, each batch at
the lowest priority: `dpserve.server.batches.runner`).

Not here: the state directory's making (`dpserve.server.state_dir`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from dpserve.errors import ConfigError
from dpserve.server.state_dir import add_state_dir_args, check_state_dir

DEFAULT_MAX_BATCH_FILE_BYTES = 100 << 20


@dataclass(frozen=True)
class BatchOptions:
    """Where files and batches live and their bounds (the flags above)."""

    # The state directory; None: the launcher's private one (resolved before the API
    # servers start: they always get a path; an app built without one has no
    # /v1/files or /v1/batches).
    state_dir: str | None = None
    max_batch_file_bytes: int = DEFAULT_MAX_BATCH_FILE_BYTES
    max_batch_concurrency: int = 4

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BatchOptions:
        d = cls()
        options = cls(state_dir=getattr(args, "state_dir", None),
                      max_batch_file_bytes=getattr(args, "max_batch_file_bytes",
                                                   d.max_batch_file_bytes),
                      max_batch_concurrency=getattr(args, "max_batch_concurrency",
                                                    d.max_batch_concurrency))
        for name in ("max_batch_file_bytes", "max_batch_concurrency"):
            if getattr(options, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got "
                                  f"{getattr(options, name)}")
        check_state_dir(options.state_dir)
        return options


def add_batch_args(group: argparse.ArgumentParser) -> None:
    d = BatchOptions()
    add_state_dir_args(group)
    group.add_argument("--max-batch-file-bytes", type=int, default=d.max_batch_file_bytes,
                       help="Largest file /v1/files takes (a larger upload gets 413).")
    group.add_argument("--max-batch-concurrency", type=int, default=d.max_batch_concurrency,
                       help="Batch lines each API server runs at once. Batches run at the "
                            "lowest priority: no new line starts while an engine has "
                            "requests waiting.")
