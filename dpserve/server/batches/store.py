"""`BatchStore`: the batches of /v1/batches and every answered line, in `StateDB`.

A batch row holds its object (JSON; `request_counts` is computed on each read from
its answered lines, so it is never ahead of them), its status, a cancel mark, and
the lease of the API server running it. Its input is a hard link to the input
file (`batches/<id>.jsonl`), taken at create, so deleting the file does not
disturb the batch; it is removed when the batch ends.

Rules, enforced here:

* Exactly one API server runs a batch: `claim` takes an unfinished batch nobody
  holds (or whose lease ran out) for `lease_s` seconds; the runner renews it
  (`renew`, which also reads the cancel mark) and gives it back when it stops
  (`release`, on a drain). Every write of a runner is conditional on its lease.
* A line is answered exactly once: `record` inserts its result only if no result
  for that line exists and the writer still holds the lease, in one committed
  statement; a runner (this one or the next, after a restart) skips the lines
  recorded (`answered_lines`).
* The end is written at once: `finish` writes the output and error files
  (`dpserve.server.batches.file_store`'s layout; their ids derive from the batch's, so a
  finish redone after a crash overwrites, never duplicates) and then, in one
  transaction, their rows and the final status.

Not here: running the lines (`dpserve.server.batches.runner`), the routes.
"""

from __future__ import annotations

import itertools
import json
import os
import sqlite3
import time
from dataclasses import dataclass
from typing import Any

from dpserve.server.batches.file_store import FileStore, init_files_dir, insert_file
from dpserve.server.batches.state_db import StateDB, init_state_db

BATCHES_DIR = "batches"
LEASE_S = 15.0
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")


@dataclass(frozen=True)
class Claimed:
    """A batch this API server now runs."""

    batch: dict[str, Any]  # its object
    api_key_id: str | None  # its creator's key (salts the prefix cache as theirs)
    cancel_requested: bool


def batches_dir(state_dir: str) -> str:
    return os.path.join(state_dir, BATCHES_DIR)


def init_batch_state(state_dir: str, sweep: bool = True) -> None:
    """The SQLite file and the folders of files and batches made in the state directory
    (`sweep`: `init_files_dir`'s; ConfigError when the file is unusable)."""
    init_state_db(state_dir)
    init_files_dir(state_dir, sweep)
    os.makedirs(batches_dir(state_dir), mode=0o700, exist_ok=True)


class BatchStore:
    """The batches (module docstring); every method is a coroutine run on `StateDB`'s
    thread."""

    def __init__(self, db: StateDB, files: FileStore, lease_s: float = LEASE_S) -> None:
        self.db = db
        self.files = files
        self.lease_s = lease_s
        self.folder = batches_dir(db.state_dir)

    def input_path(self, batch_id: str) -> str:
        return os.path.join(self.folder, f"{batch_id}.jsonl")

    # ---- the API's side --------------------------------------------------------------

    async def create(self, batch: dict[str, Any], api_key_id: str | None) -> bool:
        """Store a new batch over its input file (linked now); False when that file is
        gone meanwhile."""
        def write(db: sqlite3.Connection) -> bool:
            try:
                os.link(self.files.path(batch["input_file_id"]), self.input_path(batch["id"]))
            except FileNotFoundError:
                return False
            db.execute("INSERT INTO batches (id, status, batch, api_key_id) VALUES "
                       "(?, ?, ?, ?)", (batch["id"], batch["status"], json.dumps(batch),
                                        api_key_id))
            return True

        return await self.db.run(write)

    async def get(self, batch_id: str) -> dict[str, Any] | None:
        return await self.db.run(lambda db: _get(db, batch_id))

    async def list(self, limit: int, after: str | None
                   ) -> tuple[list[dict[str, Any]], bool] | None:
        """A page of batches, newest first: (objects, has_more); None when `after`
        names no batch."""
        def read(db: sqlite3.Connection) -> tuple[list[dict[str, Any]], bool] | None:
            before = 1 << 62
            if after is not None:
                row = db.execute("SELECT seq FROM batches WHERE id = ?", (after,)).fetchone()
                if row is None:
                    return None
                before = row[0]
            ids = [r[0] for r in db.execute("SELECT id FROM batches WHERE seq < ? ORDER BY "
                                            "seq DESC LIMIT ?", (before, limit + 1))]
            found = [_get(db, i) for i in ids[:limit]]
            return [b for b in found if b is not None], len(ids) > limit

        return await self.db.run(read)

    async def request_cancel(self, batch_id: str) -> dict[str, Any] | None:
        """Mark an unfinished batch cancelling (its runner sees the mark and stops);
        the batch as it is after (None: unknown id). A finished one is left as it is."""
        def write(db: sqlite3.Connection) -> dict[str, Any] | None:
            with db:
                db.execute("BEGIN IMMEDIATE")
                batch = _get(db, batch_id)
                if batch is None or batch["status"] not in UNFINISHED[:3]:
                    return batch
                _update(db, batch_id, batch, "cancelling", cancelling_at=int(time.time()))
                db.execute("UPDATE batches SET cancel_requested = 1 WHERE id = ?", (batch_id,))
                return _get(db, batch_id)

        return await self.db.run(write)

    # ---- the runner's side -----------------------------------------------------------

    async def claim(self, runner: str) -> Claimed | None:
        """Take the oldest unfinished batch nobody holds (module docstring)."""
        def candidate(db: sqlite3.Connection, now: float) -> Any:
            return db.execute(
                f"SELECT id, api_key_id, cancel_requested FROM batches WHERE status IN "
                f"({','.join('?' * len(UNFINISHED))}) AND (owner IS NULL OR owner = ? OR "
                f"lease_until < ?) ORDER BY seq LIMIT 1", (*UNFINISHED, runner, now)
            ).fetchone()

        def write(db: sqlite3.Connection) -> Claimed | None:
            if candidate(db, time.time()) is None:  # a read first: idle polls write nothing
                return None
            now = time.time()
            with db:
                db.execute("BEGIN IMMEDIATE")
                row = candidate(db, now)
                if row is None:
                    return None
                db.execute("UPDATE batches SET owner = ?, lease_until = ? WHERE id = ?",
                           (runner, now + self.lease_s, row[0]))
                batch = _get(db, row[0])
                assert batch is not None
                return Claimed(batch, row[1], bool(row[2]))

        return await self.db.run(write)

    async def renew(self, batch_id: str, runner: str) -> tuple[bool, bool]:
        """(still held by `runner`, cancel requested), the lease extended."""
        def write(db: sqlite3.Connection) -> tuple[bool, bool]:
            held = db.execute("UPDATE batches SET lease_until = ? WHERE id = ? AND owner = ?",
                              (time.time() + self.lease_s, batch_id, runner)).rowcount == 1
            row = db.execute("SELECT cancel_requested FROM batches WHERE id = ?",
                             (batch_id,)).fetchone()
            return held, bool(row and row[0])

        return await self.db.run(write)

    async def release(self, batch_id: str, runner: str) -> None:
        await self.db.run(lambda db: db.execute(
            "UPDATE batches SET owner = NULL, lease_until = 0 WHERE id = ? AND owner = ?",
            (batch_id, runner)))

    async def set_status(self, batch_id: str, runner: str, status: str,
                         **fields: Any) -> bool:
        """Move a batch `runner` holds to `status` (with `fields` of its object, and
        `total`: its line count; a batch marked for cancel stays "cancelling" unless
        `status` is final); False when the lease is lost."""
        def write(db: sqlite3.Connection) -> bool:
            with db:
                db.execute("BEGIN IMMEDIATE")
                if not _held(db, batch_id, runner):
                    return False
                batch = _get(db, batch_id)
                assert batch is not None
                kept = batch["status"] == "cancelling" and status in UNFINISHED
                total = fields.pop("total", None)
                if total is not None:
                    db.execute("UPDATE batches SET total = ? WHERE id = ?", (total, batch_id))
                _update(db, batch_id, batch, "cancelling" if kept else status, **fields)
                return True

        return await self.db.run(write)

    async def answered_lines(self, batch_id: str) -> set[int]:
        return await self.db.run(lambda db: {r[0] for r in db.execute(
            "SELECT line FROM batch_lines WHERE batch_id = ?", (batch_id,))})

    async def record(self, batch_id: str, runner: str, line: int, ok: bool,
                     result: dict[str, Any]) -> bool:
        """Commit a line's result unless it has one or `runner` lost the lease: whether
        this call recorded it."""
        text = json.dumps(result)

        def write(db: sqlite3.Connection) -> bool:
            return db.execute(
                "INSERT OR IGNORE INTO batch_lines (batch_id, line, ok, result, runner) "
                "SELECT ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM batches WHERE id = ? AND "
                "owner = ?)", (batch_id, line, int(ok), text, runner, batch_id, runner)
            ).rowcount == 1

        return await self.db.run(write)

    async def finish(self, batch_id: str, runner: str, status: str,
                     **fields: Any) -> bool:
        """Write the output and error files of the lines answered, then end the batch
        in `status` (completed / cancelled) with them; False when the lease is lost."""
        def write(db: sqlite3.Connection) -> bool:
            suffix = batch_id.removeprefix("batch_")
            # kind -> (file id, size; None: no such line, no file)
            outputs = {kind: (f"file-{kind}-{suffix}", self._write_results(
                db, batch_id, kind == "output", f"file-{kind}-{suffix}"))
                for kind in ("output", "error")}
            with db:
                db.execute("BEGIN IMMEDIATE")
                if not _held(db, batch_id, runner):
                    return False
                for kind, (file_id, size) in outputs.items():
                    if size is not None:
                        os.replace(self.files.part_path(file_id), self.files.path(file_id))
                        db.execute("DELETE FROM files WHERE id = ?", (file_id,))
                        insert_file(db, file_id, "batch_output", f"{batch_id}_{kind}.jsonl",
                                    size)
                batch = _get(db, batch_id)
                assert batch is not None
                _update(db, batch_id, batch, status, **fields, **{
                    f"{kind}_file_id": file_id if size is not None else None
                    for kind, (file_id, size) in outputs.items()})
                db.execute("UPDATE batches SET owner = NULL WHERE id = ?", (batch_id,))
            self.remove_input(batch_id)
            return True

        return await self.db.run(write)

    def _write_results(self, db: sqlite3.Connection, batch_id: str, ok: bool,
                       file_id: str) -> int | None:
        """The `ok` lines' results, in line order, into `file_id`'s part file: its size
        (None: no such line, no file)."""
        rows = db.execute("SELECT result FROM batch_lines WHERE batch_id = ? AND ok = ? "
                          "ORDER BY line", (batch_id, int(ok)))
        first = rows.fetchone()
        if first is None:
            return None
        path = self.files.part_path(file_id)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for (text,) in itertools.chain([first], rows):
                out.write(text + "\n")
        return os.path.getsize(path)

    async def fail(self, batch_id: str, runner: str, errors: list[dict[str, Any]]) -> bool:
        """End a batch that failed validation with OpenAI's `errors` list."""
        done = await self.set_status(batch_id, runner, "failed", failed_at=int(time.time()),
                                     errors={"object": "list", "data": errors})
        if done:
            await self.release(batch_id, runner)
            self.remove_input(batch_id)
        return done

    def remove_input(self, batch_id: str) -> None:
        try:
            os.unlink(self.input_path(batch_id))
        except FileNotFoundError:
            pass


def _held(db: sqlite3.Connection, batch_id: str, runner: str) -> bool:
    return db.execute("SELECT 1 FROM batches WHERE id = ? AND owner = ?",
                      (batch_id, runner)).fetchone() is not None


def _get(db: sqlite3.Connection, batch_id: str) -> dict[str, Any] | None:
    row = db.execute("SELECT batch, total FROM batches WHERE id = ?", (batch_id,)).fetchone()
    if row is None:
        return None
    answered, completed = db.execute("SELECT COUNT(*), COALESCE(SUM(ok), 0) FROM batch_lines "
                                     "WHERE batch_id = ?", (batch_id,)).fetchone()
    batch = json.loads(row[0])
    batch["request_counts"] = {"total": row[1], "completed": completed,
                               "failed": answered - completed}
    return batch


def _update(db: sqlite3.Connection, batch_id: str, batch: dict[str, Any], status: str,
            **fields: Any) -> None:
    batch = {**batch, **fields, "status": status}
    batch.pop("request_counts", None)
    db.execute("UPDATE batches SET status = ?, batch = ? WHERE id = ?",
               (status, json.dumps(batch), batch_id))
