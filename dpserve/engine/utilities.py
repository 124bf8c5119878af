"""An engine's utility calls: the table that features register their calls in.

Scope: `UtilityTable`, name -> handler. A front-end calls a utility by name
between two steps: over the wire (`UtilityCall`, which the engine process
answers) or through the in-process client. The `EngineCore` builds the table:
it registers its own read-only views and the prefix-cache reset, and each
feature registers its calls (`WorkerUtilities` here: profiler sessions, sharded
state, the workers and experts of the rank; `EngineLoRA` in
`dpserve.engine.lora_sync`: the adapters).

Invariant: a name outside the table is refused by name, and the engine serves
on. The request path, sleep / wake-up (only through the engine's control, which
aborts first) and DP steps are never utilities.

Not here: the utilities the engine process answers itself (`get_dp_state`, its
own `request_state_sizes`) and `control` (`dpserve.engine.process`,
`dpserve.engine.control`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpserve.protocol import TPWorkerInfo


class UtilityTable:
    """name -> handler of every utility call an engine serves (module docstring)."""

    def __init__(self) -> None:
        self._handlers: dict[str, Callable[..., Any]] = {}

    def register(self, **handlers: Callable[..., Any]) -> None:
        """Serve each name by its handler; a name is registered once."""
        for name, handler in handlers.items():
            if name in self._handlers:
                raise ValueError(f"utility {name!r} is registered twice")
            self._handlers[name] = handler

    def __contains__(self, name: object) -> bool:
        return name in self._handlers

    def names(self) -> frozenset[str]:
        return frozenset(self._handlers)

    def call(self, name: str, *args: Any) -> Any:
        """Run utility `name`; AttributeError for a name no feature registered."""
        handler = self._handlers.get(name)
        if handler is None:
            raise AttributeError(f"the engine has no utility method {name!r}")
        return handler(*args)


class WorkerUtilities:
    """The utilities that reach every worker of this rank: profiler sessions
    (--profile-dir; `dpserve.profiling`), sharded state, the workers and the experts."""

    def __init__(self, executor: Any, model_path: str) -> None:
        self.executor = executor
        self.runner = executor.driver  # worker 0's (this process)
        self.model_path = model_path

    def register(self, table: UtilityTable) -> None:
        table.register(start_profile=self.start_profile, stop_profile=self.stop_profile,
                       save_sharded_state=self.save_sharded_state,
                       tp_worker_info=self.tp_worker_info, expert_info=self.expert_info)

    def start_profile(self) -> bool:
        """A torch profiler session on every worker of this rank; False when one runs
        already."""
        return all(self.executor.collective_rpc("start_profile"))

    def stop_profile(self) -> list[str]:
        """End the session: the trace files written, one per worker (none: no session)."""
        return [path for path in self.executor.collective_rpc("stop_profile") if path]

    def save_sharded_state(self, path: str, pattern: str | None = None,
                           max_size: int | None = None) -> list[str]:
        """Every worker of this rank writes its own shard of the weights to `path`, and
        the model's other files (config, tokenizer) are copied there: a directory for
        --load-format sharded_state at this tensor_parallel_size
        (`dpserve.checkpoint.sharded_state`). The files written, worker by worker."""
        from dpserve.checkpoint.sharded_state import copy_model_files

        written = self.executor.collective_rpc("save_sharded_state", path, pattern, max_size)
        copy_model_files(Path(self.model_path), Path(path))
        return [f for files in written for f in files]

    def tp_worker_info(self) -> list[TPWorkerInfo]:
        """This rank's tensor-parallel workers (worker 0 is this process): pid, device,
        resident memory."""
        return self.executor.worker_info()

    def expert_info(self) -> dict[str, Any] | None:
        """The routed experts this engine holds (range, parameter bytes, and the
        expert-parallel collectives run); None for a dense model."""
        model = self.runner.model
        if model is None or not hasattr(model, "expert_info"):
            return None
        ep = self.runner.expert_parallel
        return {**model.expert_info(), "collectives": ep.collectives if ep else 0}
