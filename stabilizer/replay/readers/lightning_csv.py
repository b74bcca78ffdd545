"""`LightningCsvReader`: the ``metrics.csv`` of Lightning's ``CSVLogger``.

The header holds ``epoch``, ``step`` and one column per logged name; rows are sparse: the train
metrics of a step and its validation metrics are separate rows with empty cells elsewhere. Rows of
the same step next to each other merge into one record (later cells win, key by key); a blank
line ends the step being read, as `IDLE` does in a followed file (the logger writes its rows in
batches). Column names map through the shared aliases, once a header, not once a row
(``train_loss_step`` → ``loss``, ``lr-AdamW`` → ``lr``, ``grad_2.0_norm/<param>`` → per-group
norms, ``stability/<key>`` → ``<key>``); the rest pass
through. A header with no alias of the loss but one training column whose name has the word
``loss`` in it (``train_loss_batch``, ``batch_loss``; not ``val_...``, ``test_...``; its per-step
column before its ``_epoch`` mean) has that column as its loss. A row of held-out metrics alone
(``val_...``, ``test_...``) whose step is behind the training rows' is counted at the last
training step: Lightning logs an evaluation loop's ``on_step`` metrics with the loop's own batch
counter, which is no restart of training. A repeated header (two files concatenated) starts over
with the new columns.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Iterator
from typing import IO, ClassVar

from stabilizer.core.records import StepRecord
from stabilizer.core.signals import LOSS

from ._keys import PCT, SUMSQ, KeyMap
from ._lines import Segments, text_lines
from .aliases import HELD_OUT
from .base import BaseReader, Item

__all__ = ["LightningCsvReader"]

_WORD = re.compile(r"[^a-z0-9]+")


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
        rows, steps = csv.reader(text_lines(stream, self.notes)), _StepRows()
        columns = _Columns([])
        while True:
            try:
                for row in rows:  # a csv.Error ends this loop; the next row starts a new one
                    if not row:  # a blank line, or a followed file waits (`IDLE`)
                        yield from steps.done()
                    elif "step" in row:  # a header: the columns to read
                        columns = _Columns(row)
                    elif (read := columns.cells(row)) is not None:
                        step, cells = read
                        held_out = steps.behind(step) and columns.held_out_only(row)
                        yield from steps.row(step, cells, rows.line_num, held_out)
                break
            except csv.Error as exc:  # a row the csv module refuses (a cell over its limit)
                self.note("skipped", f"a row is not CSV ({exc}): skipped", rows.line_num)
        yield from steps.done()


class _StepRows:
    """The step being read: rows of one step next to each other merge (later cells win)."""

    def __init__(self) -> None:
        self.segments = Segments()
        self.step: int | None = None
        self.values: dict[str, float] = {}
        self.parts: dict[str, tuple[str, float]] | None = None  # `SUMSQ` cells by name
        self.trained: int | None = None  # the last step a row not held out alone went to

    def behind(self, step: int) -> bool:
        """Whether a row of ``step`` is behind the training rows read so far."""
        return self.trained is not None and step < self.trained

    def row(self, step: int, cells: _Cells, line: int, held_out: bool) -> tuple[Item, ...]:
        """The items a row of ``step`` completes: the step before it, a restart. A row of
        held-out columns alone behind the training rows (``held_out``) is counted at the last
        of them."""
        if held_out and self.trained is not None:
            step = self.trained
        else:
            self.trained = step
        if step == self.step:
            values, parts = cells
            self.values.update(values)
            if parts:
                self.parts = {**(self.parts or {}), **parts}
            return ()
        record = self._record()
        restart = self.segments.restart(step, line)
        self.step, (self.values, self.parts) = step, cells
        items = () if record is None else (record,)
        return items if restart is None else (*items, restart)

    def done(self) -> tuple[Item, ...]:
        """The step being read, as a record (if any): no row of it follows."""
        record = self._record()
        self.step = None
        return () if record is None else (record,)

    def _record(self) -> StepRecord | None:
        if self.step is None:
            return None
        values = self.values
        if self.parts:  # per-parameter norms: the root of the sum of squares per group
            squares: dict[str, float] = {}
            for key, value in self.parts.values():
                squares[key] = squares.get(key, 0.0) + value * value
            values.update((key, math.sqrt(total)) for key, total in squares.items())
        return StepRecord.from_floats(self.step, values)


_Cells = tuple[dict[str, float], dict[str, tuple[str, float]] | None]


class _Columns:
    """A header's columns, worked out once a header, not once a row: where the step is, each
    value column's signal key (`KeyMap`), and which columns are held-out metrics."""

    def __init__(self, header: list[str]) -> None:
        self.step = header.index("step") if "step" in header else None
        loss, keys = _loss_column(header), KeyMap()
        self.named: list[tuple[int, str]] = []  # (column, key)
        self.percent: list[tuple[int, str]] = []  # `PCT` columns: percentages read as 0..1
        self.summed: list[tuple[int, str, str]] = []  # (column, name, key): `SUMSQ` columns
        held_out: list[int] = []
        trained: list[int] = []
        for i, name in enumerate(header):
            if name in ("step", "epoch"):
                continue
            (held_out if _words(name)[0] in HELD_OUT else trained).append(i)
            found = keys.lookup(LOSS if name == loss else name)
            if found is None:
                continue
            key, how = found
            if how == SUMSQ:
                self.summed.append((i, name, key))
            else:
                (self.percent if how == PCT else self.named).append((i, key))
        self.held_out, self.trained = tuple(held_out), tuple(trained)

    def cells(self, row: list[str]) -> tuple[int, _Cells] | None:
        """A row's step and its non-empty cells by signal key (and its `SUMSQ` cells by
        name); None for a row without a step or with a cell that is no number."""
        if self.step is None:
            return None
        try:
            step = int(float(row[self.step]))
            width = len(row)
            values = {key: float(row[i]) for i, key in self.named if i < width and row[i]}
            if self.percent:
                values.update(
                    (k, float(row[i]) / 100.0) for i, k in self.percent if i < width and row[i]
                )
            parts = (
                {name: (key, float(row[i])) for i, name, key in self.summed if i < width and row[i]}
                if self.summed
                else None
            )
        except (ValueError, IndexError, OverflowError):
            return None
        return step, (values, parts)

    def held_out_only(self, row: list[str]) -> bool:
        """Whether the header has held-out columns and a row has cells in no other column."""
        width = len(row)
        return bool(self.held_out) and not any(i < width and row[i] for i in self.trained)


def _words(name: str) -> list[str]:
    return _WORD.split(name.lower().strip("_/ "))


def _loss_column(header: list[str]) -> str | None:
    """The column that is the training loss where no name is an alias of it: the one training
    column whose name has the word ``loss`` (its per-step one before its ``_epoch`` mean); None
    where a name is an alias of the loss, or none or several say loss."""
    keys = KeyMap()
    if any((found := keys.lookup(name)) is not None and found[0] == LOSS for name in header):
        return None
    said = [
        name for name in header
        if "loss" in (words := _words(name)) and words[0] not in HELD_OUT
    ]  # fmt: skip
    stepwise = [name for name in said if _words(name)[-1] != "epoch"]
    said = stepwise or said
    return said[0] if len(said) == 1 else None
