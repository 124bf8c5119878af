"""The state of /v1/files and /v1/batches on its own (no model): the multipart reader
fed in every split, the batch store as two API servers see it (one lease, a line
recorded once, the files of a finish), the line checks, and the options' errors."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import stat

import pytest

from dpserve.errors import ConfigError
from dpserve.server.batches.file_store import FileStore
from dpserve.server.batches.format import check_file
from dpserve.server.batches.multipart import (
    FileTooLarge,
    MultipartError,
    boundary_of,
    receive_upload,
)
from dpserve.server.batches.options import BatchOptions, add_batch_args
from dpserve.server.batches.state_db import StateDB
from dpserve.server.batches.store import BatchStore, init_batch_state
from dpserve.server.state_dir import state_directory

BOUNDARY = "b0undary-x"


def _form(content: bytes, purpose: str = "batch", name: str = "in.jsonl") -> bytes:
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
            f"{purpose}\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"{name}\"\r\nContent-Type: application/jsonl\r\n\r\n").encode() \
        + content + f"\r\n--{BOUNDARY}--\r\n".encode()


async def _chunks(body: bytes, size: int):
    for i in range(0, len(body), size):
        yield body[i:i + size]


def test_multipart_in_every_split(tmp_path) -> None:
    """Whatever the chunking, the file part arrives byte for byte (a boundary-like
    text inside it included) and the field is read."""
    content = b'{"a": 1}\r\n--b0undary\r\n' * 20 + b"\r\n-" + b"x" * 100
    body = _form(content)
    boundary = boundary_of(f"multipart/form-data; boundary={BOUNDARY}")
    for size in (1, 2, 3, 7, 64, len(body)):
        path = tmp_path / f"out{size}"
        upload = asyncio.run(receive_upload(_chunks(body, size), boundary, "file",
                                            str(path), 1 << 20))
        assert path.read_bytes() == content, size
        assert upload.fields == {"purpose": "batch"} and upload.filename == "in.jsonl"
        assert upload.size == len(content)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_multipart_bounds_and_malformed_bodies(tmp_path) -> None:
    boundary = BOUNDARY.encode()
    with pytest.raises(FileTooLarge):
        asyncio.run(receive_upload(_chunks(_form(b"x" * 101), 10), boundary, "file",
                                   str(tmp_path / "big"), 100))
    truncated = _form(b"abc")[:-12]
    with pytest.raises(MultipartError, match="closing boundary"):
        asyncio.run(receive_upload(_chunks(truncated, 5), boundary, "file",
                                   str(tmp_path / "cut"), 100))
    with pytest.raises(MultipartError, match="multipart/form-data"):
        boundary_of("application/json")


def test_line_checks_name_the_line(tmp_path) -> None:
    path = tmp_path / "in.jsonl"
    good = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}
    path.write_text("\n".join([
        json.dumps(good), "{not json", "",
        json.dumps({**good, "custom_id": "b", "url": "/v1/images/generations"}),
        json.dumps({**good, "custom_id": "c", "url": "/v1/chat/completions"}),
        json.dumps(good)]) + "\n")
    total, errors = check_file(str(path), "/v1/completions")
    assert total == 5
    assert [(e["line"], e["code"], e["param"]) for e in errors] == [
        (2, "invalid_json_line", None), (4, "invalid_url", "url"),
        (5, "mismatched_url", "url"), (6, "duplicate_custom_id", "custom_id")]


def test_one_lease_lines_recorded_once_and_the_finish(tmp_path) -> None:
    """Two stores on one directory (two API servers): only one claims a batch; a line
    is recorded once; the other takes the batch when it is given back; the finish
    writes the output and error files in line order."""
    state = str(tmp_path)
    init_batch_state(state)

    async def run() -> None:
        dbs = [StateDB(state) for _ in range(2)]
        a, b = (BatchStore(db, FileStore(db)) for db in dbs)
        with open(a.files.part_path("file-in"), "w") as f:
            f.write("x\n")
        await a.files.add("file-in", "batch", "in.jsonl", 2)
        batch = {"id": "batch_1", "status": "validating", "input_file_id": "file-in"}
        assert await a.create(batch, None)
        claimed = await a.claim("A")
        assert claimed is not None and await b.claim("B") is None
        assert await a.set_status("batch_1", "A", "in_progress", total=3)
        assert await a.record("batch_1", "A", 2, True, {"line": 2})
        assert not await a.record("batch_1", "A", 2, True, {"line": "again"})
        assert not await b.record("batch_1", "B", 1, True, {"line": 1})  # not its lease
        await a.release("batch_1", "A")
        assert (await b.claim("B")) is not None
        assert await b.answered_lines("batch_1") == {2}
        assert await b.record("batch_1", "B", 3, False, {"line": 3})
        assert await b.record("batch_1", "B", 1, True, {"line": 1})
        assert (await b.get("batch_1"))["request_counts"] == {
            "total": 3, "completed": 2, "failed": 1}
        assert await b.finish("batch_1", "B", "completed")
        done = await a.get("batch_1")
        assert done["status"] == "completed"
        with open(a.files.path(done["output_file_id"])) as f:
            assert [json.loads(x) for x in f] == [{"line": 1}, {"line": 2}]
        with open(a.files.path(done["error_file_id"])) as f:
            assert [json.loads(x) for x in f] == [{"line": 3}]
        assert not os.path.exists(a.input_path("batch_1"))
        assert await a.claim("A") is None  # finished: nobody runs it
        for db in dbs:
            db.close()

    asyncio.run(run())


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_batch_args(parser)
    return parser.parse_args(list(argv))


def test_state_dir_options(tmp_path) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    for argv, message in [(["--state-dir", str(a_file)], "--state-dir must name a directory"),
                          (["--state-dir", str(tmp_path / "no" / "x")],
                           "--state-dir: no such directory"),
                          (["--state-dir", str(shared)], "writable by other users"),
                          (["--max-batch-file-bytes", "0"], "--max-batch-file-bytes"),
                          (["--max-batch-concurrency", "0"], "--max-batch-concurrency")]:
        with pytest.raises(ConfigError, match=message):
            BatchOptions.from_args(_args(*argv))
    new = tmp_path / "new"
    with state_directory(str(new)) as made:
        assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
    assert new.is_dir()  # kept
    with state_directory(None) as private:
        assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
    assert not os.path.exists(private)
