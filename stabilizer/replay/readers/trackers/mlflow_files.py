"""`MlflowFiles`: MLflow's file store, an ``mlruns/`` tree (MLflow's default before 3.7).

``mlruns/<experiment id>/<run id>/`` holds a run: ``meta.yaml`` (its name, start time, whether it
was deleted) and ``metrics/<key>``, one file per metric (a key with ``/`` in it is a path below
``metrics/``), one line per value: ``<timestamp ms> <value> <step>`` (no step before MLflow 1.0).
The store is the whole tree, an experiment's directory or one run's; deleted runs are left out.

Read as files, with no MLflow: MLflow 3.x refuses to open a file store unless
``MLFLOW_ALLOW_FILE_STORE=true`` (it is in maintenance mode), while the trees it wrote stay on
users' disks. The values of the metric files are merged in the order they were logged (by
timestamp, then step; each file is in log order), a page at a time, each file read from where
the last look left it: a growing run is followed line by line. A line not yet ended is left
for the next look.
"""

from __future__ import annotations

import heapq
import os
import re
from collections.abc import Generator
from pathlib import Path
from typing import Any, ClassVar

from .stores import PAGE, Row, Run, Store

__all__ = ["MlflowFiles"]

_FIELD = re.compile(r"^(\w+): *'?(.*?)'?\s*$", re.MULTILINE)  # meta.yaml: plain `key: value`
Point = tuple[int, int, str, float, int]  # timestamp, step, key, value, offset after the line


class MlflowFiles(Store):
    """An MLflow file store (see the module docstring)."""

    format: ClassVar[str] = "mlflow"
    what: ClassVar[str] = "this mlruns tree"

    @classmethod
    def at(cls, location: str, follow: bool = False) -> MlflowFiles | None:
        path = Path(location)
        try:
            if _is_run(path) or _is_experiment(path) or any(map(_is_experiment, _dirs(path))):
                return cls(location)
        except OSError:
            return None
        return None

    def runs(self) -> list[Run]:
        path = Path(self.location)
        if _is_run(path):
            found = [path]
        else:
            found = _experiment_runs(path) or [r for d in _dirs(path) for r in _experiment_runs(d)]
        runs = [run for run in map(_run, found) if run is not None]
        return [run for _, run in sorted(runs, key=lambda item: item[0])]

    def rows(self, run: Run, cursor: Any) -> tuple[list[Row], Any]:
        offsets: dict[str, int] = dict(cursor or {})
        streams = [_points(key, file, offsets.get(key, 0)) for key, file in _metrics(run.path)]
        rows: list[Row] = []
        try:
            for _, step, key, value, end in heapq.merge(*streams, key=lambda p: (p[0], p[1])):
                rows.append((step, {key: value}))
                offsets[key] = end
                if len(rows) >= PAGE:
                    break
        finally:
            for stream in streams:
                stream.close()
        return rows, offsets


def _dirs(path: Path) -> list[Path]:
    return sorted(child for child in path.iterdir() if child.is_dir()) if path.is_dir() else []


def _is_run(path: Path) -> bool:
    return (path / "meta.yaml").is_file() and (path / "metrics").is_dir()


def _is_experiment(path: Path) -> bool:
    """An experiment's directory: its ``meta.yaml`` names an experiment, not a run (it may have
    no run yet)."""
    try:
        meta = (path / "meta.yaml").read_text(errors="replace")[:65536]
    except OSError:
        return False
    return "experiment_id:" in meta and "run_id:" not in meta


def _experiment_runs(path: Path) -> list[Path]:
    """The runs of an experiment's directory ([] when it is none)."""
    return [child for child in _dirs(path) if _is_run(child)] if _is_experiment(path) else []


def _run(path: Path) -> tuple[tuple[int, str], Run] | None:
    """A run directory's (start time, id) and run; None for a deleted run."""
    try:
        meta = dict(_FIELD.findall((path / "meta.yaml").read_text(errors="replace")[:65536]))
    except OSError:
        return None
    if meta.get("lifecycle_stage") == "deleted":
        return None
    start = int(meta["start_time"]) if meta.get("start_time", "").isdigit() else 0
    key = meta.get("run_id") or path.name
    return (start, key), Run(key, meta.get("run_name") or key, str(path))


def _metrics(run: str) -> list[tuple[str, Path]]:
    """Each metric's key and file (``metrics/train/loss`` is ``train/loss``)."""
    top = Path(run) / "metrics"
    found = []
    for folder, _, files in os.walk(top):
        for name in files:
            file = Path(folder) / name
            found.append((file.relative_to(top).as_posix(), file))
    return sorted(found)


def _points(key: str, file: Path, offset: int) -> Generator[Point, None, None]:
    """The values of a metric file after byte ``offset``, each with the offset after its line;
    lines that are no value are passed over."""
    try:
        with open(file, "rb") as lines:
            lines.seek(offset)
            for line in lines:
                if not line.endswith(b"\n"):  # still being written
                    return
                offset += len(line)
                point = _point(line.split())
                if point is not None:
                    yield point[0], point[2], key, point[1], offset
    except OSError:
        return


def _point(fields: list[bytes]) -> tuple[int, float, int] | None:
    """``timestamp value [step]`` as numbers; None for a line that is no such thing."""
    if len(fields) not in (2, 3):
        return None
    try:
        step = int(fields[2]) if len(fields) == 3 else 0
        return int(fields[0]), float(fields[1]), step
    except ValueError:
        return None
