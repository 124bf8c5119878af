"""The Ray backend: data-parallel engines as Ray actors, one placement group per rank.

Scope: `RayEngineManager`, what the process manager and its start-up wait are
for local engines under `--data-parallel-backend ray`: connecting to Ray (join
a cluster, or start a local instance), one STRICT_PACK placement group per rank
on the node the planner chose (`dpserve.launch.ray_placement`), the engine
actors (`dpserve.launch.ray_actor.EngineCoreActor`), waiting for their READY
(bounded, with a liveness check), watching their run refs, restarting a rank's
actor (incarnation + 1, same init metadata, same placement group), and the
teardown (`dpserve.launch.ray_teardown`).

Invariants: every socket the engines connect to is tcp:// on the DP master
address (actors may run on other hosts); every Ray call at teardown has a
deadline, and none is made once the local instance's processes are gone or
stopped; `import ray` happens only when a manager is built.

Not here: addresses (`dpserve.launch.addresses.AddressAllocator`), the
coordinator, the front-ends, where each rank runs (`ray_placement`).

Design: docs/design/ray.md
"""
from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Collection, Sequence
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from typing import Any

from dpserve.config import EngineConfig
from dpserve.launch.engines import EngineStartupError
from dpserve.launch.ray_actor import EngineCoreActor
from dpserve.launch.ray_placement import (
    NODE_ID_LABEL,
    RayNode,
    RayPlacementError,
    check_pack_strategy,
    cluster_nodes,
    engine_bundles,
    master_node,
    plan_placement,
    rank_needs,
)
from dpserve.launch.ray_teardown import (
    RAY_CALL_S,
    RayState,
    child_pids,
    new_children,
    processes,
    release,
    teardown,
    within,
)
from dpserve.protocol import EngineInitMetadata, HandshakeReady
from dpserve.security import check_ray_secret, is_loopback

logger = logging.getLogger(__name__)

_POLL_S = 0.5
_PROGRESS_LOG_S = 10.0
_MAX_ERROR_CHARS = 500
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its error messages


# ---- the manager ---------------------------------------------------------------------



class RayEngineManager:
    """Starts the DP engines as Ray actors, restarts one (`restart`), and tears them
    down (docs/design/ray.md).

    `init`: what every engine connects to; all addresses tcp://. The other
    options default to the config's (`ray_address`, `data_parallel_address`
    = this host's IP = the DP master address, `data_parallel_pack_strategy`).
    `placement_timeout`: how long Ray may take to place the placement groups.
    `runtime_env`: passed to the actors (e.g. env_vars, py_modules).
    `close()`, garbage collection and interpreter exit tear down once.
    """

    def __init__(self, config: EngineConfig, init: EngineInitMetadata, *,
                 ray_address: str | None = None, node_ip: str | None = None,
                 pack_strategy: str | None = None, ranks_per_node: int | None = None,
                 placement_timeout: float = 60.0,
                 runtime_env: dict[str, Any] | None = None) -> None:
        parallel = config.parallel
        self.pack_strategy = check_pack_strategy(
            parallel.data_parallel_pack_strategy if pack_strategy is None else pack_strategy)
        if ranks_per_node is not None and ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be at least 1, got {ranks_per_node}")
        _check_tcp(init)
        self.ranks = list(range(parallel.data_parallel_size))
        if init.dp_size != len(self.ranks):
            raise ValueError(f"init metadata says dp_size={init.dp_size}, the config "
                             f"{len(self.ranks)}")
        self.node_ip = node_ip or parallel.data_parallel_address
        self.bundles = engine_bundles(config)
        self.node_of: dict[int, RayNode] = {}  # rank -> its node
        self.master_node_id = ""
        self.engine_info: dict[int, dict[str, Any]] = {}  # rank -> EngineCoreActor.ready()
        self.exit_reasons: dict[int, str] = {}  # rank -> why its run ended
        self.started_ray = False
        self.config = config
        self.init = init
        self.runtime_env = runtime_env
        self._ready_refs: dict[Any, int] = {}
        self._run_refs: dict[int, Any] = {}  # rank -> its current actor's run()
        self._actor_class: Any = None  # ray.remote(EngineCoreActor), made once
        self._state = RayState()
        self._finalizer = weakref.finalize(self, teardown, self._state)
        try:  # before Ray starts: an exposed secret is refused
            check_ray_secret(self.node_ip, parallel.data_parallel_secret,
                             parallel.data_parallel_insecure)
            before = child_pids()
            how = connect_ray(ray_address or parallel.ray_address, self.node_ip)
            if how == "started":  # gcs_server, raylet, monitors: children of this process
                self._state.local_instance = new_children(before)
                self._state.host_procs += self._state.local_instance
            self._state.owns_connection = how != "existing"
            self.started_ray = how == "started"  # close() shuts this instance down
            self._place(ranks_per_node, placement_timeout)
            for rank in self.ranks:
                actor = self._create_actor(rank)
                self._state.actors.append(actor)
                self._ready_refs[actor.ready.remote()] = rank
        except BaseException:
            self.close()
            raise

    # ---- start-up ----------------------------------------------------------------

    def _place(self, ranks_per_node: int | None, timeout: float,
               ranks: list[int] | None = None) -> None:
        """Plan, then one STRICT_PACK placement group per rank (default: every rank;
        scaling up: the new ones, on the resources free now, else refused at once)
        pinned to its node."""
        import ray
        from ray.util.placement_group import placement_group

        ranks = self.ranks if ranks is None else ranks
        nodes = cluster_nodes()
        master = master_node(nodes, self.node_ip, ray.get_runtime_context().get_node_id())
        self.master_node_id = master.node_id
        need = rank_needs(self.bundles)
        args = (nodes, master.node_id, need, len(ranks), self.pack_strategy)
        first = ranks[0] if ranks else 0
        try:
            plan = plan_placement(*args, ranks_per_node=ranks_per_node, first_rank=first)
        except RayPlacementError as busy:  # maybe resources in use (or a stale view): wait
            if first:  # scaling up: what the cluster holds now decides
                raise
            plan = plan_placement(*args, ranks_per_node=ranks_per_node, use_total=True)
            logger.info("placing on resources in use now, waiting up to %.0f s: %s",
                        timeout, busy)
        tag = uuid.uuid4().hex[:8]
        groups = []
        for rank, node in zip(ranks, plan):
            self.node_of[rank] = node
            groups.append(placement_group(
                self.bundles, strategy="STRICT_PACK", name=f"dpserve-{tag}-dp{rank}",
                bundle_label_selector=[{NODE_ID_LABEL: node.node_id}] * len(self.bundles)))
            self._state.placement_groups.append(groups[-1])
        refs = {pg.ready(): rank for rank, pg in zip(ranks, groups)}
        _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        if pending:
            raise RayPlacementError(self._not_placed(sorted(refs[r] for r in pending), need,
                                                     timeout))
        logger.info("placed %d DP rank(s) (%s): %s", len(ranks), self.pack_strategy,
                    ", ".join(f"{r}->{self.node_of[r].node_id[:8]}" for r in ranks))

    def _not_placed(self, ranks: list[int], need: dict[str, float], timeout: float) -> str:
        free = {n.node_id: n.available for n in cluster_nodes()}
        nodes = "; ".join(f"rank {r} -> " + self.node_of[r].describe(
            need, free.get(self.node_of[r].node_id, {}),
            self.node_of[r].node_id == self.master_node_id) for r in ranks)
        return (f"Ray did not place DP rank(s) {ranks} within {timeout:.0f} s: each needs "
                f"{need} on its node, which has free now: {nodes}")

    def _create_actor(self, rank: int, incarnation: int = 0) -> Any:
        """A new engine actor for `rank` in the rank's placement group (it starts loading)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cuda = self.config.device == "cuda"  # the actor takes the GPU bundle, else the CPU one
        pg = self._state.placement_groups[self.ranks.index(rank)]
        options: dict[str, Any] = dict(
            num_cpus=0 if cuda else self.bundles[0]["CPU"],
            num_gpus=self.bundles[0]["GPU"] if cuda else 0,
            max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=0))
        if self.runtime_env is not None:
            options["runtime_env"] = self.runtime_env
        local = self.node_of[rank].node_id == self.master_node_id
        if self._actor_class is None:
            self._actor_class = ray.remote(EngineCoreActor)
        return self._actor_class.options(**options).remote(self.config, rank, self.init, local,
                                                           incarnation)

    def wait_for_startup(self, timeout: float = 600.0,
                         also_watch: Sequence[BaseProcess] = ()) -> dict[int, HandshakeReady]:
        """Wait until every engine is ready, then start their busy loops.

        `also_watch`: local processes (e.g. the coordinator) whose death fails
        the start-up at once. Returns rank -> READY data. Raises
        EngineStartupError when an actor dies (naming its rank and the cause),
        a watched process exits, or `timeout` seconds pass.
        """
        import ray

        if self._run_refs or not self._ready_refs:
            raise RuntimeError("wait_for_startup() runs once, after construction")
        ready: dict[int, HandshakeReady] = {}
        deadline = time.monotonic() + timeout
        next_log = time.monotonic() + _PROGRESS_LOG_S
        pending = list(self._ready_refs)
        while pending:
            _raise_for_dead_procs(also_watch, ready, self.ranks)
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineStartupError(f"engines not ready after {timeout:.0f} s: "
                                         f"{self._describe(ready)}")
            if time.monotonic() >= next_log:
                logger.info("waiting for engines: %s", self._describe(ready))
                next_log += _PROGRESS_LOG_S
            done, pending = ray.wait(pending, num_returns=1, timeout=min(left, _POLL_S))
            for ref in done:
                rank = self._ready_refs[ref]
                try:
                    info = ray.get(ref)
                except Exception as e:
                    raise EngineStartupError(
                        f"engine {rank} (Ray actor on node {self.node_of[rank].node_id[:8]}) "
                        f"died during start-up: {_short(e)}") from None
                ready[rank] = self._engine_ready(rank, info)
        for rank, actor in zip(self.ranks, self._state.actors):
            self._run_refs[rank] = actor.run.remote()
        return dict(sorted(ready.items()))

    def _engine_ready(self, rank: int, info: dict[str, Any]) -> HandshakeReady:
        """Note what `EngineCoreActor.ready()` said; the READY data it stands for."""
        self.engine_info[rank] = info
        if self.node_of[rank].ip == self.node_ip:  # this host: reaped by teardown
            self._state.host_procs += processes([info["pid"]])
        logger.info("engine %d ready on node %s: %d KV blocks", rank, info["node_id"][:8],
                    info["num_kv_blocks"])
        return HandshakeReady(local=info["local"], num_kv_blocks=info["num_kv_blocks"],
                              max_model_len=info["max_model_len"])

    def _describe(self, ready: dict[int, HandshakeReady]) -> str:
        return ", ".join(f"rank {r} {'READY' if r in ready else 'loading the model'} "
                         f"(node {self.node_of[r].node_id[:8]})" for r in self.ranks)

    # ---- watching ------------------------------------------------------------------

    @property
    def local_ranks(self) -> list[int]:
        """The ranks on the DP master node (this host)."""
        return [r for r in self.ranks if self.node_of[r].node_id == self.master_node_id]

    def wait_for_any_exit(self, timeout: float | None = None) -> list[int]:
        """Block until a running engine's busy loop ends (or `timeout` s pass);
        return the ranks that ended since the last call (why: `exit_reasons`).
        [] at once when no engine runs. Use this or `watch_engines`, not both."""
        return sorted(self._ended([r for r in self._run_refs if r not in self.exit_reasons],
                                  timeout))

    def wait_for_exits(self, ranks: Collection[int], timeout: float) -> dict[int, str]:
        """The Supervisor's wait (`dpserve.launch.supervisor.SupervisedEngines`): block
        up to `timeout` s until the actor of one of `ranks` ends; rank -> what happened."""
        return {rank: f"EngineCore_{rank} (Ray actor, pid "
                      f"{self.engine_info.get(rank, {}).get('pid', '?')}) stopped: {reason}"
                for rank, reason in self._ended(ranks, timeout).items()}

    def _ended(self, ranks: Collection[int], timeout: float | None) -> dict[int, str]:
        """Wait for the run refs of `ranks`; rank -> why it ended, for each that did
        (also kept in `exit_reasons`)."""
        import ray

        refs = {self._run_refs[r]: r for r in ranks if r in self._run_refs}
        if not refs:
            return {}
        done, _ = ray.wait(list(refs), num_returns=1, timeout=timeout)
        if done:  # collect every other one that ended too
            done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        ended = {}
        for ref in done:
            try:
                ray.get(ref)
                reason = "its busy loop returned"
            except Exception as e:
                reason = _short(e)
            self.exit_reasons[refs[ref]] = ended[refs[ref]] = reason
        return ended

    def restart(self, rank: int, incarnation: int, init: EngineInitMetadata,
                timeout: float) -> HandshakeReady:
        """A new actor for `rank` (whose run ended) in the rank's placement group,
        with the same init metadata (`init` must be this manager's) and
        `incarnation`; the old actor is killed if still alive. Returns its READY
        data once its busy loop runs. Raises EngineStartupError when it dies,
        `timeout` passes or the manager closes meanwhile (the new actor killed)."""
        import ray

        if init != self.init:
            raise ValueError("a Ray engine restarts with the init metadata it started with")
        index = self.ranks.index(rank)
        with self._state.lock:
            if self._state.stop.is_set():
                raise EngineStartupError(f"engine {rank}: not restarted, shutting down")
            within(RAY_CALL_S, release, ray, [self._state.actors[index]], [])  # frees its bundle
            actor = self._state.actors[index] = self._create_actor(rank, incarnation)
        self.exit_reasons.pop(rank, None)
        try:
            info = self._wait_ready(rank, actor.ready.remote(), timeout)
            with self._state.lock:
                if self._state.stop.is_set():
                    raise EngineStartupError(f"engine {rank}: shutting down")
                self._run_refs[rank] = actor.run.remote()
        except BaseException:
            within(RAY_CALL_S, release, ray, [actor], [])
            raise
        return self._engine_ready(rank, info)

    def add_ranks(self, ranks: Sequence[int], init: EngineInitMetadata, timeout: float,
                  also_watch: Sequence[BaseProcess] = ()) -> dict[int, HandshakeReady]:
        """Scaling up: a new placement group and engine actor per rank of `ranks`
        (`init`: this manager's from now on), READY and running when this returns;
        on failure they are removed again and EngineStartupError (RayPlacementError
        when the cluster cannot hold them) raised."""
        import ray

        self.init = init
        with self._state.lock:
            self.ranks += list(ranks)  # watched once their run() refs exist
        try:
            self._place(None, min(timeout, 60.0), list(ranks))
            actors = {rank: self._create_actor(rank) for rank in ranks}
            with self._state.lock:
                self._state.actors += list(actors.values())
            ready = {}
            for rank, actor in actors.items():
                _raise_for_dead_procs(also_watch, ready, list(ranks))
                info = self._wait_ready(rank, actor.ready.remote(), timeout)
                ready[rank] = self._engine_ready(rank, info)
            with self._state.lock:
                for rank, actor in actors.items():
                    self._run_refs[rank] = actor.run.remote()
            return ready
        except BaseException:  # RayPlacementError: the cluster cannot hold them (refused)
            self._drop_ranks(ranks, ray)
            raise

    def remove_rank(self, rank: int, timeout: float) -> None:
        """Scaling down: kill `rank`'s actor (it holds no requests any more) and
        remove its placement group."""
        import ray

        self._drop_ranks([rank], ray)

    def _drop_ranks(self, ranks: Sequence[int], ray: Any) -> None:
        for rank in ranks:
            with self._state.lock:
                if rank not in self.ranks:
                    continue
                index = self.ranks.index(rank)
                del self.ranks[index]
                self._run_refs.pop(rank, None)
                actor = (self._state.actors.pop(index)
                         if index < len(self._state.actors) else None)
                pg = (self._state.placement_groups.pop(index)
                      if index < len(self._state.placement_groups) else None)
            within(RAY_CALL_S, release, ray, [actor] if actor else [], [pg] if pg else [])
            for table in (self.exit_reasons, self.engine_info, self.node_of):
                table.pop(rank, None)

    def _wait_ready(self, rank: int, ref: Any, timeout: float) -> dict[str, Any]:
        """`ready()` of a restarted actor, waited for in slices (the manager may close)."""
        import ray

        deadline = time.monotonic() + timeout
        while not ray.wait([ref], timeout=_POLL_S)[0]:
            if self._state.stop.is_set():
                raise EngineStartupError(f"engine {rank}: restart abandoned, shutting down")
            if time.monotonic() >= deadline:
                raise EngineStartupError(f"engine {rank} (Ray actor) not ready after "
                                         f"{timeout:.0f} s")
        try:
            return ray.get(ref)
        except Exception as e:
            raise EngineStartupError(f"engine {rank} (Ray actor on node "
                                     f"{self.node_of[rank].node_id[:8]}) died during start-up: "
                                     f"{_short(e)}") from None

    def watch_engines(self, on_exit: Callable[[str], None]) -> None:
        """Call `on_exit(reason)` once, from a thread, when any engine stops
        (e.g. `AsyncEngineClient.mark_dead`, or the launcher's stop)."""
        if self._state.watcher is not None:
            raise RuntimeError("the engines are already watched")
        stop = self._state.stop

        def watch() -> None:
            while not stop.is_set():
                try:
                    ended = self.wait_for_any_exit(timeout=_POLL_S)
                except Exception as e:  # e.g. Ray shut down under us
                    if not stop.is_set():
                        on_exit(f"lost track of the Ray engines: {type(e).__name__}: {e}")
                    return
                if ended and not stop.is_set():
                    on_exit("; ".join(f"engine {r} (Ray actor) stopped: "
                                      f"{self.exit_reasons[r]}" for r in ended))
                    return

        self._state.watcher = threading.Thread(target=watch, name="ray-engine-watcher",
                                               daemon=True)
        self._state.watcher.start()

    def close(self) -> None:
        """Kill the actors, remove the placement groups, shut Ray down or
        disconnect if this manager connected it (idempotent)."""
        self._finalizer()

    def __enter__(self) -> RayEngineManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



# ---- connecting and looking at the cluster ----------------------------------------------


def connect_ray(address: str | None, node_ip: str) -> str:
    """Connect this process to Ray: "existing" (it already was: that connection
    is used), "joined" (`address` given: that cluster, attached to the node at
    `node_ip`, this host) or "started" (a local instance on `node_ip`, with the
    dashboard off and, unless the environment says otherwise, usage stats off).
    """
    import ray

    if ray.is_initialized():
        logger.info("using this process's existing Ray connection")
        return "existing"
    if is_loopback(node_ip):
        _keep_ray_on_loopback()
    kwargs: dict[str, Any] = dict(_node_ip_address=node_ip, logging_level=logging.WARNING,
                                  log_to_driver=True)  # engine logs show up here
    if address is None:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        kwargs.update(address="local", include_dashboard=False)
        logger.info("starting a local Ray instance on %s", node_ip)
    else:
        kwargs.update(address=address)
        logger.info("joining the Ray cluster at %s", address)
    with _keep_sigterm_handler():
        ray.init(**kwargs)
    return "joined" if address is not None else "started"


@contextmanager
def _keep_sigterm_handler():
    """ray.init replaces the process's SIGTERM handler; the launcher keeps its own."""
    main = threading.current_thread() is threading.main_thread()
    old = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and old is not None:
            signal.signal(signal.SIGTERM, old)


def _keep_ray_on_loopback() -> None:
    """Ray swaps a loopback address (in ray.init's address and node IP) for the
    host's outward IP, so that other hosts could reach it; a launcher on
    127.0.0.1 means loopback only. Ray's switch for that is its "no
    multi-host cluster" flag (env RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read at
    import), so set the flag itself: ray may already be imported."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def _check_tcp(init: EngineInitMetadata) -> None:
    addresses = [*init.input_addresses, *init.output_addresses, init.coordinator_input,
                 init.coordinator_output]
    for address in addresses:
        if address is not None and not address.startswith("tcp://"):
            raise ValueError(f"Ray engines may run on other hosts: every address in the "
                             f"init metadata must be tcp://, got {address!r} (use "
                             f"AddressAllocator(local_only=False, host=<this host's IP>))")


def _raise_for_dead_procs(procs: Sequence[BaseProcess], ready: dict[int, HandshakeReady],
                          ranks: list[int]) -> None:
    dead = [p for p in procs if p.exitcode is not None]
    if dead:
        names = ", ".join(f"{p.name} (pid {p.pid}, exit code {p.exitcode})" for p in dead)
        raise EngineStartupError(f"process died during start-up: {names}; engines ready: "
                                 f"{sorted(ready)} of {ranks}")


def _short(error: BaseException) -> str:
    """One line for a Ray error: the engine's own exception where Ray carries it
    (the actor's log, forwarded here, has the traceback)."""
    cause = getattr(error, "cause", None)  # RayTaskError: what the method raised
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"[:_MAX_ERROR_CHARS]
    lines = [line for line in _ANSI.sub("", str(error)).splitlines() if line.strip()]
    if getattr(error, "_actor_init_failed", False) and lines:  # the last line: the exception
        return f"its constructor raised {lines[-1].strip()}"[:_MAX_ERROR_CHARS]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:_MAX_ERROR_CHARS]
