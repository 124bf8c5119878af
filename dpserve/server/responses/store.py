"""The Responses API's store: one SQLite file that every API server process shares.

Scope: `ResponseStore`, the stored responses of `/v1/responses` (`store: true`, the
default). One row per response: its id, the id of the response it follows
(`previous_response_id`), its status, the response object and its own input items
(JSON), and a cancel flag. Every API server of one `dpserve serve` opens the same
file (the launcher names it: `dpserve.server.responses.store.store_path`), so any of
them resolves any id, and the rows outlive an API server's restart.

Rules, enforced here:

* The file is SQLite in WAL mode (readers never block the one writer; writers wait
  up to `sqlite.BUSY_TIMEOUT_S` for each other) and created with mode 0600 inside a 0700
  directory. All access runs on one worker thread per process (sqlite3 calls block),
  never on the event loop (`dpserve.server.sqlite.SQLiteThread`).
* Bounded: at most `max_responses` rows; a write past it evicts the oldest
  (by insertion order). One response (its object plus its input items, as JSON)
  may take at most `max_bytes`; a larger one is refused (`TooLarge`).
* A conversation (`conversation(id)`) is the chain of responses back through
  `previous_response_id`, oldest first, read in one recursive query; a chain with a
  missing link (deleted or evicted) is reported as missing (None).
* The rank a response ran on (`finish(response, rank)`) is kept with it: a
  follow-up on any API server goes there while it may take it (sticky sessions,
  `dpserve.server.sessions`). A file made before this column existed gets it
  (NULL) when opened.
* Cancel: `request_cancel` marks a queued / in-progress row cancelled; whoever runs
  it (any API server) sees `cancel_requested` and stops, and its final write
  (`finish`) does not overwrite the cancelled row.

Where the file is (`ResponseStoreOptions`, `store_in`): `--response-store PATH`
names it (kept after the server exits: responses outlive a restart of the whole
server); without it, `responses.sqlite` in the server's state directory
(`--state-dir`, kept; else a private one the launcher makes and removes at exit:
`dpserve.server.state_dir`). The API servers get the path in their options.
Without a path at all (an app built in-process, as tests do) the store is an
in-memory database of that one process.

Not here: the HTTP routes and the translation to chat (`dpserve.server.responses.routes`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from dpserve.errors import ConfigError
from dpserve.server.sqlite import MEMORY, SQLiteThread, open_sqlite

STORE_FILE = "responses.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    previous_id TEXT,
    status TEXT NOT NULL,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    response TEXT NOT NULL,      -- the response object (JSON)
    input_items TEXT NOT NULL,   -- its own input items (JSON list), without the chain's
    dp_rank INTEGER              -- the DP rank it ran on (sticky sessions); NULL: unknown
)
"""


class TooLarge(ValueError):
    """A response (object + input items) over the store's per-response limit."""


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as the API returns it
    input_items: list[dict[str, Any]]  # the items this request gave (not the chain's)
    previous_id: str | None
    cancel_requested: bool
    rank: int | None = None  # the DP rank it ran on, as its API server last knew it


@dataclass(frozen=True)
class ResponseStoreOptions:
    """Where the store is and its bounds (the `dpserve serve` flags)."""

    path: str | None = None  # --response-store; None: the launcher's state dir (or memory)
    max_stored_responses: int = 10000
    max_stored_response_bytes: int = 4 << 20

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ResponseStoreOptions:
        options = cls(path=getattr(args, "response_store", None),
                      max_stored_responses=getattr(args, "max_stored_responses", 10000),
                      max_stored_response_bytes=getattr(args, "max_stored_response_bytes",
                                                        4 << 20))
        for name in ("max_stored_responses", "max_stored_response_bytes"):
            if getattr(options, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got "
                                  f"{getattr(options, name)}")
        if options.path is not None:
            parent = os.path.dirname(os.path.abspath(options.path))
            if not os.path.isdir(parent):
                raise ConfigError(f"--response-store: no such directory: {parent}")
            if os.path.isdir(options.path):
                raise ConfigError(f"--response-store must name a file, not the directory "
                                  f"{options.path}")
        return options

    def open(self) -> ResponseStore:
        """The store, its file opened now (a broken one fails the API server's start)."""
        store = ResponseStore(self.path or MEMORY, self.max_stored_responses,
                              self.max_stored_response_bytes)
        store.connect()
        return store


def add_response_store_args(group: argparse.ArgumentParser) -> None:
    d = ResponseStoreOptions()
    group.add_argument("--response-store", default=None, metavar="PATH",
                       help="SQLite file of the Responses API's stored responses, shared by "
                            "every API server and kept after exit (default: responses.sqlite "
                            "in --state-dir).")
    group.add_argument("--max-stored-responses", type=int, default=d.max_stored_responses,
                       help="Stored responses kept; past it the oldest are evicted.")
    group.add_argument("--max-stored-response-bytes", type=int,
                       default=d.max_stored_response_bytes,
                       help="Largest stored response (its object and input items, as JSON "
                            "bytes); a larger one is refused (413).")


@contextmanager
def response_store_file(options: ResponseStoreOptions) -> Iterator[ResponseStoreOptions]:
    """The options with the store's file made (module docstring): the user's
    --response-store, or one in a private state directory removed on exit."""
    made = None
    if options.path is None:
        made = tempfile.mkdtemp(prefix="dpserve-state-")  # mode 0700
    try:
        yield store_in(options, made or "")
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def store_in(options: ResponseStoreOptions, state_dir: str) -> ResponseStoreOptions:
    """The options with the store's file made: the user's --response-store, else
    `STORE_FILE` in the server's state directory (`dpserve.server.state_dir`)."""
    if options.path is None:
        options = dataclasses.replace(options, path=os.path.join(state_dir, STORE_FILE))
    assert options.path is not None
    init_store_file(options.path)
    return options


def init_store_file(path: str) -> None:
    """Create the file (0600), switch it to WAL and make the table, before any API
    server opens it; ConfigError when it is not a usable SQLite file."""
    try:
        open_sqlite(path, _make_table).close()
    except (OSError, sqlite3.Error) as e:
        raise ConfigError(f"--response-store {path}: {e}") from None


class ResponseStore:
    """The shared store (module docstring); every method is a coroutine run on the
    store's own thread."""

    def __init__(self, path: str, max_responses: int, max_bytes: int) -> None:
        self.path = path
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._db = SQLiteThread(path, _make_table, "response-store")
        self._run = self._db.run
        self.close = self._db.close
        self.connect = self._db.connect  # open the file now (blocks; for start-up)

    # ---- writes ------------------------------------------------------------------

    def check_size(self, response: dict[str, Any], input_items: list[dict[str, Any]]
                   ) -> tuple[str, str]:
        """The two JSON texts of a row; `TooLarge` past `max_bytes`."""
        body, items = json.dumps(response), json.dumps(input_items)
        size = len(body.encode()) + len(items.encode())
        if size > self.max_bytes:
            raise TooLarge(f"the response and its input take {size} bytes, over "
                           f"--max-stored-response-bytes ({self.max_bytes})")
        return body, items

    async def put(self, response: dict[str, Any], input_items: list[dict[str, Any]],
                  previous_id: str | None) -> None:
        """Insert (or replace) a response; evict the oldest past `max_responses`."""
        body, items = self.check_size(response, input_items)

        def write(db: sqlite3.Connection) -> None:
            with db:
                db.execute("BEGIN IMMEDIATE")
                db.execute("INSERT OR REPLACE INTO responses (id, previous_id, status, "
                           "response, input_items) VALUES (?, ?, ?, ?, ?)",
                           (response["id"], previous_id, response["status"], body, items))
                db.execute("DELETE FROM responses WHERE seq <= (SELECT MAX(seq) FROM "
                           "responses) - ?", (self.max_responses,))

        await self._run(write)

    async def finish(self, response: dict[str, Any], rank: int | None = None) -> bool:
        """The final object of a response put earlier, and the DP rank it ran on (None:
        not known); False (nothing written) when it was cancelled, deleted or evicted
        meanwhile."""
        body, _ = self.check_size(response, [])

        def write(db: sqlite3.Connection) -> bool:
            cur = db.execute("UPDATE responses SET status = ?, response = ?, dp_rank = ? "
                             "WHERE id = ? AND cancel_requested = 0",
                             (response["status"], body, rank, response["id"]))
            return cur.rowcount == 1

        return await self._run(write)

    async def request_cancel(self, response_id: str) -> StoredResponse | None:
        """Mark a queued / in-progress response cancelled (its status and object say so);
        the row as it is after (None: unknown id). A finished one is left as it is."""
        def write(db: sqlite3.Connection) -> StoredResponse | None:
            with db:
                db.execute("BEGIN IMMEDIATE")
                row = _get(db, response_id)
                if row is None or row.response["status"] not in ("queued", "in_progress"):
                    return row
                response = {**row.response, "status": "cancelled"}
                db.execute("UPDATE responses SET status = 'cancelled', cancel_requested = 1, "
                           "response = ? WHERE id = ?", (json.dumps(response), response_id))
                return StoredResponse(response, row.input_items, row.previous_id, True,
                                      row.rank)

        return await self._run(write)

    async def delete(self, response_id: str) -> bool:
        def write(db: sqlite3.Connection) -> bool:
            return db.execute("DELETE FROM responses WHERE id = ?",
                              (response_id,)).rowcount == 1

        return await self._run(write)

    # ---- reads -------------------------------------------------------------------

    async def get(self, response_id: str) -> StoredResponse | None:
        return await self._run(lambda db: _get(db, response_id))

    async def cancelled(self, ids: list[str]) -> set[str]:
        """Which of `ids` have a cancel request."""
        def read(db: sqlite3.Connection) -> set[str]:
            marks = ",".join("?" * len(ids))
            return {r[0] for r in db.execute(
                f"SELECT id FROM responses WHERE cancel_requested = 1 AND id IN ({marks})",
                ids)}

        return await self._run(read) if ids else set()

    async def conversation(self, response_id: str) -> list[StoredResponse] | None:
        """The chain ending at `response_id`, oldest first; None when a link is missing."""
        def read(db: sqlite3.Connection) -> list[StoredResponse] | None:
            rows = db.execute(
                "WITH RECURSIVE chain(id, previous_id, depth) AS ("
                " SELECT id, previous_id, 0 FROM responses WHERE id = ?"
                " UNION ALL SELECT r.id, r.previous_id, c.depth + 1 FROM responses r"
                " JOIN chain c ON r.id = c.previous_id)"
                " SELECT r.response, r.input_items, r.previous_id, r.cancel_requested,"
                " r.dp_rank FROM chain c JOIN responses r ON r.id = c.id ORDER BY c.depth DESC",
                (response_id,)).fetchall()
            chain = [_row(r) for r in rows]
            if not chain or chain[0].previous_id is not None:
                return None  # unknown, or an ancestor is gone
            return chain

        return await self._run(read)

    async def count(self) -> int:
        return await self._run(lambda db: db.execute(
            "SELECT COUNT(*) FROM responses").fetchone()[0])


def _get(db: sqlite3.Connection, response_id: str) -> StoredResponse | None:
    row = db.execute("SELECT response, input_items, previous_id, cancel_requested, dp_rank "
                     "FROM responses WHERE id = ?", (response_id,)).fetchone()
    return None if row is None else _row(row)


def _row(row: tuple[str, str, str | None, int, int | None]) -> StoredResponse:
    return StoredResponse(json.loads(row[0]), json.loads(row[1]), row[2], bool(row[3]),
                          row[4])


def _make_table(db: sqlite3.Connection) -> None:
    """The table, and the `dp_rank` column in a file made before it existed."""
    db.execute(_SCHEMA)
    if "dp_rank" in {c[1] for c in db.execute("PRAGMA table_info(responses)")}:
        return
    try:
        db.execute("ALTER TABLE responses ADD COLUMN dp_rank INTEGER")
    except sqlite3.OperationalError as e:  # another API server added it first
        if "duplicate column" not in str(e):
            raise
