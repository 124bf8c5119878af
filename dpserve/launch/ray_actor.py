"""The Ray backend's engine actor: one DP engine inside a Ray actor.

Scope: `EngineCoreActor` (an `EngineCoreProc` built from given init metadata,
without the socket handshake) and the process title it keeps under Ray.

Not here: creating, watching and restarting the actors (`dpserve.launch.ray_backend`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from dpserve.config import EngineConfig
from dpserve.logging_utils import name_process
from dpserve.protocol import EngineInitMetadata

logger = logging.getLogger("dpserve.launch.ray_backend")


class EngineCoreActor:
    """One DP engine inside a Ray actor: an `EngineCoreProc` built from given
    init metadata (no socket handshake: the addresses are known in advance).

    Construction starts the engine (model, KV cache, coordinator link,
    front-end registration); `ready()` then answers what READY would carry;
    `run()` serves until the actor is killed, SIGTERM (Ray: SystemExit), a
    remote engine losing its front-ends, or a fatal error, which is announced
    with ENGINE_CORE_DEAD on every output socket and re-raised (the run ref fails).
    """

    def __init__(self, config: EngineConfig, rank: int, init: EngineInitMetadata,
                 local: bool, incarnation: int = 0) -> None:
        from dpserve.engine.process import EngineCoreProc

        _name_actor_process(rank)
        self.rank = rank
        self.proc = EngineCoreProc(config, rank, None, local=local, init=init,
                                   incarnation=incarnation)

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with this
        return f"EngineCore_{self.rank}"

    def ready(self) -> dict[str, Any]:
        """The READY data as plain values, plus where the engine runs."""
        import ray

        r = self.proc.ready
        return dict(local=r.local, num_kv_blocks=r.num_kv_blocks, max_model_len=r.max_model_len,
                    node_id=ray.get_runtime_context().get_node_id(), pid=os.getpid())

    def run(self) -> None:
        """The busy loop (what `run_engine_core` does in a process)."""
        _name_actor_process(self.rank)  # Ray retitles the process for each task
        try:
            self.proc.run_busy_loop()
        except (SystemExit, KeyboardInterrupt):
            logger.info("engine %d shutting down", self.rank)
            raise
        except BaseException:
            logger.exception("engine %d hit a fatal error", self.rank)
            self.proc.send_engine_dead()
            raise
        finally:
            self.proc.shutdown()


def _name_actor_process(rank: int) -> None:
    """`dpserve::EngineCore_<rank>` in ps, and in every log line. A Ray worker's
    title belongs to Ray's own setproctitle (the setproctitle package cannot
    change it there), which restores its title after each task."""
    name_process(f"EngineCore_{rank}")
    try:
        from ray import _raylet

        _raylet.setproctitle(f"dpserve::EngineCore_{rank}")
    except (ImportError, AttributeError):  # not in a Ray worker, or Ray moved it
        pass
