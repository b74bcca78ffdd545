"""The SQLite files of trackers (MLflow's ``mlflow.db``, trackio's ``<project>.db``), opened
read-only: reading never changes a store, not even its journal mode, and waits for a writer."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Any

from ..base import LogReadError
from .stores import Store

__all__ = ["MAGIC", "SqliteStore", "columns", "connect", "is_sqlite"]

MAGIC = b"SQLite format 3\x00"
_BUSY = 10.0  # seconds a query waits for a writer's lock


def is_sqlite(location: str) -> bool:
    """Whether ``location`` is a regular file that starts as an SQLite database does (never
    opened otherwise: a pipe with no writer would block)."""
    try:
        if not Path(location).is_file():
            return False
        with open(location, "rb") as file:
            return file.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def connect(location: str, follow: bool = False) -> sqlite3.Connection | None:
    """A read-only connection to the database at ``location``, or None when it cannot be
    opened.

    A database in WAL mode (trackio's) that no one has open (no ``-wal`` file beside it) is read
    as immutable unless it is to be followed: SQLite would otherwise leave ``-wal`` and ``-shm``
    files beside it, even for a read-only connection.
    """
    try:
        path = Path(location).resolve()
        idle = not follow and _wal(path) and not path.with_name(path.name + "-wal").exists()
        uri = path.as_uri() + ("?mode=ro&immutable=1" if idle else "?mode=ro")
        return sqlite3.connect(uri, uri=True, timeout=_BUSY, check_same_thread=False)
    except (sqlite3.Error, OSError, ValueError):
        return None


def _wal(path: Path) -> bool:
    """Whether the database's header says WAL mode (its read and write versions are 2)."""
    with open(path, "rb") as file:
        return file.read(20)[18:20] == b"\x02\x02"


def columns(connection: sqlite3.Connection) -> dict[str, set[str]]:
    """The columns of each table ({} when the file is no database it can read)."""
    found: dict[str, set[str]] = {}
    with contextlib.suppress(sqlite3.Error):
        names = [row[0] for row in connection.execute("SELECT name FROM sqlite_master")]
        for name in names:
            rows = connection.execute("SELECT name FROM pragma_table_info(?)", (name,))
            found[name] = {row[0] for row in rows}
    return found


class SqliteStore(Store):
    """A store in an SQLite file: its queries, on one read-only connection, or, for a store
    that is followed, each on a connection of its own. A connection opened before its writer
    turned the file to WAL mode (trackio does it just after creating its tables) would go on
    reading the main file alone, never what the writer appends to the ``-wal`` file.

    Args:
        location: The database.
        connection: A read-only connection to it (closed at once when following).
        follow: Whether the store is followed.
    """

    def __init__(self, location: str, connection: sqlite3.Connection, follow: bool) -> None:
        super().__init__(location)
        self._connection: sqlite3.Connection | None = None if follow else connection
        if follow:
            connection.close()

    def query(self, query: str, args: tuple[object, ...]) -> list[Any]:
        """The rows of ``query``.

        Raises:
            LogReadError: It failed, or the database cannot be opened again.
        """
        try:
            if self._connection is not None:
                return self._connection.execute(query, args).fetchall()
            fresh = connect(self.location, follow=True)
            if fresh is None:
                raise sqlite3.OperationalError("it cannot be opened again")
            with contextlib.closing(fresh):
                return fresh.execute(query, args).fetchall()
        except sqlite3.Error as exc:
            raise LogReadError(f"{self.location}: cannot read {self.what} ({exc})") from None

    def close(self) -> None:
        """Close the connection held (a followed store holds none)."""
        if self._connection is not None:
            self._connection.close()
            self._connection = None
