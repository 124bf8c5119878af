"""The launcher's handle on the DP coordinator process: spawn, restart, stop.

Scope: `DPCoordinator` allocates the coordinator's addresses (ipc, plus tcp
twins on `remote_host`), spawns the process (`run_coordinator`) and replaces
it in place after a death (same addresses: engines and front-ends reconnect).

Not here: what the process does (`dpserve.launch.coordinator.proc`).
"""

from __future__ import annotations

import os
from multiprocessing.process import BaseProcess
from typing import Any

from dpserve.config import AutoscaleConfig
from dpserve.launch.addresses import AddressAllocator
from dpserve.launch.coordinator.proc import run_coordinator
from dpserve.launch.process import ProcessGroup
from dpserve.tenancy.limits import TenantLimits


class DPCoordinator:
    """Runs the coordinator process `DPCoordinator` (`dpserve.launch.coordinator.proc`).

    Addresses are allocated per instance from `allocator` (its own ipc one
    when None; pass `AddressAllocator(local_only=False, host=...)` for tcp).
    With `remote_host`, each socket also binds a tcp:// address on that host
    (the `remote_*` attributes) for engines and front-ends on other hosts.
    `publish_counts=False` (external LB) publishes wave news only.
    `tenant_limits` (--tenant-limits): the coordinator hosts the tenant ledger at
    `tenant_address` (ipc: every API server runs on this host).
    `close()`, garbage collection and interpreter exit stop the process once.
    """

    def __init__(self, num_engines: int, allocator: AddressAllocator | None = None, *,
                 remote_host: str | None = None, publish_counts: bool = True,
                 secret: str | None = None, stats_interval_s: float = 0.1,
                 idle_publish_s: float = 5.0, startup_timeout_s: float = 600.0,
                 heartbeat_timeout_s: float = 3.0, stall_timeout_s: float = 30.0,
                 dp_store: tuple[str, int] | None = None, size_max: int | None = None,
                 autoscale: AutoscaleConfig | None = None,
                 loras: dict[str, str] | None = None,
                 tenant_limits: TenantLimits | None = None) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        owned = allocator is None
        allocator = allocator or AddressAllocator(local_only=True)
        self.num_engines = num_engines
        self.front_publish_address = allocator.new_address("coord-front")
        self.engine_report_address = allocator.new_address("coord-report")
        self.engine_publish_address = allocator.new_address("coord-engines")
        self.tenant_address = (allocator.new_address("coord-tenants")
                               if tenant_limits is not None else None)
        tcp = AddressAllocator(local_only=False, host=remote_host) if remote_host else None
        self.remote_front_publish_address = tcp.new_address("") if tcp else None
        self.remote_engine_report_address = tcp.new_address("") if tcp else None
        self.remote_engine_publish_address = tcp.new_address("") if tcp else None
        self._settings = dict(publish_counts=publish_counts, secret=secret,
                              stats_interval_s=stats_interval_s,
                              idle_publish_s=idle_publish_s,
                              startup_timeout_s=startup_timeout_s,
                              heartbeat_timeout_s=heartbeat_timeout_s,
                              stall_timeout_s=stall_timeout_s, dp_store=dp_store,
                              size_max=size_max, autoscale=autoscale, loras=loras,
                              tenant_address=self.tenant_address,
                              tenant_limits=tenant_limits)
        self.proc: BaseProcess | None = None
        self._group = ProcessGroup(self, on_close=allocator.cleanup if owned else None)

    def start(self) -> None:
        """Spawn the coordinator process (returns at once; it binds its sockets)."""
        if self.proc is not None:
            raise RuntimeError("DPCoordinator already started")
        self.proc = self._group.spawn(run_coordinator, "DPCoordinator", **self._kwargs())

    def _kwargs(self) -> dict[str, Any]:
        return dict(num_engines=self.num_engines, parent_pid=os.getpid(),
                    front_publish_address=_both(self.front_publish_address,
                                                self.remote_front_publish_address),
                    engine_report_address=_both(self.engine_report_address,
                                                self.remote_engine_report_address),
                    engine_publish_address=_both(self.engine_publish_address,
                                                 self.remote_engine_publish_address),
                    **self._settings)

    def restart(self) -> None:
        """A new coordinator process on the same addresses (the old one has exited).

        Engines and front-ends reconnect by themselves; it sends READY once every
        engine has subscribed again, and learns loads and health from their reports."""
        assert self.proc is not None
        self.proc.join(timeout=1.0)
        self.proc = self._group.replace(self.proc, run_coordinator, **self._kwargs())

    def close(self) -> None:
        """Stop the process (terminate -> join -> kill) and remove owned ipc files."""
        self._group.close()

    def __enter__(self) -> DPCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _both(local: str, remote: str | None) -> list[str]:
    return [local] if remote is None else [local, remote]
