"""`StateDB`: the SQLite file of /v1/files and /v1/batches (`batches.sqlite` in the
server's state directory), shared by every API server of one server.

Tables: `files` (one row per stored file: id, purpose, name, size, creation time;
the contents are a file of their own, `files/<id>`), `batches` (one row per batch:
its object as JSON, its status, its cancel mark and the lease of the API server
running it) and `batch_lines` (one row per answered input line: the output line,
whether it succeeded, and which API server answered it).

Rules, enforced here:

* WAL mode (readers never block the one writer; writers wait up to
  `sqlite.BUSY_TIMEOUT_S` for each other); the file is created 0600. A line's result
  is committed (synchronous=FULL: on disk before the commit returns) before it
  counts anywhere, so a server killed at any moment has lost no answered line.
* All access runs on one worker thread per process (sqlite3 calls block), never
  on the event loop: `dpserve.server.sqlite.SQLiteThread`, which the Responses
  API's store (`dpserve.server.responses.store`) uses for its own file too.

Not here: what the rows mean (`dpserve.server.batches.file_store`,
`dpserve.server.batches.store`), where the directory is (`dpserve.server.state_dir`).
"""

from __future__ import annotations

import os
import sqlite3

from dpserve.errors import ConfigError
from dpserve.server.sqlite import SQLiteThread, open_sqlite

DB_FILE = "batches.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    status TEXT NOT NULL,
    batch TEXT NOT NULL,            -- the batch object (JSON), request_counts aside
    total INTEGER NOT NULL DEFAULT 0,
    api_key_id TEXT,                -- who created it (its lines salt the cache as theirs)
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    owner TEXT,                     -- the API server running it (NULL: none)
    lease_until REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,          -- 1-based line number in the input file
    ok INTEGER NOT NULL,            -- 1: the output file; 0: the error file
    result TEXT NOT NULL,           -- the output line (JSON)
    runner TEXT NOT NULL,           -- the API server that answered it
    PRIMARY KEY (batch_id, line)
) WITHOUT ROWID;
"""


def db_path(state_dir: str) -> str:
    return os.path.join(state_dir, DB_FILE)


def init_state_db(state_dir: str) -> None:
    """Create the file (0600) and its tables before any API server opens it;
    ConfigError when it is not a usable SQLite file."""
    path = db_path(state_dir)
    try:
        open_sqlite(path, _make_tables, durable=True).close()
    except (OSError, sqlite3.Error) as e:
        raise ConfigError(f"--state-dir {state_dir}: {path}: {e}") from None


def _make_tables(db: sqlite3.Connection) -> None:
    db.executescript(_SCHEMA)


class StateDB(SQLiteThread):
    """The state directory's file (module docstring)."""

    def __init__(self, state_dir: str) -> None:
        super().__init__(db_path(state_dir), _make_tables, "batch-store", durable=True)
        self.state_dir = state_dir
