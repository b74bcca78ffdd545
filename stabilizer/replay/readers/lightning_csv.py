"""`LightningCsvReader`: the ``metrics.csv`` of Lightning's ``CSVLogger``.

The header holds ``epoch``, ``step`` and one column per logged name; rows are sparse: the train
metrics of a step and its validation metrics are separate rows with empty cells elsewhere. Rows of
the same step next to each other merge into one record (later cells win); a blank line ends the
step being read, as `IDLE` does in a followed file (the logger writes its rows in batches).
Column names map through the shared aliases (``train_loss_step`` → ``loss``, ``lr-AdamW`` → ``lr``,
``grad_2.0_norm/<param>`` → per-group norms, ``stability/<key>`` → ``<key>``); the rest pass
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
import re
from collections.abc import Iterator
from typing import IO, ClassVar

from stabilizer.core.records import StepRecord
from stabilizer.core.signals import LOSS

from ._keys import KeyMap
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
                    elif (cells := columns.cells(row)) is not None:
                        yield from steps.row(*cells, rows.line_num, columns.held_out)
                break
            except csv.Error as exc:  # a row the csv module refuses (a cell over its limit)
                self.note("skipped", f"a row is not CSV ({exc}): skipped", rows.line_num)
        yield from steps.done()


class _StepRows:
    """The step being read: rows of one step next to each other merge (later cells win)."""

    def __init__(self) -> None:
        self.keys, self.segments = KeyMap(), Segments()
        self.step: int | None = None
        self.raw: dict[str, float] = {}
        self.trained: int | None = None  # the last step a row not held out alone went to

    def row(
        self, step: int, values: dict[str, float], line: int, held_out: frozenset[str]
    ) -> list[Item]:
        """The items a row of ``step`` completes: the step before it, a restart. A row of
        ``held_out`` columns alone behind the training rows is counted at the last of them."""
        trained = self.trained
        if trained is not None and step < trained and held_out and held_out.issuperset(values):
            step = trained
        else:
            self.trained = step
        if step == self.step:
            self.raw.update(values)
            return []
        done = self.done()
        restart = self.segments.restart(step, line)
        if restart is not None:
            done.append(restart)
        self.step, self.raw = step, values
        return done

    def done(self) -> list[Item]:
        """The step being read, as a record (if any): no row of it follows."""
        if self.step is None:
            return []
        record = StepRecord(self.step, self.keys.values(self.raw))
        self.step, self.raw = None, {}
        return [record]


class _Columns:
    """A header's columns: where the step is, and the named value columns (worked out once a
    header, not once a row)."""

    def __init__(self, header: list[str]) -> None:
        self.step = header.index("step") if "step" in header else None
        loss = _loss_column(header)
        self.named = [
            (i, LOSS if name == loss else name)
            for i, name in enumerate(header)
            if name not in ("step", "epoch")
        ]
        self.held_out = frozenset(name for _, name in self.named if _words(name)[0] in HELD_OUT)

    def cells(self, row: list[str]) -> tuple[int, dict[str, float]] | None:
        """A row's step and its non-empty cells by column name; None for a row without a step
        or with a cell that is no number."""
        if self.step is None:
            return None
        try:
            step = int(float(row[self.step]))
            width = len(row)
            cells = {name: float(row[i]) for i, name in self.named if i < width and row[i]}
        except (ValueError, IndexError, OverflowError):
            return None
        return step, cells


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
