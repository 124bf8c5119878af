"""The data plane against hostile peers: random and truncated frames thrown at
every socket a remote peer can reach (the launcher's handshake, the front-end's
engine sockets, the coordinator, the rendezvous) crash nothing, and requests
in flight still finish; with a shared secret, a process without it cannot
join. Real engine processes on a tiny model, real ZMQ sockets; the attacker
is this test (FUZZ: its frames are deliberately malformed)."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import msgspec
import pytest
import zmq

from dpserve import SamplingParams
from dpserve.config import EngineArgs
from dpserve.engine.dp_store import store_address
from dpserve.frontend.engine_client import AsyncEngineClient
from dpserve.launch.addresses import AddressAllocator
from dpserve.launch.engines import EngineProcManager, EngineStartupError, wait_for_engine_startup
from dpserve.launch.host import launch_engines
from dpserve.launch.rendezvous import RendezvousServer, ask_rendezvous
from dpserve.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReport,
    HandshakeHello,
    RendezvousReply,
    RendezvousRequest,
    WakeEngines,
)
from dpserve.security import secure

pytestmark = pytest.mark.procs

START_TIMEOUT = 120.0


def _junk(rng: random.Random, valid: list[bytes]) -> list[list[bytes]]:
    """FUZZ: random frames, empty ones, and valid messages cut short or padded."""
    messages: list[list[bytes]] = [[b""], [b"\x00"], [b"\x01"], [b"\xff" * 3]]
    for _ in range(40):
        n = rng.randint(1, 4)
        messages.append([rng.randbytes(rng.randint(0, 300)) for _ in range(n)])
    for body in valid:
        for cut in (1, len(body) // 2, len(body) - 1):
            messages.append([body[:cut]])
        messages.append([body + rng.randbytes(5)])
        messages.append([b"\x00", body[:-1]])
    return messages


def _throw(address: str, kind: int, messages: list[list[bytes]],
           identity: bytes | None = None) -> None:
    """Connect a socket of `kind` to `address` and send every message (FUZZ)."""
    with zmq.Context() as ctx, ctx.socket(kind) as sock:
        sock.setsockopt(zmq.LINGER, 2000)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(address)
        for frames in messages:
            frames = [f for f in frames] or [b""]
            if kind in (zmq.XSUB, zmq.XPUB) and len(frames) > 1:
                frames = frames[:1]
            sock.send_multipart(frames)


def test_junk_handshake_frames_are_dropped(tiny_llama):
    """The launcher's handshake ROUTER survives junk and still starts a real engine."""
    config = EngineArgs(model=str(tiny_llama), max_model_len=128,
                        num_kv_blocks=16).create_config()
    alloc = AddressAllocator()
    addrs = alloc.engine_addresses(1)
    result: dict = {}

    def launcher() -> None:
        try:
            result["ready"] = wait_for_engine_startup(addrs.handshake, addrs.init_metadata(),
                                                      [0], timeout=START_TIMEOUT)
        except Exception as e:  # surfaced by the assert below
            result["error"] = e

    thread = threading.Thread(target=launcher)
    thread.start()
    manager = None
    try:
        rng = random.Random(0)
        hello = msgspec.msgpack.encode(HandshakeHello(local=True))
        _throw(addrs.handshake, zmq.DEALER, _junk(rng, [hello]))  # random identity
        _throw(addrs.handshake, zmq.DEALER, _junk(rng, [b"\x92\xc3"]), identity=b"\x07\x00")
        manager = EngineProcManager(config, addrs.handshake)
        thread.join(START_TIMEOUT)
        assert "error" not in result, result.get("error")
        assert result["ready"][0].num_kv_blocks == 16
    finally:
        thread.join(1)
        if manager is not None:
            manager.close()
        alloc.cleanup()


# What the receiver of each fuzzed socket logs when it drops junk: proof that the
# junk reached it (the coordinator's lines come from its own process's stderr).
_DROPPED = {
    "front-end ROUTER": "message from unexpected engine rank",
    "front-end PULL": "undecodable message from an engine dropped",
    "coordinator reports": "dropping a bad report from an engine",
    "coordinator front XPUB": "bad message from a front-end",
    "coordinator engine XPUB": "engine socket: dropping a frame that is no subscription",
}


async def _fuzz_while_serving(model: str, logged) -> None:
    config = EngineArgs(model=model, data_parallel_size=2, threads_per_engine=1,
                        max_model_len=256, num_kv_blocks=64).create_config()
    launch = await asyncio.to_thread(launch_engines, config, 1, START_TIMEOUT)
    addrs, coordinator = launch.addresses, launch.coordinator
    client = None
    try:
        client = AsyncEngineClient(launch.input_binds(0), launch.output_binds(0),
                                   engine_ranks=launch.ranks,
                                   coordinator_address=launch.coordinator_address)
        client.watch_processes(launch.processes)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        ids = [f"r{i}" for i in range(8)]
        for i, rid in enumerate(ids):
            await client.add_request(EngineCoreRequest(rid, [1 + i, 2, 3], params))

        rng = random.Random(1)
        report = msgspec.msgpack.encode(EngineReport(0, [1, 1], step=10**9, wave=0))
        outputs = msgspec.msgpack.encode(EngineCoreOutputs(engine_index=0))
        wake = msgspec.msgpack.encode(WakeEngines(0, 0))
        targets = [  # every socket here that a peer can connect to
            (addrs.inputs[0], zmq.DEALER, [b""]),  # front-end ROUTER (engine registration)
            (addrs.outputs[0], zmq.PUSH, [outputs]),  # front-end PULL (engine outputs)
            (coordinator.engine_report_address, zmq.PUSH, [report]),
            (coordinator.front_publish_address, zmq.XSUB, [wake]),
            (coordinator.engine_publish_address, zmq.XSUB, [b"\x00"]),
        ]
        for address, kind, valid in targets:
            await asyncio.to_thread(_throw, address, kind, _junk(rng, valid))
        for _ in range(600):  # every receiver logged a drop (30 s at most)
            missing = [k for k, line in _DROPPED.items() if line not in logged()]
            if not missing:
                break
            await asyncio.sleep(0.05)
        assert not missing, f"no sign that the junk reached: {missing}"

        finished: dict[str, int] = {}
        tokens = dict.fromkeys(ids, 0)
        while len(finished) < len(ids):
            out = await asyncio.wait_for(client.get_output(), 60)
            for o in out.outputs:
                tokens[o.request_id] += len(o.new_token_ids)
                if o.finished:
                    finished[o.request_id] = tokens[o.request_id]
        assert all(n == 24 for n in finished.values()), finished
        assert all(p.is_alive() for p in launch.processes) and len(launch.processes) == 3
        assert not client.dead
        # And the processes still serve after the storm.
        await client.add_request(EngineCoreRequest("after", [5, 6, 7], params))
        while True:
            out = await asyncio.wait_for(client.get_output(), 60)
            if any(o.request_id == "after" and o.finished for o in out.outputs):
                break
    finally:
        if client is not None:
            await client.aclose()
        launch.close()


def test_fuzzed_sockets_crash_nothing_and_requests_finish(tiny_llama, capfd, caplog):
    seen: list[str] = []

    def logged() -> str:  # this process's log records, and every child's stderr so far
        seen.append(capfd.readouterr().err)
        return "".join(seen) + caplog.text

    asyncio.run(_fuzz_while_serving(str(tiny_llama), logged))


def test_rendezvous_drops_junk_and_answers():
    alloc = AddressAllocator(local_only=False)
    address = alloc.new_address("rendezvous")
    reply = RendezvousReply("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3",
                            "127.0.0.1", 4)
    server = RendezvousServer(address, reply, dp_size=2)
    try:
        good = msgspec.msgpack.encode(RendezvousRequest(1, 1))
        _throw(address, zmq.DEALER, _junk(random.Random(2), [good]))
        bad_ranks = msgspec.msgpack.encode(RendezvousRequest(0, 5))
        _throw(address, zmq.DEALER, [[bad_ranks]])
        assert ask_rendezvous(address, RendezvousRequest(1, 1), timeout=10) == reply
    finally:
        server.close()


def test_without_the_secret_a_process_cannot_join(tiny_llama):
    """With a secret, an engine (and a plain socket) without it never completes the
    handshake; an engine with it does."""
    secret = "correct horse battery staple, 32+ chars"
    alloc = AddressAllocator()
    addrs = alloc.engine_addresses(1)
    outsider = EngineArgs(model=str(tiny_llama), max_model_len=128, num_kv_blocks=16,
                          data_parallel_secret="not the secret, though long enough").create_config()
    manager = None
    try:
        manager = EngineProcManager(outsider, addrs.handshake, handshake_timeout=3)
        # Refused for the right reason: its HELLO never got through (a timeout, or the
        # outsider giving up first), not some other start-up failure.
        with pytest.raises(EngineStartupError, match=r"rank 0 NEW \(no HELLO yet\)"):
            wait_for_engine_startup(addrs.handshake, addrs.init_metadata(), [0],
                                    manager.processes, timeout=6, secret=secret)
        manager.close()
        # A plain socket gets no init metadata either.
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, b"\x00\x00")
            result: dict = {}

            def launcher() -> None:
                try:
                    wait_for_engine_startup(addrs.handshake, addrs.init_metadata(), [0],
                                            timeout=2, secret=secret)
                except EngineStartupError as e:
                    result["error"] = e

            thread = threading.Thread(target=launcher)
            thread.start()
            sock.connect(addrs.handshake)
            sock.send(msgspec.msgpack.encode(HandshakeHello(local=True)))
            assert not sock.poll(1500)
            thread.join(5)
            # It timed out: the HELLO never got through.
            assert "error" in result and "rank 0 NEW" in str(result["error"]), result
        # The same launcher starts an engine that knows the secret.
        insider = EngineArgs(model=str(tiny_llama), max_model_len=128, num_kv_blocks=16,
                             data_parallel_secret=secret).create_config()
        manager = EngineProcManager(insider, addrs.handshake)
        ready = manager.wait_for_startup(addrs.init_metadata(), timeout=START_TIMEOUT)
        assert ready[0].num_kv_blocks == 16
    finally:
        if manager is not None:
            manager.close()
        alloc.cleanup()


def _handshake(address: str, kind: int, secret: str | None) -> bool:
    """Connect a socket of `kind` (CURVE keys from `secret`, plain without one) and
    watch its ZMTP handshake: True once it succeeds, False once it fails (bounded)."""
    from zmq.utils.monitor import recv_monitor_message

    failed = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
              zmq.EVENT_HANDSHAKE_FAILED_AUTH}
    with zmq.Context() as ctx, ctx.socket(kind) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        if secret is not None:
            secure(sock, "client", secret)
        monitor = sock.get_monitor_socket()
        try:
            sock.connect(address)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if not monitor.poll(1000):
                    continue
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    return True
                if event in failed:
                    return False
            raise AssertionError(f"no handshake outcome from {address} in 60 s")
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)


def test_with_a_secret_every_socket_refuses_outsiders(tiny_llama):
    """With --data-parallel-secret, every socket a peer can reach (the front-end's
    engine sockets, the coordinator's three, the lockstep DP group's store) completes a
    handshake only with a peer that has the secret: a plain peer and one with another
    secret are refused."""
    secret = "correct horse battery staple, 32+ chars"
    config = EngineArgs(model=str(tiny_llama), data_parallel_size=2, threads_per_engine=1,
                        max_model_len=256, num_kv_blocks=64, data_parallel_lockstep=True,
                        data_parallel_secret=secret).create_config()
    asyncio.run(_refuse_outsiders(config, secret))


async def _refuse_outsiders(config, secret: str) -> None:
    launch = await asyncio.to_thread(launch_engines, config, 1, START_TIMEOUT)
    addrs, coordinator = launch.addresses, launch.coordinator
    client = None
    try:
        # The front-end binds its engine sockets: a client that knows the secret.
        client = AsyncEngineClient(launch.input_binds(0), launch.output_binds(0),
                                   engine_ranks=launch.ranks,
                                   coordinator_address=launch.coordinator_address,
                                   secret=secret)
        targets = {
            "front-end ROUTER": (addrs.inputs[0], zmq.DEALER),
            "front-end PULL": (addrs.outputs[0], zmq.PUSH),
            "coordinator reports": (coordinator.engine_report_address, zmq.PUSH),
            "coordinator front XPUB": (coordinator.front_publish_address, zmq.XSUB),
            "coordinator engine XPUB": (coordinator.engine_publish_address, zmq.XSUB),
            "DP group store": (store_address(addrs.dp_master_ip, addrs.dp_master_port),
                               zmq.DEALER),
        }
        for name, (address, kind) in targets.items():
            shake = lambda key, a=address, k=kind: asyncio.to_thread(_handshake, a, k, key)  # noqa: E731
            assert await shake(secret), f"{name}: the insider was refused"
            assert not await shake(None), f"{name}: a plain peer got in"
            assert not await shake("another secret!"), \
                f"{name}: a peer with another secret got in"
    finally:
        if client is not None:
            await client.aclose()
        launch.close()
