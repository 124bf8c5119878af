"""A streaming `multipart/form-data` reader for uploads (RFC 7578), bounded throughout.

Scope: `receive_upload` reads a request body chunk by chunk: the one file part
(`file_field`) goes straight to a file on disk (written off the event loop), never
whole in memory, and past `max_file_bytes` the read stops with `FileTooLarge`;
every other part is a small text field (at most `MAX_FIELD_BYTES`, and
`MAX_FIELDS` of them), its headers at most `MAX_HEADER_BYTES`. A body that is not
well-formed multipart (no boundary, a part without a name, no closing boundary, a
second file part) is a `MultipartError` naming what is wrong.

Not here: what the fields mean (`dpserve.server.batches.files_routes`); the cap on the whole
body (`dpserve.server.bodies.BodyLimit`).
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import BinaryIO

MAX_FIELD_BYTES = 4096
MAX_FIELDS = 16
MAX_HEADER_BYTES = 16384
FLUSH_BYTES = 1 << 20  # file bytes gathered before a write (on a worker thread)
_PARAM = re.compile(r';\s*([\w*-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;\s]*))')


class MultipartError(ValueError):
    """The body is not the multipart form expected (a 400)."""


class FileTooLarge(Exception):
    """The file part is over the limit (a 413)."""


@dataclass
class Upload:
    fields: dict[str, str] = field(default_factory=dict)  # the text parts by name
    filename: str | None = None  # the file part's name (None: there was no file part)
    size: int = 0  # bytes written to the file


def boundary_of(content_type: str) -> bytes:
    """The boundary of a `multipart/form-data` Content-Type; MultipartError otherwise."""
    kind, _, rest = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        raise MultipartError(f"the body must be multipart/form-data, got "
                             f"{kind.strip() or 'no Content-Type'!r}")
    params = {m.group(1).lower(): m.group(2) if m.group(2) is not None else m.group(3)
              for m in _PARAM.finditer(";" + rest)}
    boundary = params.get("boundary", "")
    if not 1 <= len(boundary) <= 70:
        raise MultipartError("the multipart Content-Type has no valid boundary")
    return boundary.encode("latin-1")


async def receive_upload(chunks: AsyncIterator[bytes], boundary: bytes, file_field: str,
                         path: str, max_file_bytes: int) -> Upload:
    """Read the form from `chunks`, its `file_field` part into a new file at `path`
    (mode 0600; the caller removes it on failure)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        parser = _Parser(boundary, file_field, max_file_bytes)
        async for chunk in chunks:
            parser.feed(chunk)
            if parser.pending_bytes >= FLUSH_BYTES:
                await asyncio.to_thread(_write, out, parser.take())
        parser.finish()
        await asyncio.to_thread(_write, out, parser.take())
    return parser.upload


def _write(out: BinaryIO, data: list[bytes]) -> None:
    out.writelines(data)
    out.flush()


class _Parser:
    """The body's state machine: preamble -> (delimiter -> headers -> data)* -> end.
    A leading CRLF is added so that every delimiter reads `CRLF--boundary`."""

    def __init__(self, boundary: bytes, file_field: str, max_file_bytes: int) -> None:
        self.delim = b"\r\n--" + boundary
        self.file_field = file_field
        self.max_file_bytes = max_file_bytes
        self.upload = Upload()
        self.buf = b"\r\n"
        self.state = "preamble"  # preamble | after | headers | data | end
        self.part: str | None = None  # the current part's name
        self.value = bytearray()  # the current text part
        self.pending: list[bytes] = []  # file bytes not yet written
        self.pending_bytes = 0

    def take(self) -> list[bytes]:
        data, self.pending, self.pending_bytes = self.pending, [], 0
        return data

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk
        while self._step():
            pass

    def finish(self) -> None:
        if self.state != "end":
            raise MultipartError("the multipart body ended before its closing boundary")

    def _step(self) -> bool:
        """Advance on what is buffered; False when more bytes are needed."""
        if self.state in ("preamble", "data"):
            at = self.buf.find(self.delim)
            if at < 0:
                keep = len(self.delim) - 1  # a delimiter may straddle two chunks
                if self.state == "data" and len(self.buf) > keep:
                    self._emit(self.buf[:-keep])
                    self.buf = self.buf[-keep:]
                elif self.state == "preamble":
                    self.buf = self.buf[-keep:]
                return False
            if self.state == "data":
                self._emit(self.buf[:at])
                self._end_part()
            self.buf = self.buf[at + len(self.delim):]
            self.state = "after"
            return True
        if self.state == "after":
            return self._after_delimiter()
        if self.state == "headers":
            return self._headers()
        self.buf = b""  # the epilogue is ignored
        return False

    def _after_delimiter(self) -> bool:
        if len(self.buf) < 2:
            return False
        if self.buf.startswith(b"--"):
            self.state, self.buf = "end", b""
            return False
        eol = self.buf.find(b"\r\n")
        if eol < 0 or self.buf[:eol].strip(b" \t"):
            if eol < 0 and len(self.buf) < 256:
                return False
            raise MultipartError("malformed multipart boundary line")
        self.buf = self.buf[eol + 2:]
        self.state = "headers"
        return True

    def _headers(self) -> bool:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > MAX_HEADER_BYTES:
                raise MultipartError(f"a multipart part's headers are over "
                                     f"{MAX_HEADER_BYTES} bytes")
            return False
        head, self.buf = self.buf[:end].decode("utf-8", "replace"), self.buf[end + 4:]
        self._start_part(head)
        self.state = "data"
        return True

    def _start_part(self, head: str) -> None:
        disposition = next((line.split(":", 1)[1] for line in head.split("\r\n")
                            if line.lower().startswith("content-disposition:")), "")
        params = {m.group(1).lower(): m.group(2) if m.group(2) is not None else m.group(3)
                  for m in _PARAM.finditer(disposition)}
        name = params.get("name")
        if not name:
            raise MultipartError("a multipart part has no Content-Disposition name")
        if name == self.file_field:
            if self.upload.filename is not None:
                raise MultipartError(f"more than one {self.file_field!r} part")
            self.upload.filename = os.path.basename(params.get("filename") or "upload.jsonl")
        elif len(self.upload.fields) >= MAX_FIELDS:
            raise MultipartError(f"more than {MAX_FIELDS} form fields")
        self.part = name

    def _emit(self, data: bytes) -> None:
        if not data:
            return
        if self.part == self.file_field:
            self.upload.size += len(data)
            if self.upload.size > self.max_file_bytes:
                raise FileTooLarge(self.max_file_bytes)
            self.pending.append(data)
            self.pending_bytes += len(data)
            return
        self.value += data
        if len(self.value) > MAX_FIELD_BYTES:
            raise MultipartError(f"form field {self.part!r} is over {MAX_FIELD_BYTES} bytes")

    def _end_part(self) -> None:
        if self.part != self.file_field and self.part is not None:
            self.upload.fields[self.part] = self.value.decode("utf-8", "replace")
        self.part, self.value = None, bytearray()
