"""`MlflowServer`: the runs of an MLflow tracking server, ``mlflow:<tracking URI>``.

``mlflow:http://127.0.0.1:5000`` (any URI MLflow's client takes) is read through MLflow's own
client (``pip install 'stabilizer-lightning[mlflow]'``), which talks to that server and to no one
else: its usage telemetry is switched off (``MLFLOW_DISABLE_TELEMETRY``) before it is imported,
and a server that does not answer fails after one retry, not after MLflow's default seven. Each
look fetches every metric's history and keeps the values not seen before, merged in the order
they were logged (timestamp, then step).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from ..base import LogReadError
from .mlflow_db import mlflow_value
from .rows import missing_extra
from .stores import Row, Run, Store

__all__ = ["PREFIX", "MlflowServer"]

PREFIX = "mlflow:"


class MlflowServer(Store):
    """A tracking server's runs (see the module docstring).

    Args:
        location: ``mlflow:<tracking URI>``.
    """

    format: ClassVar[str] = "mlflow"
    what: ClassVar[str] = "this MLflow tracking server"

    def __init__(self, location: str) -> None:
        super().__init__(location)
        self.uri = location.removeprefix(PREFIX)
        self._client = _client(self.uri)

    @classmethod
    def at(cls, location: str, follow: bool = False) -> MlflowServer | None:
        return cls(location) if location.startswith(PREFIX) else None

    def runs(self) -> list[Run]:
        experiments = self._call(self._client.search_experiments)
        ids = [experiment.experiment_id for experiment in experiments]
        found = self._call(
            self._client.search_runs, ids, order_by=["attributes.start_time ASC"]
        ) if ids else []  # fmt: skip
        return [Run(run.info.run_id, run.info.run_name or run.info.run_id) for run in found]

    def rows(self, run: Run, cursor: Any) -> tuple[list[Row], Any]:
        seen: dict[str, int] = dict(cursor or {})
        keys = self._call(self._client.get_run, run.key).data.metrics
        points = []
        for key in sorted(keys):
            history = self._call(self._client.get_metric_history, run.key, key)
            points += [(m.timestamp, m.step, key, m.value) for m in history[seen.get(key, 0) :]]
            seen[key] = len(history)
        points.sort(key=lambda point: (point[0], point[1]))
        return [(step, {key: mlflow_value(value)}) for _, step, key, value in points], seen

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except Exception as exc:  # the client's errors: connection, HTTP, a run not found
            what = " ".join(str(exc).split())[:300]
            raise LogReadError(f"{self.location}: {type(exc).__name__}: {what}") from None


def _client(uri: str) -> Any:
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"  # nothing but the server is contacted
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise missing_extra("mlflow", "an MLflow tracking server") from None
    return MlflowClient(tracking_uri=uri)
