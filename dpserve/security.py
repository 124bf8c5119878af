"""Data-plane security: ZMQ CURVE keys derived from a shared secret, and its rules.

Scope: with `--data-parallel-secret` (or `--data-parallel-secret-file`, or
$DPSERVE_DP_SECRET), every ZMQ socket of dpserve's data plane (handshake,
engine inputs and outputs, the coordinator, the rendezvous, the lockstep DP
group's store) is a CURVE socket: the binding side is a CURVE server, the
connecting side a CURVE client. Both key pairs are derived from the secret
(scrypt, then HKDF-style per-role labels: `derive_keys`, once per process and
secret), so the server's public key is never sent anywhere: a process that
does not know the secret cannot complete the CURVE handshake, and sees nothing
of the traffic (it is encrypted). Without a secret the sockets are plain:
`check_exposure` refuses that on a non-loopback tcp:// data plane unless the
operator says the network is trusted (`--data-parallel-insecure`).

Not here: what travels (no pickle, ever: `dpserve.protocol`); gloo's own TCP
pairs of lockstep all-reduces (bound to one address, never all interfaces,
but neither authenticated nor encrypted: `dpserve.engine.dp_store`).

`address_towards(host)` is the address a listener that `host` must reach binds
to (the DP group's gloo pairs, the KV tier's cross-host pulls).

Every socket factory in dpserve calls `secure(sock, role, secret)` before
bind/connect; `role` is "server" for a bind, "client" for a connect.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import stat

import zmq
from zmq.utils import z85

from dpserve.errors import ConfigError

logger = logging.getLogger(__name__)

MAX_FRAME_BYTES = 64 << 20  # a remote peer's bigger message is dropped by ZMQ (MAXMSGSIZE)
MIN_SECRET_CHARS = 32  # a shared secret shorter than this is refused
SECRET_ENV = "DPSERVE_DP_SECRET"
# scrypt cost: ~0.1 s and 16 MiB once per process; a guess at the secret costs the same.
_SCRYPT = dict(n=1 << 14, r=8, p=1, maxmem=64 << 20, dklen=32)
_SALT = b"dpserve data-plane CURVE keys v2"


class SecretError(ConfigError):
    """A secret (or the file holding it) that cannot be used; the message names the
    option."""


@functools.lru_cache(maxsize=4)
def derive_keys(secret: str) -> dict[str, bytes]:
    """{"server", "client"}: z85 CURVE secret keys from `secret` (scrypt once, then an
    HMAC-SHA256 per role: HKDF-Expand with the role as its label). Cached: each
    process derives them once per secret."""
    master = hashlib.scrypt(secret.encode(), salt=_SALT, **_SCRYPT)
    return {role: z85.encode(hmac.new(master, f"dpserve-dp-{role}\x01".encode(),
                                      hashlib.sha256).digest())
            for role in ("server", "client")}


def secure(sock: zmq.Socket, role: str, secret: str | None) -> zmq.Socket:
    """Make `sock` a CURVE server/client keyed by `secret` (no-op without one);
    also cap incoming messages at MAX_FRAME_BYTES. Call before bind/connect."""
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    if secret is None:
        return sock
    if role not in ("server", "client"):
        raise ValueError(f"role must be 'server' or 'client', got {role!r}")
    keys = derive_keys(secret)
    if role == "server":
        sock.curve_secretkey = keys["server"]
        sock.curve_publickey = zmq.curve_public(keys["server"])
        sock.curve_server = True
    else:
        sock.curve_secretkey = keys["client"]
        sock.curve_publickey = zmq.curve_public(keys["client"])
        sock.curve_serverkey = zmq.curve_public(keys["server"])
    return sock


def check_secret(secret: str, option: str = "data_parallel_secret") -> str:
    """`secret` if it is long enough; SecretError naming `option` otherwise."""
    if len(secret) < MIN_SECRET_CHARS:
        raise SecretError(f"{option} must be at least {MIN_SECRET_CHARS} characters "
                          f"(got {len(secret)}); e.g. `openssl rand -hex 32`")
    return secret


def read_secret_file(path: str) -> str:
    """The secret in `path` (one line; surrounding whitespace dropped). SecretError
    naming --data-parallel-secret-file if it cannot be read, is readable by group or
    others, or is too short."""
    option = "data_parallel_secret_file"
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise SecretError(f"{option}: {path} is readable or writable by group or "
                                  f"others (mode {stat.S_IMODE(mode):o}); chmod 600 it")
            data = f.read(4096)
    except OSError as e:
        raise SecretError(f"{option}: cannot read {path}: {e.strerror or e}") from None
    try:
        text = data.decode().strip()
    except UnicodeDecodeError:
        raise SecretError(f"{option}: {path} is not UTF-8 text") from None
    return check_secret(text, option)


def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback one (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False  # unresolvable: it will fail later anyway; not loopback
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback
                               for i in infos)


def address_towards(host: str) -> str:
    """This host's address on the interface that routes to `host` (a UDP connect
    picks the route; no packet is sent): what a listener reachable from `host`
    binds to, never all interfaces."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host.strip("[]"), 9))
        return s.getsockname()[0]


def check_exposure(address: str, secret: str | None, insecure: bool) -> None:
    """The rule for a tcp:// data plane on `address`: SecretError (refused) when it is
    not loopback and has no secret, unless `insecure` (then `warn_plain_tcp` says so)."""
    if secret is None and not insecure and not is_loopback(address):
        raise SecretError(
            f"data_parallel_address {address} is not a loopback address: its tcp:// data "
            f"plane needs --data-parallel-secret (or --data-parallel-secret-file, "
            f"${SECRET_ENV}) on every host, or --data-parallel-insecure on a trusted "
            f"network")


RAY_AUTH_ENV = "RAY_AUTH_MODE"


def check_ray_secret(node_ip: str, secret: str | None, insecure: bool) -> None:
    """The rule for a secret handed to Ray actors: it travels in their (pickled)
    creation arguments, which Ray keeps in its GCS, readable by anyone who reaches an
    unauthenticated cluster. Off loopback that needs Ray's token authentication
    (RAY_AUTH_MODE=token, Ray >= 2.52); else SecretError, unless `insecure`, which
    only warns."""
    if secret is None or is_loopback(node_ip) or os.environ.get(RAY_AUTH_ENV) == "token":
        return
    message = (f"the data-parallel secret would reach the Ray actors in their arguments, "
               f"readable by anyone who reaches this Ray cluster ({node_ip}): start every "
               f"Ray node with {RAY_AUTH_ENV}=token (Ray >= 2.52)")
    if not insecure:
        raise SecretError(message + ", or accept it with --data-parallel-insecure")
    logger.warning("%s (--data-parallel-insecure: going on)", message)


def warn_plain_tcp(address: str, secret: str | None) -> None:
    """Log a warning when this host's tcp:// data plane on `address` has no secret."""
    if secret is None:
        logger.warning("the tcp:// data plane on %s has no --data-parallel-secret: any "
                       "process that reaches it can act as a DP rank (read its prompts, "
                       "forge its outputs)", address)
