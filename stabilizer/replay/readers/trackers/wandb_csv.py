"""`WandbCsvReader` and `WandbPanel`: the CSV files a W&B run's metrics are saved as.

Two shapes:

- A run's history, saved with ``run.history().to_csv(...)`` or ``pd.DataFrame(run.scan_history())``
  (the shape in W&B's docs, "Export your data"): a column per logged name and W&B's own
  ``_step``, ``_runtime``, ``_timestamp`` (pandas' index first, unnamed, unless ``index=False``);
  ``NaN`` or an empty cell where a row has no value. ``run.history()`` samples 500 rows unless
  asked for more (``samples=``): a spike between samples is not in the file.
- A panel exported from W&B's web UI ("Export panel" → CSV; wandb#5349, #6474)::

      "Step","sun-12 - train/loss","sun-12 - train/loss__MIN","sun-12 - train/loss__MAX"
      "1","10.98","10.98","10.98"

  The first column is the panel's x axis (its name as chosen: ``Step``, ``epoch``, a metric;
  a wall-time axis is no step: the rows' positions are), then ``<run> - <metric>`` per run and
  metric, each with ``__MIN``/``__MAX`` companions, which are the sampling's bounds and left out.
  Several runs side by side make a `WandbPanel` store: each is a run of its own
  (``export.csv#<run>``).

Rows become records as `TrackerRows` says: the trainer's counter (``train/global_step``) where
logged, else ``_step`` or the panel's x axis.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar

from .._lines import text_lines
from .._source import open_source
from ..base import BaseReader, Item, LogReadError, Note
from .rows import TrackerRows
from .stores import Row, Run, Store

__all__ = ["WandbCsvReader", "WandbPanel"]

_COMPANIONS = ("__MIN", "__MAX")
_SEPARATOR = " - "
_HEAD = 1 << 16  # bytes of a file read for its header


@dataclass
class _Shape:
    """What a header says: the x column of a panel (None: a history), and each run's columns."""

    x: int | None
    time_axis: bool = False
    runs: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    companions: bool = False

    @classmethod
    def of(cls, cells: list[str]) -> _Shape | None:
        names = [cell.strip() for cell in cells]
        if "_step" in names:
            return cls(None, runs={"": [(i, name) for i, name in enumerate(names) if name]})
        if len(names) < 2 or not names[0] or _SEPARATOR in names[0]:
            return None
        time_axis = "time" in names[0].lower()
        shape = cls(0, time_axis)
        for index, name in enumerate(names[1:], 1):
            if name.endswith(_COMPANIONS):
                shape.companions = True
            elif name:
                run, separator, metric = name.rpartition(_SEPARATOR)
                if not separator or not run or not metric:
                    return None
                shape.runs.setdefault(run, []).append((index, metric))
        return shape if shape.runs else None

    def rows(self, cells: Iterator[list[str]], run: str) -> Iterator[Row]:
        """The rows of ``run`` (the only one of a history: ``""``)."""
        columns = self.runs[run]
        for position, row in enumerate(cells, 1):
            values = {name: value for at, name in columns if (value := _cell(row, at)) is not None}
            if self.x is None:
                step = values.get("_step")
                yield (int(step) if step is not None and math.isfinite(step) else None), values
            elif values:
                x = position if self.time_axis else _cell(row, self.x)
                if x is not None and math.isfinite(x):
                    yield int(x), values


def _cell(row: list[str], at: int) -> float | None:
    """A cell as a number (``NaN``, ``inf`` too); None when empty, missing or no number."""
    if at >= len(row) or not row[at]:
        return None
    try:
        return float(row[at])
    except ValueError:
        return None


def _header(head: list[str]) -> _Shape | None:
    first = next((line for line in head if line.strip()), "")
    try:
        return _Shape.of(next(csv.reader([first])))
    except (csv.Error, StopIteration):
        return None


class WandbCsvReader(BaseReader):
    """Reads a W&B history CSV, or one run of a panel export (see the module docstring).

    Args:
        notes: A list to append notes to.
        run: The run of a panel export to read; None: the first.
    """

    format: ClassVar[str] = "wandb_csv"

    def __init__(self, notes: list[Note] | None = None, run: str | None = None) -> None:
        super().__init__(notes)
        self.run = run

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        shape = _header(head)  # a panel without W&B's __MIN/__MAX columns: any text with " - "
        return 0.9 if shape is not None and (shape.x is None or shape.companions) else 0.0

    def _items(self, stream: IO[bytes]) -> Iterator[Item]:
        rows = TrackerRows(self.note)
        for own, values in _rows_of(stream, self.notes, self.run, self.note):
            yield from rows.add(own, values)
        yield from rows.done()


def _rows_of(
    stream: IO[bytes], notes: list[Note], run: str | None, note: Callable[[str, str], None]
) -> Iterator[Row]:
    """The rows of one run of a W&B CSV (the first when ``run`` is None)."""
    cells = csv.reader(text_lines(stream, notes))
    try:
        shape = None
        while shape is None:
            shape = _Shape.of(next(cells))
    except StopIteration:
        return
    except csv.Error as exc:
        raise LogReadError(f"not a W&B CSV export ({exc})") from None
    names = list(shape.runs)
    chosen = names[0] if run is None else run
    if chosen not in shape.runs:
        raise LogReadError(f"no run {run!r} in this W&B export (runs: {', '.join(names)})")
    if len(names) > 1 and run is None:
        note("source", f"{len(names)} runs side by side: reading the first, {chosen}")
    if shape.time_axis:
        note("format", "the x axis is time: records are numbered by row")
    try:
        yield from shape.rows(cells, chosen)
    except csv.Error as exc:  # a row the csv module refuses: what came before stands
        note("truncated", f"stopped at a row that is not CSV ({exc})")


class WandbPanel(Store):
    """A W&B panel export of several runs side by side: a store of them."""

    format: ClassVar[str] = "wandb_csv"
    what: ClassVar[str] = "this W&B export"

    def __init__(self, location: str, runs: list[str]) -> None:
        super().__init__(location)
        self._runs = runs

    @classmethod
    def at(cls, location: str, follow: bool = False) -> WandbPanel | None:
        try:
            if not Path(location).is_file():  # (a pipe with no writer would block)
                return None
            with open(location, "rb") as file:
                head = file.read(_HEAD)
        except OSError:
            return None
        if b"\x00" in head:
            return None
        shape = _header(head.decode("utf-8", "replace").splitlines()[:5])
        if shape is None or shape.x is None or not shape.companions or len(shape.runs) < 2:
            return None
        return cls(location, list(shape.runs))

    def runs(self) -> list[Run]:
        return [Run(name, name) for name in self._runs]

    def rows(self, run: Run, cursor: Any) -> tuple[list[Row], Any]:
        if cursor:  # an export never grows
            return [], cursor
        notes: list[Note] = []
        source = open_source(self.location, notes)
        try:
            rows = list(_rows_of(source.stream, notes, run.key, lambda kind, message: None))
        finally:
            source.close()
        return rows, True
