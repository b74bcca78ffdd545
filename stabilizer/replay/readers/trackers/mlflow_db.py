"""`MlflowDb`: MLflow's SQLite store, ``mlflow.db`` (MLflow's default store since 3.7).

Read with SQLite itself, read-only, from the ``runs`` and ``metrics`` tables (their columns have
stayed the same since MLflow 1.x). Not through MLflow's client: it opens only a database of its
own schema revision (``mlflow.store.db.utils._verify_schema``: any other revision raises until
``mlflow db upgrade`` rewrites the file), so a store written by another MLflow version could not
be read without changing it, and it creates its tables in a file that has none. MLflow stores a
NaN as 0 with ``is_nan`` set, and ±inf as ±1.7976931348623157e308 (``sanitize_metric_value``):
both are read back as they were logged. Metrics come in the order they were written (``rowid``),
one row a metric.
"""

from __future__ import annotations

import math
import sqlite3
import sys
from typing import Any, ClassVar

from .sqlite import SqliteStore, columns, connect, is_sqlite
from .stores import PAGE, Row, Run

__all__ = ["MlflowDb", "mlflow_value"]


def mlflow_value(value: float, is_nan: bool = False) -> float:
    """A metric value as logged: MLflow stores NaN as 0 with ``is_nan``, ±inf as ±max float."""
    if is_nan:
        return math.nan
    if abs(value) == sys.float_info.max:
        return math.copysign(math.inf, value)
    return value


class MlflowDb(SqliteStore):
    """An MLflow SQLite store (see the module docstring)."""

    format: ClassVar[str] = "mlflow"
    what: ClassVar[str] = "this MLflow store"

    def __init__(
        self, location: str, connection: sqlite3.Connection, nan: bool, follow: bool
    ) -> None:
        super().__init__(location, connection, follow)
        self._nan = nan

    @classmethod
    def at(cls, location: str, follow: bool = False) -> MlflowDb | None:
        connection = connect(location, follow) if is_sqlite(location) else None
        if connection is None:
            return None
        tables = columns(connection)
        metrics = tables.get("metrics", set())
        if "runs" in tables and {"run_uuid", "key", "value", "step"} <= metrics:
            return cls(location, connection, "is_nan" in metrics, follow)
        connection.close()
        return None

    def runs(self) -> list[Run]:
        query = (
            "SELECT run_uuid, name FROM runs WHERE lifecycle_stage IS NOT 'deleted' "
            "ORDER BY start_time, run_uuid"
        )
        return [Run(key, name or key) for key, name in self.query(query, ())]

    def rows(self, run: Run, cursor: Any) -> tuple[list[Row], Any]:
        nan = "is_nan" if self._nan else "0"
        query = (
            f"SELECT rowid, key, value, step, {nan} FROM metrics "
            "WHERE run_uuid = ? AND rowid > ? ORDER BY rowid LIMIT ?"
        )
        found = self.query(query, (run.key, cursor or 0, PAGE))
        rows: list[Row] = [
            (int(step), {key: mlflow_value(float(value), bool(is_nan))})
            for _, key, value, step, is_nan in found
            if isinstance(value, (int, float)) and isinstance(step, int)
        ]
        return rows, (found[-1][0] if found else cursor)
