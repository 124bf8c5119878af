"""`StateDB`: the SQLite file of /v1/files and /v1/batches (`batches.sqlite` in the
server's state directory), shared by every API server of one server.

Tables: `files` (one row per stored file: id, purpose, name, size, creation time;
the contents are a file of their own, `files/<id>`), `batches` (one row per batch:
its object as JSON, its status, its cancel mark and the lease of the API server
running it) and `batch_lines` (one row per answered input line: the output line,
whether it succeeded, and which API server answered it).

Rules, enforced here:

* WAL mode (readers never block the one writer; writers wait up to
  `BUSY_TIMEOUT_S` for each other); the file is created 0600. A line's result
  is committed (synchronous=FULL: on disk before the commit returns) before it
  counts anywhere, so a server killed at any moment has lost no answered line.
* All access runs on one worker thread per process (sqlite3 calls block), never
  on the event loop: `SQLiteThread`, which the Responses API's store
  (`dpserve.server.responses.store`) uses for its own file too.

Not here: what the rows mean (`dpserve.server.file_store`,
`dpserve.server.batch_store`), where the directory is (`dpserve.server.state_dir`).
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from dpserve.errors import ConfigError

BUSY_TIMEOUT_S = 10.0
DB_FILE = "batches.sqlite"
MEMORY = ":memory:"  # `open_sqlite`'s private in-memory database
_T = TypeVar("_T")

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


def open_sqlite(path: str, setup: Callable[[sqlite3.Connection], None],
                durable: bool = False) -> sqlite3.Connection:
    """A connection to `path` (created 0600 if missing; `MEMORY`: a private in-memory
    database), in WAL mode, autocommit, after `setup` made its tables. `durable`:
    synchronous=FULL (a commit is on disk when it returns)."""
    if path != MEMORY and not os.path.exists(path):
        os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
    db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    if path != MEMORY:
        db.execute("PRAGMA journal_mode=WAL")
    if durable:
        db.execute("PRAGMA synchronous=FULL")
    setup(db)
    return db


class SQLiteThread:
    """One connection to an SQLite file, opened and used only on its own thread
    (sqlite3 calls block: never on the event loop)."""

    def __init__(self, path: str, setup: Callable[[sqlite3.Connection], None],
                 name: str, durable: bool = False) -> None:
        self.path = path
        self._setup = setup
        self._durable = durable
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._db: sqlite3.Connection | None = None

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:  # opened on this thread, used only here
            self._db = open_sqlite(self.path, self._setup, self._durable)
        return self._db

    async def run(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """`fn(connection)` on the connection's thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(self._conn()))

    def connect(self) -> None:
        """Open the file now (blocks; for start-up: a broken file fails it)."""
        self._executor.submit(self._conn).result(timeout=BUSY_TIMEOUT_S)

    def close(self) -> None:
        def shut() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        self._executor.submit(shut).result(timeout=BUSY_TIMEOUT_S)
        self._executor.shutdown(wait=False)


class StateDB(SQLiteThread):
    """The state directory's file (module docstring)."""

    def __init__(self, state_dir: str) -> None:
        super().__init__(db_path(state_dir), _make_tables, "batch-store", durable=True)
        self.state_dir = state_dir
