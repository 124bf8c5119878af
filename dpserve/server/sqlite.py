"""`SQLiteThread`: one SQLite connection on a thread of its own; `open_sqlite`.

The server's SQLite files (the Responses API's store, the state of /v1/files and
/v1/batches) open through here, alike: created 0600, WAL mode (readers never block
the one writer; writers wait up to `BUSY_TIMEOUT_S` for each other), autocommit.
sqlite3 calls block, so a process uses a file only on its connection's thread,
never on the event loop.

Not here: any file's tables (`dpserve.server.responses.store`,
`dpserve.server.batches.state_db`).
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

BUSY_TIMEOUT_S = 10.0
MEMORY = ":memory:"  # `open_sqlite`'s private in-memory database
_T = TypeVar("_T")


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
