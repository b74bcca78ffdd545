"""The SQLite files of trackers (MLflow's ``mlflow.db``, trackio's ``<project>.db``), opened
read-only: reading never changes a store, not even its journal mode, and waits for a writer."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

__all__ = ["MAGIC", "columns", "connect", "is_sqlite"]

MAGIC = b"SQLite format 3\x00"
_BUSY = 10.0  # seconds a query waits for a writer's lock


def is_sqlite(location: str) -> bool:
    """Whether ``location`` is a regular file that starts as an SQLite database does."""
    try:
        with open(location, "rb") as file:
            return file.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def connect(location: str) -> sqlite3.Connection | None:
    """A read-only connection to the database at ``location``, or None when it cannot be
    opened."""
    try:
        uri = Path(location).resolve().as_uri() + "?mode=ro"
        return sqlite3.connect(uri, uri=True, timeout=_BUSY, check_same_thread=False)
    except (sqlite3.Error, OSError, ValueError):
        return None


def columns(connection: sqlite3.Connection) -> dict[str, set[str]]:
    """The columns of each table ({} when the file is no database it can read)."""
    found: dict[str, set[str]] = {}
    with contextlib.suppress(sqlite3.Error):
        names = [row[0] for row in connection.execute("SELECT name FROM sqlite_master")]
        for name in names:
            rows = connection.execute("SELECT name FROM pragma_table_info(?)", (name,))
            found[name] = {row[0] for row in rows}
    return found
