"""`FileStore`: the files of /v1/files, kept in the server's state directory.

A file's metadata is a row of `StateDB`'s `files` table; its contents are
`files/<id>` (mode 0600, in a 0700 folder). An upload is written to
`files/<id>.part` as it arrives and renamed to `files/<id>` only once whole, with
its row inserted after the rename: a file listed is complete, and a `.part` left
by a server killed mid-upload is removed when the next one starts (`init_files_dir`). Delete removes
the row first, then the contents. A batch's output and error files are stored the
same way by `dpserve.server.batches.store` (purpose "batch_output").

Not here: the multipart upload (`dpserve.server.batches.multipart`), the routes
(`dpserve.server.batches.files_routes`).
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from typing import Any

from dpserve.server.batches.state_db import StateDB

FILES_DIR = "files"
_COLUMNS = "id, purpose, filename, bytes, created_at"


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def files_dir(state_dir: str) -> str:
    return os.path.join(state_dir, FILES_DIR)


def init_files_dir(state_dir: str, sweep: bool = True) -> None:
    """The contents' folder made (0700); `sweep`: emptied of unfinished uploads (by the
    launcher, before any API server runs: an API server restarted later must not
    remove another's upload under way)."""
    folder = files_dir(state_dir)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    for name in os.listdir(folder) if sweep else ():
        if name.endswith(".part"):
            os.unlink(os.path.join(folder, name))


def file_object(row: tuple[Any, ...]) -> dict[str, Any]:
    """A `files` row -> OpenAI's file object."""
    file_id, purpose, filename, size, created_at = row
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at,
            "filename": filename, "purpose": purpose, "status": "processed",
            "expires_at": None, "status_details": None}


def insert_file(db: sqlite3.Connection, file_id: str, purpose: str, filename: str,
                size: int) -> dict[str, Any]:
    """Insert a file's row (inside the caller's transaction, if any): its object."""
    row = (file_id, purpose, filename, size, int(time.time()))
    db.execute(f"INSERT INTO files ({_COLUMNS}) VALUES (?, ?, ?, ?, ?)", row)
    return file_object(row)


class FileStore:
    """Stored files (module docstring); every method but the paths is a coroutine run
    on `StateDB`'s thread."""

    def __init__(self, db: StateDB) -> None:
        self.db = db
        self.folder = files_dir(db.state_dir)

    def path(self, file_id: str) -> str:
        return os.path.join(self.folder, file_id)

    def part_path(self, file_id: str) -> str:
        return self.path(file_id) + ".part"

    async def add(self, file_id: str, purpose: str, filename: str, size: int
                  ) -> dict[str, Any]:
        """The upload at `part_path(file_id)` made a stored file: its object."""
        def write(db: sqlite3.Connection) -> dict[str, Any]:
            os.replace(self.part_path(file_id), self.path(file_id))
            try:
                return insert_file(db, file_id, purpose, filename, size)
            except BaseException:
                os.unlink(self.path(file_id))
                raise

        return await self.db.run(write)

    async def get(self, file_id: str) -> dict[str, Any] | None:
        def read(db: sqlite3.Connection) -> dict[str, Any] | None:
            row = db.execute(f"SELECT {_COLUMNS} FROM files WHERE id = ?",
                             (file_id,)).fetchone()
            return None if row is None else file_object(row)

        return await self.db.run(read)

    async def list(self, purpose: str | None, limit: int, after: str | None,
                   ascending: bool) -> tuple[list[dict[str, Any]], bool] | None:
        """A page of files, newest first unless `ascending`: (objects, has_more);
        None when `after` names no file."""
        def read(db: sqlite3.Connection) -> tuple[list[dict[str, Any]], bool] | None:
            where, args = ["1"], []
            if purpose is not None:
                where.append("purpose = ?")
                args.append(purpose)
            if after is not None:
                row = db.execute("SELECT seq FROM files WHERE id = ?", (after,)).fetchone()
                if row is None:
                    return None
                where.append("seq > ?" if ascending else "seq < ?")
                args.append(row[0])
            rows = db.execute(f"SELECT {_COLUMNS} FROM files WHERE {' AND '.join(where)} "
                              f"ORDER BY seq {'ASC' if ascending else 'DESC'} LIMIT ?",
                              (*args, limit + 1)).fetchall()
            return [file_object(r) for r in rows[:limit]], len(rows) > limit

        return await self.db.run(read)

    async def delete(self, file_id: str) -> bool:
        def write(db: sqlite3.Connection) -> bool:
            if db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount != 1:
                return False
            try:
                os.unlink(self.path(file_id))
            except FileNotFoundError:
                pass
            return True

        return await self.db.run(write)
