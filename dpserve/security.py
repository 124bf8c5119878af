"""Data-plane security: ZMQ CURVE keys derived from a shared secret.

Scope: with `--data-parallel-secret` (or $DPSERVE_DP_SECRET), every ZMQ
socket of dpserve's data plane (handshake, engine inputs and outputs, the
coordinator, the rendezvous) is a CURVE socket: the binding side is a CURVE
server, the connecting side a CURVE client. Both key pairs are derived from
the secret (SHA-256 with a per-role label), so the server's public key is
never sent anywhere: a process that does not know the secret cannot complete
the CURVE handshake, and sees nothing of the traffic (it is encrypted).
Without a secret the sockets are plain (trusted networks, one host).

Not here: what travels (no pickle, ever: `dpserve.protocol`), the gloo TCP
store of lockstep all-reduces (torch's; keep it on a private network).

Every socket factory in dpserve calls `secure(sock, role, secret)` before
bind/connect; `role` is "server" for a bind, "client" for a connect.
"""

from __future__ import annotations

import hashlib

import zmq
from zmq.utils import z85

MAX_FRAME_BYTES = 64 << 20  # a remote peer's bigger message is dropped by ZMQ (MAXMSGSIZE)


def _secret_key(secret: str, role: str) -> bytes:
    digest = hashlib.sha256(f"dpserve-dp-{role}\0{secret}".encode()).digest()
    return z85.encode(digest)


def secure(sock: zmq.Socket, role: str, secret: str | None) -> zmq.Socket:
    """Make `sock` a CURVE server/client keyed by `secret` (no-op without one);
    also cap incoming messages at MAX_FRAME_BYTES. Call before bind/connect."""
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    if secret is None:
        return sock
    server_secret = _secret_key(secret, "server")
    if role == "server":
        sock.curve_secretkey = server_secret
        sock.curve_publickey = zmq.curve_public(server_secret)
        sock.curve_server = True
    elif role == "client":
        client_secret = _secret_key(secret, "client")
        sock.curve_secretkey = client_secret
        sock.curve_publickey = zmq.curve_public(client_secret)
        sock.curve_serverkey = zmq.curve_public(server_secret)
    else:
        raise ValueError(f"role must be 'server' or 'client', got {role!r}")
    return sock
