"""`LightningCsvReader`: the ``metrics.csv`` of Lightning's ``CSVLogger``.

The header holds ``epoch``, ``step`` and one column per logged name; rows are sparse: the train
metrics of a step and its validation metrics are separate rows with empty cells elsewhere. Rows of
the same step next to each other merge into one record (later cells win). Column names map
through the shared aliases (``train_loss_step`` → ``loss``, ``lr-AdamW`` → ``lr``,
``grad_2.0_norm/<param>`` → per-group norms, ``stability/<key>`` → ``<key>``); the rest pass
through. A repeated header (two files concatenated) starts over with the new columns.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from typing import IO, ClassVar

from ..records import StepRecord
from ._keys import KeyMap
from ._lines import text_lines
from .base import BaseReader, record

__all__ = ["LightningCsvReader"]


class LightningCsvReader(BaseReader):
    """Reads a Lightning ``metrics.csv`` (see the module docstring)."""

    format: ClassVar[str] = "lightning_csv"

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        first = next((line for line in head if line.strip()), "")
        cells = [cell.strip().strip('"') for cell in first.split(",")]
        if "step" not in cells or len(cells) < 2:
            return 0.0
        return 0.95 if "epoch" in cells else 0.8

    def _records(self, stream: IO[bytes]) -> Iterator[StepRecord]:
        keys, plan, index = KeyMap(), [], -1  # type: KeyMap, list[tuple[int, str]], int
        step, raw, last = None, {}, -1  # type: int | None, dict[str, float], int
        for lineno, row in enumerate(self._rows(stream), 1):
            if "step" in row:  # a header: the columns to read, by index
                index = row.index("step")
                plan = [(i, name) for i, name in enumerate(row) if name not in ("step", "epoch")]
                continue
            try:
                new = int(float(row[index])) if index >= 0 else None
                cells = {name: float(row[i]) for i, name in plan if i < len(row) and row[i]}
            except (ValueError, IndexError, OverflowError):
                continue
            if new is None or new == step:
                raw.update(cells)
                continue
            if step is not None:
                yield record(step, keys.values(raw))
            if new < last:
                self.segment(new, last, "", lineno)
            step, raw, last = new, cells, new
        if step is not None:
            yield record(step, keys.values(raw))

    def _rows(self, stream: IO[bytes]) -> Iterator[list[str]]:
        """The CSV rows; a row the csv module refuses (a cell over its limit) is skipped."""
        rows = csv.reader(text_lines(stream, self.notes))
        while True:
            try:
                yield next(rows)
            except StopIteration:
                return
            except csv.Error as exc:
                self.note("skipped", f"a row is not CSV ({exc}): skipped", rows.line_num)
                yield []
