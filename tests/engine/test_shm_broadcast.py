"""The shared-memory broadcast (dpserve/engine/shm_broadcast.py) between real
processes: every reader gets every message once, in order, including messages
larger than the whole ring; a dead reader or writer is detected (not waited on
forever); the block is private to the user and gone once unlinked.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import stat

import pytest

from dpserve.engine.shm_broadcast import BroadcastError, BroadcastReader, BroadcastWriter

pytestmark = pytest.mark.procs

CTX = multiprocessing.get_context("spawn")
WAIT_S = 60.0  # bound of every wait on a spawned process


def _read_all(handle, index, count, results) -> None:
    reader = BroadcastReader(handle, index)
    results.put(("attached", index))
    got = [reader.dequeue(timeout=WAIT_S) for _ in range(count)]
    results.put((index, got))
    reader.close()


def _attach_and_wait(handle, index, results) -> None:
    reader = BroadcastReader(handle, index)
    results.put(("attached", index))
    while True:  # until the test kills us
        reader.dequeue(timeout=WAIT_S)


def _write_then_wait(results, attached) -> None:
    writer = BroadcastWriter(num_readers=1, num_slots=2, slot_bytes=64)
    results.put(writer.handle)
    attached.wait(WAIT_S)
    writer.unlink()  # the reader is attached: no name left behind when we are killed
    results.put("unlinked")
    attached.wait(WAIT_S)  # the test SIGKILLs us here


def _messages() -> list[object]:
    return [{"i": i, "payload": bytes([i % 251]) * (i * 37 % 3000)} for i in range(120)]


def _start_readers(writer, count, target=_read_all, extra=()) -> tuple[list, object]:
    results = CTX.Queue()
    procs = [CTX.Process(target=target, args=(writer.handle, r, *extra, results), daemon=True)
             for r in range(writer.handle.num_readers)]
    for p in procs:
        p.start()
    for _ in procs:
        assert results.get(timeout=WAIT_S)[0] == "attached"
    return procs, results


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(WAIT_S)


def test_every_reader_gets_every_message_in_order():
    messages = _messages()
    writer = BroadcastWriter(num_readers=2, num_slots=4, slot_bytes=1024)
    procs, results = _start_readers(writer, len(messages), extra=(len(messages),))
    try:
        for m in messages:  # some span several slots, so the ring wraps many times
            writer.enqueue(m, timeout=WAIT_S)
        got = dict(results.get(timeout=WAIT_S) for _ in procs)
        assert got == {0: messages, 1: messages}
        for p in procs:
            p.join(WAIT_S)
            assert p.exitcode == 0
    finally:
        writer.close()
        _stop(procs)


def test_a_message_larger_than_the_ring():
    big = {"tokens": list(range(50_000)), "blob": os.urandom(300_000)}
    writer = BroadcastWriter(num_readers=2, num_slots=3, slot_bytes=4096)  # a 12 KiB ring
    procs, results = _start_readers(writer, 2, extra=(2,))
    try:
        writer.enqueue(big, timeout=WAIT_S)
        writer.enqueue("after", timeout=WAIT_S)
        got = dict(results.get(timeout=WAIT_S) for _ in procs)
        assert got == {0: [big, "after"], 1: [big, "after"]}
    finally:
        writer.close()
        _stop(procs)


def test_the_block_is_private_and_unlinked():
    writer = BroadcastWriter(num_readers=1)
    path = f"/dev/shm/{writer.handle.name}"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    writer.close()
    assert not os.path.exists(path)


def test_a_dead_reader_is_detected_by_the_writer():
    writer = BroadcastWriter(num_readers=2, num_slots=2, slot_bytes=64)
    procs, _ = _start_readers(writer, 0, target=_attach_and_wait)
    try:
        def check_readers() -> None:
            for r, p in enumerate(procs):
                if not p.is_alive():
                    raise BroadcastError(f"reader {r} (pid {p.pid}) died")

        writer.check_readers = check_readers
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(WAIT_S)
        # Reader 1 never reads: the ring fills, and the writer notices it is dead.
        with pytest.raises(BroadcastError, match=r"reader 1 \(pid \d+\) died"):
            for _ in range(100):
                writer.enqueue(b"x" * 100, timeout=WAIT_S)
        # Without a liveness check, the timeout bounds the wait.
        writer.check_readers = None
        with pytest.raises(BroadcastError, match="in time"):
            writer.enqueue(b"y", timeout=0.5)
    finally:
        writer.close()
        _stop(procs)


def test_a_dead_writer_is_detected_by_a_reader():
    results, attached = CTX.Queue(), CTX.Event()
    proc = CTX.Process(target=_write_then_wait, args=(results, attached), daemon=True)
    proc.start()
    try:
        handle = results.get(timeout=WAIT_S)
        reader = BroadcastReader(handle, 0)
        attached.set()
        assert results.get(timeout=WAIT_S) == "unlinked"
        assert not os.path.exists(f"/dev/shm/{handle.name}")
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(BroadcastError, match=f"writer \\(pid {proc.pid}\\) is gone"):
            reader.dequeue(timeout=WAIT_S)
        reader.close()
    finally:
        _stop([proc])
