"""A structured-output spec compiled in a worker process that can be killed.

xgrammar's compile of some small specs can take seconds to minutes, depending on
its version and the CPU (a JSON object of 200 properties, each an anyOf of a
bounded string and an integer, took 34 s with an older xgrammar and 0.5 s with
0.2.9), and cannot be interrupted: a thread that runs it runs to the end, holding a core. So the API
server checks each spec in a worker process that compiles it for the model's
tokenizer exactly as the engine will (`grammar._grammar`, then
`GrammarCompiler.compile_grammar`), and kills the process when the answer does
not come within the deadline; the next check starts a fresh one.

`CompileWorker` is the parent's handle on one process (blocking calls: run it on
a thread). The wire: each frame is a 4-byte big-endian length and a msgpack
value; the worker sends `["ready"]` once it has loaded the tokenizer, then for
each `[kind, text]` (a `StructuredOutputs.key()`) the answer `[ok, message]`.
The worker starts at its parent's priority (loading xgrammar and the tokenizer
takes seconds of CPU, which a starved worker would stretch into minutes), then
compiles at nice `COMPILE_NICE`: beside busy engines a pathological compile takes
about a tenth of a core until it is killed, while an ordinary one (milliseconds)
still finishes promptly. It exits when its stdin closes or its parent dies.

Not here: the pool, the deadline's policy and the verdict cache
(`dpserve.server.openai.grammar_check`); the engine's own compiles (`manager.py`).
"""

from __future__ import annotations

import os
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import msgspec

_HEADER = struct.Struct(">I")
# A compile's CPU weight beside the engines (CFS: nice 10 ~ 1/10 of a nice-0 thread's).
COMPILE_NICE = 10


class CompileTimeout(Exception):
    """The worker did not answer within the deadline (it was killed)."""


class WorkerFailed(RuntimeError):
    """The worker could not start, or died for another reason than a deadline."""


class CompileWorker:
    """One worker process (started on first use; blocking: call from one thread)."""

    def __init__(self, tokenizer: str, vocab_size: int, start_timeout: float = 120.0) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.num_started = 0  # processes started over this handle's life

    def check(self, kind: str, text: str, timeout: float) -> str | None:
        """None when the spec compiles, else the problem (a ValueError's message);
        CompileTimeout past `timeout` s (the worker is killed), WorkerFailed if the
        worker cannot start."""
        proc = self.start()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(_frame([kind, text]))
            proc.stdin.flush()
        except OSError:
            self.kill()
            raise WorkerFailed("the grammar compile worker died") from None
        answer = _read_frame(proc.stdout.fileno(), time.monotonic() + timeout)
        if answer is _TIMEOUT:
            self.kill()
            raise CompileTimeout(f"no answer within {timeout} s")
        if answer is None:  # it died on this spec (a crash in the compiler)
            self.kill()
            return "the grammar compiler failed on it"
        ok, message = answer
        return None if ok else str(message)

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.kill()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not refused
            pass
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()

    def start(self) -> subprocess.Popen[bytes]:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        self.kill()
        proc = subprocess.Popen(
            [sys.executable, "-m", "dpserve.structured.compile_worker", self.tokenizer,
             str(self.vocab_size), str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.proc = proc
        self.num_started += 1
        assert proc.stdout is not None
        ready = _read_frame(proc.stdout.fileno(), time.monotonic() + self.start_timeout)
        if ready != ["ready"]:
            self.kill()
            raise WorkerFailed("the grammar compile worker did not start (exit code "
                               f"{proc.returncode}, or no answer in {self.start_timeout} s)")
        return proc


_TIMEOUT = object()


def _frame(value: Any) -> bytes:
    body = msgspec.msgpack.encode(value)
    return _HEADER.pack(len(body)) + body


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | object | None:
    """n bytes from fd; None at EOF, _TIMEOUT past the deadline (None: no deadline)."""
    out = bytearray()
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return _TIMEOUT
        chunk = os.read(fd, n - len(out))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


def _read_frame(fd: int, deadline: float | None) -> Any:
    header = _read_exact(fd, _HEADER.size, deadline)
    if not isinstance(header, bytes):
        return header
    body = _read_exact(fd, _HEADER.unpack(header)[0], deadline)
    return msgspec.msgpack.decode(body) if isinstance(body, bytes) else body


# ---- the worker process ----------------------------------------------------------------


def _watch_parent(parent_pid: int) -> None:
    """Exit once the parent is gone, even in the middle of a compile."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def main(argv: list[str]) -> int:
    tokenizer_path, vocab_size, parent_pid = argv[0], int(argv[1]), int(argv[2])
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from dpserve.structured.grammar import compile_spec, spec_from_key

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    out, inp = sys.stdout.buffer, sys.stdin.buffer.fileno()
    os.nice(COMPILE_NICE)  # loaded: compiles yield to the engines' steps (docstring)
    out.write(_frame(["ready"]))
    out.flush()
    while True:
        request = _read_frame(inp, None)
        if not isinstance(request, list):
            return 0  # stdin closed: the parent is done with us
        kind, text = request
        try:
            compile_spec(compiler, spec_from_key(kind, text))
            answer = [True, ""]
        except Exception as e:  # noqa: BLE001 - the spec's problem, sent to the parent
            answer = [False, str(e) or type(e).__name__]
        out.write(_frame(answer))
        out.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
