"""Torch profiler traces of the engines on an operator's call: `--profile-dir DIR`.

Scope: `ProfileArgs` (the flag; a base of `dpserve.config.EngineArgs`, so every engine
gets it in `EngineConfig.profile_dir`), `check_profile_dir`, and `Profiler`, one per
model worker: `start()` opens a torch.profiler session (CPU activity, and CUDA's on a
GPU), `stop()` closes it and writes its Chrome trace (viewable in Perfetto or
chrome://tracing) as `DIR/dp<rank>-tp<worker>-<unix ms>.pt.trace.json.gz`,
returning the path. A session is bounded: one at a time per worker, and stopped
(its trace written) by `close()` when the engine shuts down mid-session.

The admin routes `POST /start_profile` and `POST /stop_profile` (vLLM's names,
`dpserve.server.ops.profile_routes`) reach every worker through the engines'
`start_profile` / `stop_profile` utilities. On a host of its own (`--headless`) the
traces go to that host's DIR, from its own command line.

Not here: OpenTelemetry request traces (`dpserve.tracing`), the py-spy sampling of
`bench/profile_serve.py`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from dpserve.errors import ConfigError
from dpserve.tracing.options import GROUP  # --help: beside the request traces' options


@dataclass
class ProfileArgs:
    """The profiling option as users pass it (`EngineArgs` has it: a base)."""

    profile_dir: str | None = field(default=None, metadata={"help": (
        "Directory for torch profiler traces: POST /start_profile and /stop_profile "
        "(admin API) record every engine worker and write one trace file each here."),
        "group": GROUP})

    def checked_profile_dir(self) -> str | None:
        return check_profile_dir(self.profile_dir)


def check_profile_dir(path: str | None) -> str | None:
    """`path` made absolute (None: off); ConfigError unless it is a writable directory."""
    if path is None:
        return None
    absolute = os.path.abspath(path)
    if not os.path.isdir(absolute):
        raise ConfigError(f"profile_dir {path!r} is not a directory")
    if not os.access(absolute, os.W_OK | os.X_OK):
        raise ConfigError(f"profile_dir {path!r} is not writable by this user")
    return absolute


class Profiler:
    """One worker's profiler sessions (module docstring)."""

    def __init__(self, directory: str | None, dp_rank: int, tp_rank: int, device: Any) -> None:
        self.directory = directory
        self.name = f"dp{dp_rank}-tp{tp_rank}"
        self.device = device
        self._session: Any = None  # the running torch.profiler.profile

    @property
    def running(self) -> bool:
        return self._session is not None

    def start(self) -> bool:
        """Open a session; False when one runs already. `--profile-dir` must be set."""
        if self.directory is None:
            raise RuntimeError("profiling needs --profile-dir")
        if self._session is not None:
            return False
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if getattr(self.device, "type", "cpu") == "cuda":
            activities.append(ProfilerActivity.CUDA)
        session = profile(activities=activities, record_shapes=True)
        session.__enter__()
        self._session = session
        return True

    def stop(self) -> str | None:
        """Close the session and write its trace: the file's path (None: none ran)."""
        session, self._session = self._session, None
        if session is None:
            return None
        session.__exit__(None, None, None)
        assert self.directory is not None
        path = os.path.join(self.directory,
                            f"{self.name}-{int(time.time() * 1000)}.pt.trace.json.gz")
        session.export_chrome_trace(path)
        return path

    def close(self) -> None:
        """At shutdown: a session still open is stopped and written."""
        self.stop()
