"""The tenant ledger's messages between API servers and the DP coordinator.

Scope: what an API server's DEALER (`dpserve.server.tenant_link`) and the
coordinator's tenant ROUTER (`dpserve.launch.coordinator.tenants`) exchange,
msgpack-encoded, one frame each (the ROUTER adds the DEALER's identity):

    API server -> coordinator (`TenantMessage`, tagged):
      TenantAdmit(seq, request_id, tenant, prompt_tokens, max_tokens)
                                 -> one TenantVerdict(seq, refusal) back
      TenantStarted(request_id)  its first token came (no reply)
      TenantFinished(request_id, generated_tokens)                  (no reply)
      TenantSync(request_ids)   every SYNC_INTERVAL_S: the API server
                                 is alive, and these are all its requests the
                                 ledger may hold (admitted or being admitted);
                                 the coordinator drops the others of its
                                 session, and all of a session not heard from
                                 for SESSION_TIMEOUT_S (an API server that died)
    coordinator -> API server: TenantVerdict

Keys: a request is (the DEALER's identity, request_id); each API-server process
connects with a fresh random identity (its session), so a restarted API server
never collides with its predecessor's entries.

Not here: the rest of the coordinator's messages (`dpserve.protocol`).
"""

from __future__ import annotations

import msgspec

SYNC_INTERVAL_S = 1.0  # how often an API server sends TenantSync
SESSION_TIMEOUT_S = 5.0  # a session not heard from for this long is dropped


class RefusalInfo(msgspec.Struct, array_like=True, gc=False):
    """`dpserve.tenancy.ledger.Refusal` on the wire."""

    limit: str
    value: int
    remaining: int
    cost: int
    retry_after_s: int
    reset_s: int


class TenantAdmit(msgspec.Struct, tag="admit", array_like=True, gc=False):
    seq: int  # matches the verdict to the ask
    request_id: str
    tenant: str
    prompt_tokens: int
    max_tokens: int


class TenantStarted(msgspec.Struct, tag="started", array_like=True, gc=False):
    request_id: str


class TenantFinished(msgspec.Struct, tag="finished", array_like=True, gc=False):
    request_id: str
    generated_tokens: int


class TenantSync(msgspec.Struct, tag="sync", array_like=True, gc=False):
    request_ids: list[str]


class TenantVerdict(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    seq: int
    refusal: RefusalInfo | None = None  # None: admitted


TenantMessage = TenantAdmit | TenantStarted | TenantFinished | TenantSync
