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

from stabilizer.core.records import StepRecord

from ._keys import KeyMap
from ._lines import Segments, text_lines
from .base import BaseReader, Item

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

    def _items(self, stream: IO[bytes]) -> Iterator[Item]:
        keys, segments, rows = KeyMap(), Segments(), csv.reader(text_lines(stream, self.notes))
        header: list[str] = []
        step, raw = None, {}  # type: int | None, dict[str, float]
        while True:
            try:
                for row in rows:  # a csv.Error ends this loop; the next row starts a new one
                    if "step" in row:  # a header: the columns to read
                        header = row
                        continue
                    cells = _cells(header, row)
                    if cells is None:
                        continue
                    new, values = cells
                    if new == step:
                        raw.update(values)
                        continue
                    if step is not None:
                        yield StepRecord(step, keys.values(raw))
                    restart = segments.restart(new, rows.line_num)
                    if restart is not None:
                        yield restart
                    step, raw = new, values
                break
            except csv.Error as exc:  # a row the csv module refuses (a cell over its limit)
                self.note("skipped", f"a row is not CSV ({exc}): skipped", rows.line_num)
        if step is not None:
            yield StepRecord(step, keys.values(raw))


def _cells(header: list[str], row: list[str]) -> tuple[int, dict[str, float]] | None:
    """A row's step and its non-empty cells by column name; None for a row without a step or
    with a cell that is no number."""
    try:
        step = int(float(row[header.index("step")]))
        cells = {
            name: float(cell)
            for name, cell in zip(header, row, strict=False)
            if cell and name not in ("step", "epoch")
        }
    except (ValueError, IndexError, OverflowError):
        return None
    return step, cells
