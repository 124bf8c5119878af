"""One writer, N readers over shared memory: the engine core hands each step's
inputs to its tensor-parallel workers as one message, read by all of them.

Scope: the ring of slots in a `multiprocessing.shared_memory.SharedMemory`
block (created by the writer, mode 0600), pickled messages chunked over the
slots, bounded waits with liveness checks on both sides. The peers are one
user's processes of one engine (trusted: pickle).

Layout: `num_slots` slots, then one sequence table per party:

    slot i          [u32 chunk bytes][u32 last-chunk flag][payload: slot_bytes]
    written[i]      u64: 1 + number of the chunk the writer last completed in slot i
    read[r][i]      u64: 1 + number of the chunk reader r last finished in slot i

Chunk k (counted over all messages) goes to slot k % num_slots. The writer
fills it once every reader has finished chunk k - num_slots there (the chunk
it overwrites), then publishes `written = k + 1`; reader r copies it out once
`written == k + 1`, then publishes `read[r] = k + 1`. Every sequence word
has one writing party and is compared for equality only, so a torn 8-byte
store is never mistaken for a finished one; the payload is stored before the
sequence word (`_fence` between them). A message larger than the ring just
streams through it while the readers consume.

Waits: the writer waits for a free slot only up to its timeout, and only while
`check_readers` (the caller's liveness check) passes. Readers spin briefly,
then yield, then sleep with a backoff capped at `MAX_SLEEP_S` (an idle worker
must not burn a core), and fail once the writer's process is gone.

Not here: what the messages mean and the workers (`dpserve.engine.executor`).
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Any

SPIN_POLLS = 64  # polls before a waiting party yields
YIELD_POLLS = 64  # then polls with sched_yield between them
MAX_SLEEP_S = 0.001  # then sleeps, doubling from 10 us up to this
LIVENESS_EVERY_S = 0.05  # how often a sleeping waiter checks the other side
_HEADER = struct.Struct("<II")  # chunk bytes, last-chunk flag
_SEQ = struct.Struct("<Q")
_fence_lock = threading.Lock()


class BroadcastError(RuntimeError):
    """The other side of the broadcast died, or a wait timed out."""


@dataclass(frozen=True)
class BroadcastHandle:
    """What a reader needs to attach (picklable, sent to spawned processes)."""

    name: str  # the SharedMemory block
    num_readers: int
    num_slots: int
    slot_bytes: int
    writer_pid: int


class _Ring:
    """Offsets into the shared block (see the module docstring)."""

    def __init__(self, shm: SharedMemory, handle: BroadcastHandle) -> None:
        self.shm, self.handle = shm, handle
        self.buf = shm.buf
        self.slot_stride = _HEADER.size + handle.slot_bytes
        self.tables = handle.num_slots * self.slot_stride

    @staticmethod
    def size(num_readers: int, num_slots: int, slot_bytes: int) -> int:
        return num_slots * (_HEADER.size + slot_bytes) + (1 + num_readers) * num_slots * 8

    def seq_offset(self, party: int, slot: int) -> int:
        """party 0: the writer's table; party r + 1: reader r's."""
        return self.tables + (party * self.handle.num_slots + slot) * 8

    def seq(self, party: int, slot: int) -> int:
        return _SEQ.unpack_from(self.buf, self.seq_offset(party, slot))[0]

    def set_seq(self, party: int, slot: int, value: int) -> None:
        _fence()
        _SEQ.pack_into(self.buf, self.seq_offset(party, slot), value)
        _fence()


def _fence() -> None:
    """A full memory barrier (a lock's acquire and release are atomic operations)."""
    with _fence_lock:
        pass


class _Backoff:
    """Spin, then yield, then sleep with a capped doubling backoff."""

    def __init__(self) -> None:
        self.polls = 0
        self.sleep = 1e-5

    def wait(self) -> None:
        self.polls += 1
        if self.polls <= SPIN_POLLS:
            return
        if self.polls <= SPIN_POLLS + YIELD_POLLS:
            os.sched_yield()
            return
        time.sleep(self.sleep)
        self.sleep = min(self.sleep * 2, MAX_SLEEP_S)


class BroadcastWriter:
    """Creates the shared block; `enqueue(obj)` sends one message to every reader."""

    def __init__(self, num_readers: int, num_slots: int = 8, slot_bytes: int = 1 << 18,
                 check_readers: Callable[[], None] | None = None) -> None:
        if num_readers < 1 or num_slots < 1 or slot_bytes < 1:
            raise ValueError("a broadcast needs readers, slots and slot bytes")
        self._shm = SharedMemory(create=True, size=_Ring.size(num_readers, num_slots,
                                                              slot_bytes))  # mode 0600
        self.handle = BroadcastHandle(self._shm.name, num_readers, num_slots, slot_bytes,
                                      os.getpid())
        self._ring = _Ring(self._shm, self.handle)
        self._ring.buf[self._ring.tables:] = bytes(len(self._ring.buf) - self._ring.tables)
        self.check_readers = check_readers  # raises when a reader is gone
        self._next_chunk = 0
        self._unlinked = False

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Pickle `obj` and write it, chunk by chunk; BroadcastError when a reader
        dies (`check_readers`) or a slot stays taken for `timeout` s."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        size = self.handle.slot_bytes
        deadline = None if timeout is None else time.monotonic() + timeout
        view = memoryview(data)
        for start in range(0, max(len(data), 1), size):
            chunk = view[start:start + size]
            self._write_chunk(chunk, last=start + size >= len(data), deadline=deadline)

    def _write_chunk(self, chunk: memoryview, last: bool, deadline: float | None) -> None:
        ring, k = self._ring, self._next_chunk
        slot = k % self.handle.num_slots
        self._wait_free(slot, k, deadline)
        offset = slot * ring.slot_stride
        _HEADER.pack_into(ring.buf, offset, len(chunk), int(last))
        start = offset + _HEADER.size
        ring.buf[start:start + len(chunk)] = chunk
        ring.set_seq(0, slot, k + 1)
        self._next_chunk = k + 1

    def _wait_free(self, slot: int, k: int, deadline: float | None) -> None:
        """Until every reader finished the chunk slot `slot` holds (chunk k - num_slots)."""
        previous = k - self.handle.num_slots + 1  # its sequence value; <= 0: never used
        if previous <= 0:
            return
        backoff, checked = _Backoff(), time.monotonic()
        while any(self._ring.seq(r + 1, slot) != previous
                  for r in range(self.handle.num_readers)):
            backoff.wait()
            now = time.monotonic()
            if now - checked >= LIVENESS_EVERY_S:
                checked = now
                if self.check_readers is not None:
                    self.check_readers()
            if deadline is not None and now >= deadline:
                raise BroadcastError("broadcast: a reader did not take its message in time")

    def unlink(self) -> None:
        """Remove the block's name (mappings stay valid): once every reader attached,
        nothing is left behind even if this process dies hard. Idempotent."""
        if not self._unlinked:
            self._unlinked = True
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unlink and unmap; idempotent."""
        self.unlink()
        try:
            self._shm.close()
        except BufferError:  # a view still exported (during interpreter teardown)
            pass


class BroadcastReader:
    """Attaches to a writer's block as reader `index`; `dequeue()` returns the next
    message (every message once, in order)."""

    def __init__(self, handle: BroadcastHandle, index: int) -> None:
        self.handle, self.index = handle, index
        # Attaching registers the name with the resource tracker a spawned reader
        # shares with its writer (a set: no second entry); the writer unlinks it.
        self._shm = SharedMemory(name=handle.name)
        self._ring = _Ring(self._shm, handle)
        self._next_chunk = 0
        self._writer_fd = _pidfd(handle.writer_pid)

    def dequeue(self, timeout: float | None = None) -> Any:
        """The next message; BroadcastError when the writer is gone or, with a
        timeout, when none came in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        parts: list[bytes] = []
        while True:
            part, last = self._read_chunk(deadline)
            parts.append(part)
            if last:
                return pickle.loads(b"".join(parts))

    def _read_chunk(self, deadline: float | None) -> tuple[bytes, bool]:
        ring, k = self._ring, self._next_chunk
        slot = k % self.handle.num_slots
        backoff, checked = _Backoff(), time.monotonic()
        while ring.seq(0, slot) != k + 1:
            backoff.wait()
            now = time.monotonic()
            if now - checked >= LIVENESS_EVERY_S:
                checked = now
                if not self._writer_alive():
                    raise BroadcastError(f"broadcast: the writer (pid {self.handle.writer_pid})"
                                         f" is gone")
            if deadline is not None and now >= deadline:
                raise BroadcastError("broadcast: no message in time")
        _fence()
        offset = slot * ring.slot_stride
        nbytes, last = _HEADER.unpack_from(ring.buf, offset)
        start = offset + _HEADER.size
        part = bytes(ring.buf[start:start + nbytes])
        ring.set_seq(self.index + 1, slot, k + 1)
        self._next_chunk = k + 1
        return part, bool(last)

    def _writer_alive(self) -> bool:
        if self._writer_fd is None:  # no pidfds: the writer is our parent
            return os.getppid() == self.handle.writer_pid
        readable, _, _ = select.select([self._writer_fd], [], [], 0)
        return not readable  # a pidfd turns readable when its process exits

    def close(self) -> None:
        if self._writer_fd is not None:
            os.close(self._writer_fd)
            self._writer_fd = None
        try:
            self._shm.close()
        except BufferError:
            pass


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise BroadcastError(f"broadcast: the writer (pid {pid}) is gone") from None
    except (AttributeError, OSError):
        return None
