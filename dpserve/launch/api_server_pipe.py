"""What the launcher hands each API-server process, and says to it over its pipe.

Scope: `APIServerSpec` (an API server's client index, sockets and engines:
plain, picklable values), `ControlMessage` (launcher <-> API server, over the
pipe per process; the handshake is drawn in `dpserve.entrypoints.api_server`)
and `API_SERVER_READY_TIMEOUT_S`, the bound on each side's start-up wait.
Both sides import this module: the launcher (`dpserve.launch.api_servers`)
and the API server (`dpserve.entrypoints.api_server`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dpserve.protocol import RankStatus

API_SERVER_READY_TIMEOUT_S = 120.0  # build + handshake, either side


@dataclass(frozen=True)
class APIServerSpec:
    """What API server `index` needs to reach the engines (picklable, plain values)."""

    index: int  # its client index: engines route its outputs by it
    # What this API server binds: ZmqAddresses.input_binds(index) / output_binds(index)
    # (ipc for this host's engines, plus tcp twins when engines run elsewhere).
    input_address: str | tuple[str, ...]
    output_address: str | tuple[str, ...]
    engine_ranks: tuple[int, ...]
    max_model_len: int  # the engines' limit (min over their READY)
    coordinator_address: str | None  # the DP coordinator's front XPUB (None: no coordinator)
    tenant_address: str | None = None  # the coordinator's tenant ledger (None: in-process)
    api_server_count: int = 1  # API servers of this launch (> 1: routers share prefixes)


@dataclass(frozen=True)
class ControlMessage:
    """Launcher <-> API server process, over its pipe (see `dpserve.entrypoints.api_server`)."""

    kind: Literal["ready", "failed", "serve", "stopping", "drain", "drained", "close", "rank"]
    detail: str = ""  # failed / stopping: why
    rank: int = -1  # rank: whose status
    status: RankStatus | None = None  # rank: the launcher's first-hand news of it
