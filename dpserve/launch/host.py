"""Starting a host's engines, and the coordinator, for `dpserve serve` and the offline LLM.

Scope: `launch_engines(config, num_clients)` runs the start-up of one host
in every launch mode (DESIGN "Launch modes") and returns an `EngineLaunch`
that holds what it started: the engine processes (or Ray actors), the DP
coordinator, the rendezvous, the addresses the front-ends bind.

    one host (default)   N local engines; coordinator when N > 1; ipc:// only
    head + headless      the head runs ranks [0, L) and binds tcp:// twins of
                         its sockets on --data-parallel-address; headless hosts
                         handshake at tcp://address:rpc_port (local=False)
    external / hybrid    every host runs its own API servers over its own ranks;
    (local_lb)           rank 0's host also runs the coordinator (tcp) and the
                         rendezvous at tcp://address:rpc_port, which tells the
                         other hosts' launchers where the coordinator is
    ray                  every rank is a Ray actor (`dpserve.launch.ray_backend`); all
                         data-plane addresses are tcp:// on --data-parallel-address

With --kv-offload-memory (mp backend), the host's KV store starts first
(`dpserve.launch.kv_store`), and the config its engines get names its address
(`CacheConfig.kv_tier_address`); the supervisor restarts it, `close()` stops it.

Not here: the API servers (`dpserve.entrypoints.api_server`,
`dpserve.launch.api_server_watch`), the HTTP socket (`dpserve.entrypoints.serve`),
a `--headless` host (`dpserve.launch.headless`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import msgspec

from dpserve.config import ConfigError, EngineConfig
from dpserve.launch.addresses import AddressAllocator, ZmqAddresses, url_host
from dpserve.launch.coordinator.autoscale import NO_CEILING
from dpserve.launch.engines import EngineProcManager, RejoinServer
from dpserve.launch.kv_store import KVStore, start_kv_store
from dpserve.launch.rendezvous import RendezvousServer, ask_rendezvous
from dpserve.launch.scaler import CapacityError, Scaler
from dpserve.launch.supervisor import OnStatus, Supervisor
from dpserve.placement import engines_fit, experts_fit
from dpserve.protocol import (
    EngineInitMetadata,
    HandshakeReady,
    RendezvousReply,
    RendezvousRequest,
)
from dpserve.security import warn_plain_tcp
from dpserve.tenancy.limits import TenantLimits

if TYPE_CHECKING:
    from dpserve.launch.coordinator import DPCoordinator

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineLaunch:
    """What `launch_engines` started on this host; `close()` stops it all (idempotent)."""

    allocator: AddressAllocator
    addresses: ZmqAddresses | None = None
    manager: Any = None  # EngineProcManager, or RayEngineManager
    coordinator: DPCoordinator | None = None
    rendezvous: RendezvousServer | None = None
    ready: dict[int, HandshakeReady] = dataclasses.field(default_factory=dict)
    ranks: tuple[int, ...] = ()  # the engines this host's front-ends send to
    coordinator_address: str | None = None  # the coordinator's front XPUB, for front-ends
    init: EngineInitMetadata | None = None  # what this host's engines are told (restarts)
    ready_timeout: float = 600.0
    supervisor: Supervisor | None = None
    scaler: Scaler | None = None  # carries out changes of the engine count (elastic)
    rejoin: RejoinServer | None = None  # the head's handshake for restarted remote engines
    kv_store: KVStore | None = None  # this host's KV tier (--kv-offload-memory)
    tenant_limits: TenantLimits | None = None  # --tenant-limits: the coordinator's ledger
    tenant_address: str | None = None  # ... where the API servers reach it (None: none)
    config: EngineConfig | None = None  # what the engines run with (scaling checks room)

    @property
    def processes(self) -> list[BaseProcess]:
        """Local processes to watch: the engines (mp backend), then the coordinator."""
        procs = list(getattr(self.manager, "processes", []))
        if self.coordinator is not None and self.coordinator.proc is not None:
            procs.append(self.coordinator.proc)
        return procs

    @property
    def max_model_len(self) -> int:
        """The engines' limit: the config's, capped by the smallest KV cache."""
        return min(r.max_model_len for r in self.ready.values())

    def input_binds(self, client: int) -> tuple[str, ...]:
        assert self.addresses is not None
        return tuple(self.addresses.input_binds(client))

    def output_binds(self, client: int) -> tuple[str, ...]:
        assert self.addresses is not None
        return tuple(self.addresses.output_binds(client))

    def supervise(self, config: EngineConfig, on_status: OnStatus,
                  on_fatal: Callable[[str], None],
                  stopping: Callable[[], bool] = lambda: False) -> None:
        """Apply the failure policy to this host's engines (processes or Ray actors)
        and coordinator from now on (`dpserve.launch.supervisor`). `stopping()`: the
        server drains; clean exits then are expected."""
        if self.manager is not None or self.coordinator is not None:
            self.supervisor = Supervisor(self, config, on_status, on_fatal, stopping)
        if config.parallel.elastic and self.coordinator_address is not None:
            self.scaler = Scaler(self, config)

    def check_room(self, size: int) -> None:
        """CapacityError when the engines cannot number `size`: each needs an expert
        per worker (expert parallelism), and on this host (mp backend) the cores or
        CUDA devices placement gives it (`placement.engines_fit`), unless the operator
        declared a ceiling (--data-parallel-size-max, the autoscale MAX): then they
        share them, as engines started beyond the cores do. Ray checks its cluster
        when the ranks are placed (`add_engines`)."""
        config = self.config
        assert config is not None
        p = config.parallel
        missing = experts_fit(config, size)
        if missing is None and p.data_parallel_backend != "ray":
            missing = engines_fit(p, config.device, size)
            if missing is not None and p.data_parallel_size_max is not None:
                logger.warning("scaling to %d engines under the declared ceiling of %d: "
                               "they share the host (%s)", size, p.data_parallel_size_max,
                               missing)
                return
        if missing is not None:
            raise CapacityError(missing)

    def add_engines(self, ranks: list[int]) -> None:
        """Start engines for new `ranks` (scaling up), READY when this returns; on
        failure none of them is left running (EngineStartupError; CapacityError when
        Ray's cluster cannot place them)."""
        from dpserve.launch.ray_placement import RayPlacementError

        assert self.manager is not None and self.init is not None
        self.init = msgspec.structs.replace(self.init, dp_size=max(ranks) + 1)
        coordinator = [self.coordinator.proc] if self.coordinator and self.coordinator.proc \
            else []
        try:
            self.ready.update(self.manager.add_ranks(ranks, self.init, self.ready_timeout,
                                                     also_watch=coordinator))
        except RayPlacementError as e:
            raise CapacityError(str(e)) from None
        self.ranks = tuple(sorted({*self.ranks, *ranks}))
        if self.supervisor is not None:
            for rank in ranks:
                self.supervisor.reset_rank(rank)

    def remove_engine(self, rank: int, timeout: float) -> None:
        """Stop `rank`'s engine (scaling down; it holds no requests any more)."""
        assert self.manager is not None and self.init is not None
        self.manager.remove_rank(rank, timeout)
        self.init = msgspec.structs.replace(self.init, dp_size=min(self.init.dp_size, rank))
        self.ready.pop(rank, None)
        self.ranks = tuple(r for r in self.ranks if r != rank)

    def restart_engine(self, rank: int, incarnation: int) -> None:
        """A new engine (process or Ray actor) for this host's `rank`, READY when this
        returns."""
        assert self.manager is not None and self.init is not None
        ready = self.manager.restart(rank, incarnation, self.init, self.ready_timeout)
        self.ready[rank] = ready

    def close(self) -> None:
        if self.scaler is not None:
            self.scaler.close()
        if self.supervisor is not None:
            self.supervisor.close()
        try:
            if self.manager is not None:
                self.manager.close()
        finally:
            if self.rejoin is not None:
                self.rejoin.close()
            if self.rendezvous is not None:
                self.rendezvous.close()
            if self.coordinator is not None:
                self.coordinator.close()
            if self.kv_store is not None:
                self.kv_store.close()
            self.allocator.cleanup()


def launch_engines(config: EngineConfig, num_clients: int = 1,
                   ready_timeout: float = 600.0,
                   tenant_limits: TenantLimits | None = None) -> EngineLaunch:
    """Start this host's part (see the module docstring) and wait for READY.

    `tenant_limits` (--tenant-limits; not with external / hybrid LB): the
    coordinator holds the tenant ledger (`EngineLaunch.tenant_address`), and one is
    started for it when several API servers share the engines (`num_clients` > 1).

    Raises `EngineStartupError` when a process dies or `ready_timeout`
    passes; on any failure (Ctrl-C included) everything started is stopped.
    """
    p = config.parallel
    if not p.local_lb and p.data_parallel_start_rank != 0:
        raise ConfigError(f"data_parallel_start_rank {p.data_parallel_start_rank} needs "
                          f"--headless (engines for a head) or --data-parallel-hybrid-lb")
    if p.tcp_data_plane:
        warn_plain_tcp(p.data_parallel_address, p.data_parallel_secret)
    if tenant_limits is not None and p.local_lb:
        raise ConfigError("--tenant-limits cannot be used with external or hybrid load "
                          "balancing (--data-parallel-rank, --data-parallel-hybrid-lb): "
                          "each host would keep its own ledger")
    launch = EngineLaunch(AddressAllocator(), ready_timeout=ready_timeout,
                          tenant_limits=tenant_limits)
    try:
        config, launch.kv_store = start_kv_store(config, launch.allocator)
        launch.config = config
        if p.data_parallel_backend == "ray":
            _launch_ray(launch, config, num_clients, ready_timeout)
        elif p.local_lb:
            _launch_local_lb(launch, config, num_clients, ready_timeout)
        else:
            _launch_head(launch, config, num_clients, ready_timeout)
    except BaseException:
        launch.close()
        raise
    return launch


def _needs_coordinator(config: EngineConfig, num_clients: int,
                       tenants: bool = False) -> bool:
    """Several engines, elastic DP, or LoRA or tenant limits with several API servers
    (the coordinator holds the adapter registry and the tenant ledger that every API
    server must see)."""
    p = config.parallel  # elastic: at DP=1 only when asked (`placement.elastic_scaling`)
    return p.data_parallel_size > 1 or p.elastic or (
        (config.lora is not None or tenants) and num_clients > 1)


def _start_coordinator(launch: EngineLaunch, config: EngineConfig, ready_timeout: float, *,
                       remote: bool, dp_store: tuple[str, int],
                       publish_counts: bool = True) -> DPCoordinator:
    """Start the DP coordinator; in lockstep mode it also hosts the DP group's store at
    `dp_store` (the engines' init metadata names it as dp_master_ip/port)."""
    from dpserve.launch.coordinator import DPCoordinator

    p = config.parallel
    coordinator = DPCoordinator(p.data_parallel_size, launch.allocator,
                                remote_host=p.data_parallel_address if remote else None,
                                publish_counts=publish_counts, secret=p.data_parallel_secret,
                                # A backstop, later than the launcher's own wait of
                                # ready_timeout: that one ends first and names the
                                # ranks that never said HELLO.
                                startup_timeout_s=ready_timeout + 10.0,
                                heartbeat_timeout_s=p.engine_heartbeat_timeout,
                                stall_timeout_s=p.engine_stall_timeout,
                                dp_store=dp_store if p.data_parallel_lockstep else None,
                                size_max=(p.data_parallel_size_max or NO_CEILING)
                                if p.elastic else None,
                                autoscale=p.autoscale if p.elastic else None,
                                # the LoRA registry starts with --lora-modules
                                loras=dict(config.lora.modules) if config.lora else None,
                                tenant_limits=launch.tenant_limits)
    launch.coordinator = coordinator
    coordinator.start()
    launch.coordinator_address = coordinator.front_publish_address
    launch.tenant_address = coordinator.tenant_address
    return coordinator


def _launch_head(launch: EngineLaunch, config: EngineConfig, num_clients: int,
                 ready_timeout: float) -> None:
    """One host, or the head of head + headless hosts."""
    p = config.parallel
    size, local = p.data_parallel_size, p.data_parallel_size_local
    remote = p.has_remote_engines
    addrs = launch.allocator.engine_addresses(
        num_clients, remote_host=p.data_parallel_address if remote else None,
        rpc_port=p.data_parallel_rpc_port)
    tenants = launch.tenant_limits is not None
    if _needs_coordinator(config, num_clients, tenants):  # first: engines connect while loading
        addrs = addrs.with_coordinator(_start_coordinator(
            launch, config, ready_timeout, remote=remote,
            dp_store=(addrs.dp_master_ip, addrs.dp_master_port)))
    launch.addresses = addrs
    logger.info("starting %d local engine(s)%s", local,
                f"; waiting for {size - local} remote one(s) at {addrs.remote_handshake}"
                if remote else "")
    launch.manager = EngineProcManager(config, addrs.handshake, num_engines=local)
    coordinator = [launch.coordinator.proc] if launch.coordinator else []
    launch.init = addrs.init_metadata(dp_size=size)
    launch.ready = launch.manager.wait_for_startup(
        launch.init, timeout=ready_timeout, also_watch=coordinator,
        remote_ranks=range(local, size),
        remote_init=addrs.init_metadata(dp_size=size, local=False) if remote else None,
        remote_handshake=addrs.remote_handshake)
    launch.ranks = tuple(range(size))
    if remote:  # a headless host that restarts an engine handshakes here again
        launch.rejoin = RejoinServer(addrs.remote_handshake, addrs.init_metadata(
            dp_size=size, local=False), range(local, size), secret=p.data_parallel_secret)


def _launch_local_lb(launch: EngineLaunch, config: EngineConfig, num_clients: int,
                     ready_timeout: float) -> None:
    """External (--data-parallel-rank) or hybrid LB: this host's engines, its front-ends."""
    p = config.parallel
    size = p.data_parallel_size
    rendezvous = (f"tcp://{url_host(p.data_parallel_address)}:{p.data_parallel_rpc_port}")
    addrs = launch.allocator.engine_addresses(num_clients)
    if p.data_parallel_start_rank == 0:  # this host leads: coordinator + rendezvous
        store = (p.data_parallel_address,
                 AddressAllocator(local_only=False, host=p.data_parallel_address).free_port())
        coordinator = _start_coordinator(
            launch, config, ready_timeout, remote=True, dp_store=store,
            publish_counts=p.data_parallel_rank is None)  # external LB: waves only
        reply = RendezvousReply(
            coordinator_input=coordinator.remote_engine_publish_address,
            coordinator_output=coordinator.remote_engine_report_address,
            coordinator_front=coordinator.remote_front_publish_address,
            dp_master_ip=store[0], dp_master_port=store[1])
        launch.rendezvous = RendezvousServer(rendezvous, reply, size,
                                             secret=p.data_parallel_secret)
        addrs = dataclasses.replace(addrs.with_coordinator(coordinator),
                                    dp_master_ip=reply.dp_master_ip,
                                    dp_master_port=reply.dp_master_port)
    else:
        logger.info("asking the head at %s where the DP coordinator is", rendezvous)
        reply = ask_rendezvous(rendezvous, RendezvousRequest(p.data_parallel_start_rank,
                                                             p.data_parallel_size_local),
                               timeout=ready_timeout, secret=p.data_parallel_secret)
        addrs = dataclasses.replace(addrs, coordinator_input=reply.coordinator_input,
                                    coordinator_output=reply.coordinator_output,
                                    dp_master_ip=reply.dp_master_ip,
                                    dp_master_port=reply.dp_master_port)
        launch.coordinator_address = reply.coordinator_front
    launch.addresses = addrs
    launch.manager = EngineProcManager(config, addrs.handshake,
                                       num_engines=p.data_parallel_size_local,
                                       start_rank=p.data_parallel_start_rank)
    coordinator_procs = [launch.coordinator.proc] if launch.coordinator else []
    launch.init = addrs.init_metadata(dp_size=size)
    launch.ready = launch.manager.wait_for_startup(launch.init,
                                                   timeout=ready_timeout,
                                                   also_watch=coordinator_procs)
    launch.ranks = tuple(p.local_ranks)


def _launch_ray(launch: EngineLaunch, config: EngineConfig, num_clients: int,
                ready_timeout: float) -> None:
    """Every rank a Ray actor; front-ends and coordinator here, tcp twins for the actors."""
    from dpserve.launch.engines import EngineStartupError
    from dpserve.launch.ray_backend import RayEngineManager
    from dpserve.launch.ray_placement import RayPlacementError

    p = config.parallel
    size = p.data_parallel_size
    addrs = launch.allocator.engine_addresses(
        num_clients, remote_host=p.data_parallel_address, rpc_port=p.data_parallel_rpc_port)
    tenants = launch.tenant_limits is not None
    if _needs_coordinator(config, num_clients, tenants):  # first: engines connect while loading
        addrs = addrs.with_coordinator(_start_coordinator(
            launch, config, ready_timeout, remote=True,
            dp_store=(addrs.dp_master_ip, addrs.dp_master_port)))
    launch.addresses = addrs
    coordinator = [launch.coordinator.proc] if launch.coordinator else []
    try:
        launch.init = addrs.init_metadata(dp_size=size, local=False)
        launch.manager = RayEngineManager(config, launch.init)
        launch.ready = launch.manager.wait_for_startup(ready_timeout, also_watch=coordinator)
    except RayPlacementError as e:
        raise EngineStartupError(str(e)) from None
    launch.ranks = tuple(range(size))

