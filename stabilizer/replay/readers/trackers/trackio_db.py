"""`TrackioDb`: a trackio project's SQLite file, ``<TRACKIO_DIR>/<project>.db``.

trackio (Hugging Face's local-first tracker) keeps each project in one SQLite file (in WAL mode):
a ``metrics`` table of one row per ``trackio.log`` call, the run's name, trackio's step, and the
metrics as a JSON object, with ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` for the values JSON
has no word for (``trackio.utils.serialize_values``). Read with SQLite itself, read-only: trackio's
own reader finds a project by name in the ``TRACKIO_DIR`` fixed when trackio is imported and opens
it to write (it sets the journal mode). Rows come in the order they were written (``id``).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from .rows import number
from .sqlite import SqliteStore, columns, connect, is_sqlite
from .stores import PAGE, Row, Run

__all__ = ["TrackioDb"]


class TrackioDb(SqliteStore):
    """A trackio project's database (see the module docstring)."""

    format: ClassVar[str] = "trackio"
    what: ClassVar[str] = "this trackio project"

    @classmethod
    def at(cls, location: str, follow: bool = False) -> TrackioDb | None:
        connection = connect(location, follow) if is_sqlite(location) else None
        if connection is None:
            return None
        metrics = columns(connection).get("metrics", set())
        if {"run_name", "step", "metrics"} <= metrics:
            return cls(location, connection, follow)
        connection.close()
        return None

    def runs(self) -> list[Run]:
        query = "SELECT run_name, MIN(id) FROM metrics GROUP BY run_name ORDER BY MIN(id)"
        return [Run(name, name) for name, _ in self.query(query, ()) if isinstance(name, str)]

    def rows(self, run: Run, cursor: Any) -> tuple[list[Row], Any]:
        query = (
            "SELECT id, step, metrics FROM metrics WHERE run_name = ? AND id > ? "
            "ORDER BY id LIMIT ?"
        )
        found = self.query(query, (run.key, cursor or 0, PAGE))
        rows: list[Row] = []
        for _, step, logged in found:
            values = _values(logged)
            if values:
                rows.append((step if isinstance(step, int) else None, values))
        return rows, (found[-1][0] if found else cursor)


def _values(logged: object) -> dict[str, float]:
    """The numbers of a row's JSON object (media, tables and text left out)."""
    if not isinstance(logged, (str, bytes)):
        return {}
    try:
        parsed = json.loads(logged)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(parsed, dict):
        return {}
    values = {}
    for name, value in parsed.items():
        found = number(value)
        if found is not None:
            values[str(name)] = found
    return values
