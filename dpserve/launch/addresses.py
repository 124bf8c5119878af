"""Addresses of one serving instance: the one place that allocates them.

`AddressAllocator` hands out unique ipc:// paths (in a private temp dir) or
tcp:// ports, never fixed names; `ZmqAddresses` is the set one instance
uses (handshake, the front-ends' engine sockets, the coordinator's, the DP
store), with tcp:// twins when engines run on other hosts.
"""

from __future__ import annotations

import atexit
import dataclasses
import fcntl
import functools
import os
import secrets
import shutil
import socket
import tempfile
import threading
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from dpserve.protocol import EngineInitMetadata

_MAX_IPC_PATH = 100  # sockaddr_un holds 107 bytes; keep a margin


@dataclass(frozen=True)
class ZmqAddresses:
    """Where the sockets of one serving instance live (picklable, plain strings).

    The launcher binds `handshake`; front-end i binds `inputs[i]` (ROUTER)
    and `outputs[i]` (PULL); engines connect to all of them. Engines on this
    host use these ipc:// addresses; when some run on other hosts, each
    socket also binds the tcp:// address of the `remote_*` twin, and remote
    engines are told those (`init_metadata(local=False)`).
    """

    handshake: str
    inputs: tuple[str, ...]  # [num_clients] front-end ROUTER (requests in)
    outputs: tuple[str, ...]  # [num_clients] front-end PULL (outputs back)
    coordinator_input: str | None = None  # the coordinator's engine XPUB
    coordinator_output: str | None = None  # the coordinator's report PULL
    # Where the DP coordinator hosts the store (ZMQ, `DPStoreServer`) of the lockstep group.
    dp_master_ip: str = "127.0.0.1"
    dp_master_port: int = 0
    remote_handshake: str | None = None
    remote_inputs: tuple[str, ...] | None = None
    remote_outputs: tuple[str, ...] | None = None
    remote_coordinator_input: str | None = None
    remote_coordinator_output: str | None = None

    def init_metadata(self, dp_size: int = 1, local: bool = True) -> EngineInitMetadata:
        """What the launcher tells each engine (on this host or not) after its HELLO."""
        if local:
            inputs, outputs = self.inputs, self.outputs
            coordinator = (self.coordinator_input, self.coordinator_output)
        else:
            if self.remote_inputs is None or self.remote_outputs is None:
                raise ValueError("these addresses have no tcp:// twins for remote engines")
            inputs, outputs = self.remote_inputs, self.remote_outputs
            coordinator = (self.remote_coordinator_input, self.remote_coordinator_output)
        return EngineInitMetadata(
            input_addresses=list(inputs), output_addresses=list(outputs),
            coordinator_input=coordinator[0], coordinator_output=coordinator[1],
            dp_master_ip=self.dp_master_ip, dp_master_port=self.dp_master_port,
            dp_size=dp_size)

    def input_binds(self, client: int) -> list[str]:
        """Every address front-end `client` binds its ROUTER to."""
        return [self.inputs[client], *([self.remote_inputs[client]] if self.remote_inputs
                                       else [])]

    def output_binds(self, client: int) -> list[str]:
        """Every address front-end `client` binds its PULL to."""
        return [self.outputs[client], *([self.remote_outputs[client]] if self.remote_outputs
                                        else [])]

    def with_coordinator(self, coordinator: Any) -> ZmqAddresses:
        """These addresses, naming a started `DPCoordinator`'s engine sockets."""
        return dataclasses.replace(
            self, coordinator_input=coordinator.engine_publish_address,
            coordinator_output=coordinator.engine_report_address,
            remote_coordinator_input=coordinator.remote_engine_publish_address,
            remote_coordinator_output=coordinator.remote_engine_report_address)


class AddressAllocator:
    """Unique addresses for one serving instance: never fixed names or ports.

    local_only: `ipc://` paths in a private temp dir, removed by `cleanup()`
    or at interpreter exit (not when the allocator is collected: the
    addresses it handed out may outlive it); else
    `tcp://host:port` on ports that were free when asked for, chosen
    outside the kernel's ephemeral range (`pick_port`).
    """

    def __init__(self, local_only: bool = True, host: str = "127.0.0.1") -> None:
        self.local_only = local_only
        self.host = host
        self._count = 0
        self._ports: set[int] = set()
        self.ipc_dir: str | None = None
        if local_only:
            self.ipc_dir = tempfile.mkdtemp(prefix="dpserve-")
            if len(self.ipc_dir) > _MAX_IPC_PATH - 24:  # a long $TMPDIR
                os.rmdir(self.ipc_dir)
                self.ipc_dir = tempfile.mkdtemp(prefix="dpserve-", dir="/tmp")
        self._remove_dir = functools.partial(_remove_dir, self.ipc_dir, os.getpid())
        atexit.register(self._remove_dir)

    def new_address(self, name: str) -> str:
        self._count += 1
        if self.ipc_dir is not None:
            return f"ipc://{self.ipc_dir}/{name}-{self._count}"
        return f"tcp://{url_host(self.host)}:{self._free_port()}"

    def engine_addresses(self, num_clients: int = 1, remote_host: str | None = None,
                         rpc_port: int | None = None) -> ZmqAddresses:
        """Handshake and per-front-end input/output addresses, and a free TCP port
        on `host` (127.0.0.1 for ipc) for the DP group's store. The coordinator's
        come from the coordinator itself (`ZmqAddresses.with_coordinator`).

        remote_host: engines on other hosts will connect: add tcp:// twins on
        that address (the handshake on `rpc_port`); the DP store moves there too.
        """
        if remote_host is not None:
            tcp = AddressAllocator(local_only=False, host=remote_host)
            return dataclasses.replace(
                self.engine_addresses(num_clients),
                remote_handshake=f"tcp://{url_host(remote_host)}:{rpc_port}",
                remote_inputs=tuple(tcp.new_address("") for _ in range(num_clients)),
                remote_outputs=tuple(tcp.new_address("") for _ in range(num_clients)),
                dp_master_ip=remote_host, dp_master_port=tcp.free_port())
        return ZmqAddresses(
            handshake=self.new_address("handshake"),
            inputs=tuple(self.new_address(f"input{i}") for i in range(num_clients)),
            outputs=tuple(self.new_address(f"output{i}") for i in range(num_clients)),
            dp_master_ip=self.host, dp_master_port=self._free_port())

    def cleanup(self) -> None:
        """Remove the ipc dir (idempotent)."""
        atexit.unregister(self._remove_dir)
        self._remove_dir()

    def free_port(self) -> int:
        """A TCP port on `host` that was free when asked for (never one handed out before)."""
        return self._free_port()

    def _free_port(self) -> int:
        port = pick_port(self.host, avoid=self._ports)
        self._ports.add(port)
        return port


# Ports handed out for later binding come from below the ephemeral range: a port
# there is only ever taken by someone naming it, never by a process binding port 0
# or an outgoing connection (the local Ray instance's raylet, gcs and workers bind
# dozens while the engines start, between the choice and the front-end's bind).
# The window starts above Ray's default worker ports (10002-19999).
_STATIC_LOW = 20000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def pick_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A TCP port on `host` that is free now, not in `avoid`, and outside the
    kernel's ephemeral range when that leaves a window of 1,000 ports or more
    (else any free port, the usual race). A port from the window is reserved
    against every other dpserve process on this host (`reserve_port`) while this
    process lives, so two servers starting at once never choose the same one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    high = _ephemeral_low() - 1
    if high - _STATIC_LOW >= 1000:
        for _ in range(200):
            port = _STATIC_LOW + secrets.randbelow(high - _STATIC_LOW + 1)
            if port not in avoid and _bindable(family, host, port) \
                    and reserve_port(host, port):
                return port
    for _ in range(100):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port
    raise RuntimeError(f"could not find a free TCP port on {host}")


# Reservations: a port chosen here is bound later, by this process or a child (an
# API server, an engine), so between the choice and the bind another dpserve
# process (a second server starting, another test worker) could choose it too. An
# exclusive flock on a per-port file, held by the choosing process, closes that
# window among dpserve processes; the kernel drops it when the process ends,
# however it ends. The newest _MAX_RESERVED are kept (older ones are bound by now).
_MAX_RESERVED = 256
_reserved: deque[tuple[str, int, int]] = deque()  # (host, port, locked fd), oldest first
_reserved_lock = threading.Lock()


def reserve_port(host: str, port: int) -> bool:
    """Reserve `port` on `host` for this process among dpserve processes on this host:
    False when another live process holds it (True again if this one does)."""
    with _reserved_lock:
        if any(h == host and p == port for h, p, _ in _reserved):
            return True
        folder = os.path.join(tempfile.gettempdir(), f"dpserve-ports-{os.getuid()}")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(folder, f"{host}-{port}"), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        _reserved.append((host, port, fd))
        if len(_reserved) > _MAX_RESERVED:
            os.close(_reserved.popleft()[2])  # closing the fd drops its lock
        return True


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default when unknown)."""
    try:
        with open(_EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(family: int, host: str, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def url_host(host: str) -> str:
    """`host` as it goes in a tcp:// URL (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host else host


def _remove_dir(path: str | None, owner_pid: int) -> None:
    if path is not None and os.getpid() == owner_pid:  # never from a forked child
        shutil.rmtree(path, ignore_errors=True)

